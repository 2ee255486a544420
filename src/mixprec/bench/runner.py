"""Run one (workload, mode) pair: build from the seed, train with per-step timing, measure memory, evaluate.

Every run starts from the same seed, so all modes of a workload see the same initial weights and the
same batches in the same order. A step's time is the wall time (``time.perf_counter``; CUDA synchronized
on both ends) of everything a user pays for per step: fetching the batch and moving it to the device,
zero_grad, forward, loss, backward, loss scaling, optimizer and scheduler step. The reported step time is
the median after the preset's warm-up steps. Reading the loss and scale for the log happens after the
clock stops.

By default each run executes in a fresh ``spawn``-ed process, so peak memory (see
:mod:`mixprec.bench.memory`) belongs to that run alone and no run inherits another's caches.
"""

from __future__ import annotations

import math
import multiprocessing
import statistics
import sys
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from mixprec.bench.memory import PeakMemory
from mixprec.bench.modes import MODES, TrainMode
from mixprec.bench.workloads import WORKLOADS, Workload


class RunFailed(RuntimeError):
    """A run raised or its process died; the message holds the child's traceback or exit code."""


@dataclass(frozen=True)
class Job:
    """One (workload, mode) run and everything that decides its outcome."""

    workload: str
    mode: str
    size: str = "default"
    steps: int | None = None
    seed: int = 0
    device: str = "cpu"
    data: str | None = None
    progress: bool = False


@dataclass
class RunResult:
    """What one run measured; ``history`` has one entry per step (loss, scale, skipped, step_time_ms)."""

    workload: str
    mode: str
    device: str
    dtype: str
    steps: int
    warmup: int
    step_time_ms: float
    peak_memory_mb: float | None
    memory_method: str
    final_loss: float
    final_metric: float
    skipped_steps: int
    final_scale: float | None
    data_source: str
    wall_s: float
    history: list[dict[str, Any]] = field(default_factory=list)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _progress(job: Job, steps: int) -> Any:
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(
        total=steps,
        desc=f"{job.workload:<9} {job.mode:<16}",
        unit="step",
        leave=False,
        disable=not job.progress,
    )


def _train(
    job: Job, workload: Workload, mode: TrainMode, scheduler: Any, device: torch.device, steps: int
) -> list[dict[str, Any]]:
    """The timed loop; returns one entry per step (loss, scale, skipped, step_time_ms)."""
    history: list[dict[str, Any]] = []
    bar = _progress(job, steps)
    with warnings.catch_warnings():
        # A skipped first step (fp16 overflow) makes torch warn that the scheduler stepped first; expected.
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)`")
        for step in range(steps):
            _sync(device)
            begin = time.perf_counter()
            x, y = next(workload.batches)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = mode.train_step(x, y, workload.loss_fn)
            if scheduler is not None:
                scheduler.step()
            _sync(device)
            elapsed_ms = (time.perf_counter() - begin) * 1e3
            scale, skipped = mode.observe()  # reading the scale syncs: after the clock stops
            history.append(
                {
                    "step": step,
                    "loss": float(loss),
                    "scale": scale,
                    "skipped": skipped,
                    "step_time_ms": elapsed_ms,
                }
            )
            if bar is not None:
                bar.update()
    if bar is not None:
        bar.close()
    return history


def run_job(job: Job, fresh_process: bool = False) -> RunResult:
    """Run ``job`` in this process. ``fresh_process`` says whether CPU peak memory can be trusted."""
    started = time.perf_counter()
    spec, mode_spec = WORKLOADS[job.workload], MODES[job.mode]
    preset = spec.presets[job.size]
    steps = job.steps or preset.steps
    warmup = min(preset.warmup, steps - 1)
    device = torch.device(job.device)
    data = spec.load(preset, job.seed, job.data)

    # First use of autograd, the kernels' libraries and the thread pool costs tens of MiB once per process:
    # pay it on a tiny model so that the measured peak is this run's own.
    mode_spec.probe(job.device)
    memory = PeakMemory(device, fresh_process)
    memory.start()
    workload = spec.build(data, preset, job.seed, steps, device)
    mode = mode_spec.create(device.type)
    mode.prepare(workload.model, workload.optimizer)
    scheduler = workload.make_scheduler(mode.torch_optimizer) if workload.make_scheduler else None

    history = _train(job, workload, mode, scheduler, device, steps)
    peak_mb = memory.peak_mb()

    workload.model.eval()
    with torch.no_grad():
        final_loss, final_metric = workload.evaluate(mode.forward)
    last_scale = history[-1]["scale"] if history else None
    return RunResult(
        workload=job.workload,
        mode=job.mode,
        device=str(device),
        dtype=str(mode_spec.dtype).removeprefix("torch."),
        steps=steps,
        warmup=warmup,
        step_time_ms=statistics.median(h["step_time_ms"] for h in history[warmup:]),
        peak_memory_mb=peak_mb,
        memory_method=memory.method,
        final_loss=final_loss,
        final_metric=final_metric,
        skipped_steps=mode.skipped_steps,
        final_scale=last_scale,
        data_source=data.source,
        wall_s=time.perf_counter() - started,
        history=history,
    )


def _child_main(job: Job, conn: Any) -> None:
    try:
        result = run_job(job, fresh_process=True)
        conn.send(("ok", asdict(result)))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def run_isolated(job: Job) -> RunResult:
    """Run ``job`` in a fresh spawned process and return its result; raises :class:`RunFailed`."""
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=_child_main, args=(job, sender), daemon=True)
    process.start()
    sender.close()
    try:
        status, payload = receiver.recv()
    except EOFError:
        process.join()
        code = process.exitcode
        why = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        hint = " (out of memory?)" if code == -9 else " (its error is printed above)"
        raise RunFailed(
            f"{job.workload}/{job.mode}: the run's process {why} without a result{hint}"
        ) from None
    finally:
        receiver.close()
    process.join()
    if status != "ok":
        raise RunFailed(f"{job.workload}/{job.mode} failed:\n{payload}")
    return RunResult(**payload)


def run_jobs(jobs: list[Job], isolated: bool = True) -> tuple[list[RunResult], list[str]]:
    """Run every job in order; returns the results and one message per failed run."""
    results: list[RunResult] = []
    failures: list[str] = []
    for index, job in enumerate(jobs, 1):
        try:
            result = run_isolated(job) if isolated else run_job(job)
        except RunFailed as exc:
            failures.append(str(exc))
        except Exception:
            failures.append(f"{job.workload}/{job.mode} failed:\n{traceback.format_exc()}")
        else:
            results.append(result)
            loss = "nan" if math.isnan(result.final_loss) else f"{result.final_loss:.4f}"
            print(
                f"[{index}/{len(jobs)}] {job.workload} {job.mode}: {result.step_time_ms:.1f} ms/step, "
                f"loss {loss} ({result.wall_s:.1f} s)",
                file=sys.stderr,
            )
            continue
        print(f"[{index}/{len(jobs)}] {job.workload} {job.mode}: FAILED", file=sys.stderr)
    return results, failures
