"""Turn the user's choices (workloads, modes, size, device) into a list of runs and notes on what is left out.

Unknown names are user errors (``ValueError`` naming the accepted ones). Modes that are known but cannot
run here (a mixprec part not in this build, or fp16 on a CPU at a size where it would take hours) are left
out with a note saying why, so the bench still runs with what is available.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from mixprec.bench import data as datasets
from mixprec.bench.modes import ALIASES, DEFAULT_MODES, MODES, UNRUNNABLE
from mixprec.bench.runner import Job
from mixprec.bench.workloads import SIZES, WORKLOADS

CPU_FP16_NOTE = (
    "fp16 on a CPU: there is no fast fp16 matmul/conv kernel (about 100x slower than fp32), so fp16 modes "
    "run on a CPU only in small configurations and their step time shows that cost, not what a GPU gains"
)


@dataclass
class Plan:
    """The runs to do, in order, and human-readable notes about anything left out."""

    jobs: list[Job]
    device: str
    size: str
    notes: list[str] = field(default_factory=list)


def split_names(values: Iterable[str] | None) -> list[str]:
    """Accept ``--modes a,b --modes c`` and ``--modes a b``: flatten and drop empty names."""
    return [name.strip() for value in values or () for name in value.split(",") if name.strip()]


def _unknown(kind: str, name: str, accepted: Sequence[str]) -> ValueError:
    close = difflib.get_close_matches(name, accepted, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ValueError(f"unknown {kind} {name!r}{hint}; accepted: {', '.join(accepted)}")


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` when available else ``cpu``; validates ``cpu``, ``cuda`` and ``cuda:N``."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    kind = device.split(":", 1)[0]
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"unknown device {device!r}; accepted: auto, cpu, cuda, cuda:N")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device {device!r} requested but torch.cuda.is_available() is False (torch {torch.__version__})"
        )
    return device


def resolve_workloads(names: Sequence[str]) -> list[str]:
    """The workloads named, checked; none or ``["all"]``: every workload that runs by default (the
    GPU-sized ``lm-gemm`` runs only when named)."""
    if not names or names == ["all"]:
        return [name for name, spec in WORKLOADS.items() if spec.default]
    for name in names:
        if name not in WORKLOADS:
            raise _unknown("workload", name, [*WORKLOADS, "all"])
    return list(dict.fromkeys(names))


def resolve_modes(names: Sequence[str], device_type: str) -> list[str]:
    """Mode names with aliases resolved for ``device_type``; the device's defaults when ``names`` is empty."""
    if not names:
        return list(DEFAULT_MODES[device_type])
    accepted = [*MODES, *ALIASES]
    resolved = []
    for name in names:
        if name in ALIASES:
            if device_type not in ALIASES[name]:
                raise ValueError(f"mode {name!r} cannot run on {device_type}: {UNRUNNABLE[name]}")
            name = ALIASES[name][device_type]
        elif name not in MODES:
            raise _unknown("mode", name, accepted)
        resolved.append(name)
    return list(dict.fromkeys(resolved))


def _check_inputs(plan: Plan, workloads: Sequence[str], data: str | None, images: str | None) -> None:
    """Check ``--data`` and ``--images`` once, up front; note when the workload that reads one is not run."""
    for value, option, reader in ((data, "--data", "lm"), (images, "--images", "cnn")):
        if value is None:
            continue
        if option == "--data":
            datasets.check_text_file(value)
        elif datasets.missing_idx_files(value):
            datasets.idx_images(value)  # raises, naming the missing files
        # every workload that loads its data as ``reader`` does reads the option (lm-gemm reads --data)
        readers = [name for name, spec in WORKLOADS.items() if spec.load is WORKLOADS[reader].load]
        if not set(readers) & set(workloads):
            plan.notes.append(
                f"{option} is read by the {', '.join(readers)} workload(s) only, none of which is in this run"
            )


def refuse_gpu_presets(
    workloads: Sequence[str],
    size: str,
    steps: int | None = None,
    *,
    work: str | None = None,
    hint: str = "run it with --device cuda, or with --size tiny to check it on a CPU",
) -> None:
    """A ValueError for a workload preset sized for a GPU (``Preset.cpu`` False), with its cost on a CPU.

    ``steps``: the bench's steps per run (None: the preset's); ``work``: what the caller would do instead
    of training them (``mixprec plan``'s passes), said after a step's time; ``hint``: what to run instead.
    """
    for name in workloads:
        preset = WORKLOADS[name].presets[size]
        if preset.cpu:
            continue
        minutes = preset.cost_ms / 6e4
        hours = (steps or preset.steps) * preset.cost_ms / 3.6e6
        work = work or f"{hours:.0f} h per mode for its {steps or preset.steps} steps"
        raise ValueError(
            f"workload {name!r} at size {size!r} is sized for a GPU: one step is about {minutes:.0f} min on "
            f"a 2-core CPU, {work}; {hint}"
        )


def make_plan(
    workloads: Sequence[str] = (),
    modes: Sequence[str] = (),
    size: str = "default",
    steps: int | None = None,
    device: str = "auto",
    seed: int = 0,
    data: str | None = None,
    images: str | None = None,
    threads: int | None = None,
    compiled: bool = False,
) -> Plan:
    """Validate the choices and list the runs: each available mode, in the order given, for each workload.

    ``compiled``: every run's model is ``torch.compile``-d after its mode prepared it (a note says so).

    Raises:
        ValueError: an unknown size, workload, mode or device, too few steps, nothing runnable, a
            workload preset sized for a GPU on a CPU (``lm-gemm`` above ``tiny``), or a
            ``data``/``images`` input that cannot be used (FileNotFoundError when it does not exist).
    """
    if size not in SIZES:
        raise _unknown("size", size, SIZES)
    if steps is not None and steps < 2:
        raise ValueError(f"steps must be at least 2 (one warm-up step and one timed step), got {steps}")
    device = resolve_device(device)
    device_type = device.split(":", 1)[0]
    workload_names = resolve_workloads(workloads)
    if device_type == "cpu":
        refuse_gpu_presets(workload_names, size, steps)
    mode_names = resolve_modes(modes, device_type)
    plan = Plan(jobs=[], device=device, size=size)
    _check_inputs(plan, workload_names, data, images)

    runnable = []
    for name in mode_names:
        reason = MODES[name].unavailable(device)
        if reason is None:
            runnable.append(name)
        else:
            plan.notes.append(f"mode {name} left out: {reason}")
    if not runnable:
        raise ValueError("no requested mode can run in this build:\n  " + "\n  ".join(plan.notes))

    fp16_skipped: list[str] = []
    for workload in workload_names:
        preset = WORKLOADS[workload].presets[size]
        for name in runnable:
            if device_type == "cpu" and MODES[name].dtype == torch.float16 and not preset.cpu_fp16:
                fp16_skipped.append(f"{workload}/{name}")
                continue
            plan.jobs.append(
                Job(workload, name, size, steps, seed, device, data, images, threads, 0, compiled)
            )
        mine = [job.mode for job in plan.jobs if job.workload == workload]
        if "fp32" in mine and len(mine) > 1:  # the A/A run: see mixprec.bench.stats
            plan.jobs.append(
                Job(workload, "fp32", size, steps, seed, device, data, images, threads, 1, compiled)
            )
    if any(MODES[name].dtype == torch.float16 for name in runnable) and device_type == "cpu":
        plan.notes.append(
            CPU_FP16_NOTE + (f"; left out at size {size}: {', '.join(fp16_skipped)}" if fp16_skipped else "")
        )
    if "fp32" not in runnable:
        plan.notes.append("speedup needs an fp32 run: add fp32 to --modes")
    if compiled:
        plan.notes.append(
            "--compile: every mode's model torch.compile-d (default backend) after the mode prepared it; "
            "the first steps compile (warm-up, untimed), held-out evaluation recompiles for eval mode"
        )
    if not plan.jobs:
        raise ValueError("nothing to run:\n  " + "\n  ".join(plan.notes))
    return plan
