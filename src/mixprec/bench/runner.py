"""One (workload, mode) training run, driven a round of steps at a time so that modes can be interleaved.

Every run starts from the same seed, so all modes of a workload see the same initial weights and the
same batches in the same order. A step's time is the wall time (``time.perf_counter``; CUDA synchronized
on both ends) of everything a user pays for per step: fetching the batch and moving it to the device,
zero_grad, forward, loss, backward, loss scaling, optimizer and scheduler step. Reading the loss and scale
for the log happens after the clock stops.

A :class:`Trainer` is built once (data, probe step, model, optimizer), then :meth:`Trainer.steps` runs a
round of steps when the scheduler (``mixprec.bench.schedule``) asks, and :meth:`Trainer.finish`
measures peak memory and evaluates. Where the trainer lives (this process or a worker process of its
own, which keeps CPU peak memory honest) is :mod:`mixprec.bench.workers`' business.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from mixprec.bench.memory import PeakMemory, SavedBytes, component_bytes
from mixprec.bench.modes import MODES
from mixprec.bench.stats import AA_LABEL
from mixprec.bench.workloads import WORKLOADS


class RunFailed(RuntimeError):
    """A run raised or its process died; the message holds the traceback or exit code."""


@dataclass(frozen=True)
class Job:
    """One (workload, mode) run and everything that decides its outcome.

    ``steps`` overrides the preset's step count; ``data`` is the lm workload's text file,
    ``images`` the cnn workload's directory of IDX files (None: the built-in data), ``threads`` torch's
    CPU thread count for the run (None: leave it as it is). ``compiled``: the prepared model is
    ``torch.compile``-d (default backend), the same way in every mode. ``replica`` 1 is a second run of
    the same mode in a process of its own (the fp32 A/A run that measures the variation between processes).
    """

    workload: str
    mode: str
    size: str = "default"
    steps: int | None = None
    seed: int = 0
    device: str = "cpu"
    data: str | None = None
    images: str | None = None
    threads: int | None = None
    replica: int = 0
    compiled: bool = False

    @property
    def label(self) -> str:
        """The name results carry: the mode, or ``AA_LABEL`` for the fp32 A/A run."""
        if self.replica == 0:
            return self.mode
        return AA_LABEL if self.mode == "fp32" else f"{self.mode} (replica {self.replica})"

    @property
    def preset(self) -> Any:
        return WORKLOADS[self.workload].presets[self.size]

    @property
    def total_steps(self) -> int:
        return self.steps or self.preset.steps

    @property
    def warmup(self) -> int:
        """Steps left out of the timing: the preset's warm-up, at most all but one step."""
        return min(self.preset.warmup, self.total_steps - 1)


@dataclass
class RunResult:
    """What one run measured.

    ``history`` has one entry per step: ``step``, ``round``, ``loss``, ``scale`` (None: the mode does not
    scale), ``skipped`` and ``step_time_ms``. Summary statistics are computed from it by
    ``mixprec.bench.stats``; ``step_time_ms`` here is the median after ``warmup`` steps. ``compiled``:
    the model ran ``torch.compile``-d (``mixprec bench --compile``).
    """

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
    threads: int = 1
    history: list[dict[str, Any]] = field(default_factory=list)
    memory_bytes: dict[str, int] | None = None
    compiled: bool = False


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Trainer:
    """A run in progress: built by the constructor, advanced by :meth:`steps`, closed by :meth:`finish`.

    Args:
        job: what to run.
        fresh_process: whether this process does nothing else, so that CPU peak memory can be trusted.

    Raises:
        KeyError: an unknown workload, mode or size (the plan validates names before this).
    """

    def __init__(self, job: Job, fresh_process: bool = False) -> None:
        self.started = time.perf_counter()
        self.job = job
        if job.threads is not None:
            torch.set_num_threads(job.threads)
        spec, self.mode_spec = WORKLOADS[job.workload], MODES[job.mode]
        preset = spec.presets[job.size]
        self.device = torch.device(job.device)
        self.data = spec.load(preset, job)
        # First use of autograd, the kernels' libraries and the thread pool costs tens of MiB once per
        # process: pay it on a tiny model so that the measured peak is this run's own.
        self.mode_spec.probe(job.device)
        self.memory = PeakMemory(self.device, fresh_process)
        self.memory.start()
        self.workload = spec.build(self.data, preset, job.seed, job.total_steps, self.device)
        self.mode = self.mode_spec.create(self.device.type)
        self.mode.prepare(self.workload.model, self.workload.optimizer)
        if job.compiled:  # after the mode's own swaps (fp8, lowbit, casts): inductor fuses what they added
            self.mode.model = cast(torch.nn.Module, torch.compile(self.mode.model))
        make = self.workload.make_scheduler
        self.scheduler = make(self.mode.torch_optimizer) if make else None
        self.history: list[dict[str, Any]] = []
        self.memory_bytes: dict[str, int] | None = None

    def steps(self, count: int, round_index: int) -> list[float]:
        """Train ``count`` more steps (never past the job's total); returns their step times in ms."""
        count = min(count, self.job.total_steps - len(self.history))
        times = []
        with warnings.catch_warnings():
            # A skipped first step (fp16 overflow) makes torch warn that the scheduler stepped first.
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)`")
            for _ in range(count):
                times.append(self._one_step(round_index))
        return times

    def _one_step(self, round_index: int) -> float:
        device, workload, mode = self.device, self.workload, self.mode
        _sync(device)
        begin = time.perf_counter()
        x, y = next(workload.batches)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        # the last warm-up step (untimed in the statistics) counts the bytes per component once
        counting = len(self.history) == max(self.job.warmup - 1, 0)
        with SavedBytes(mode.model) if counting else contextlib.nullcontext() as saved:
            loss = mode.train_step(x, y, workload.loss_fn)
        if saved is not None:
            self.memory_bytes = component_bytes(mode.model, mode.optimizer, saved.nbytes)
        if self.scheduler is not None:
            self.scheduler.step()
        _sync(device)
        elapsed_ms = (time.perf_counter() - begin) * 1e3
        scale, skipped = mode.observe()  # reading the scale syncs: after the clock stops
        self.history.append(
            {
                "step": len(self.history),
                "round": round_index,
                "loss": float(loss),
                "scale": scale,
                "skipped": skipped,
                "step_time_ms": elapsed_ms,
            }
        )
        return elapsed_ms

    def finish(self) -> RunResult:
        """Read the peak memory, evaluate on held-out data and return the result."""
        peak_mb = self.memory.peak_mb()
        self.workload.model.eval()
        with torch.no_grad():
            final_loss, final_metric = self.workload.evaluate(self.mode.forward)
        timed = [h["step_time_ms"] for h in self.history[self.job.warmup :]] or [math.nan]
        return RunResult(
            workload=self.job.workload,
            mode=self.job.label,
            device=str(self.device),
            dtype=str(self.mode_spec.dtype).removeprefix("torch."),
            steps=len(self.history),
            warmup=self.job.warmup,
            step_time_ms=statistics.median(timed),
            peak_memory_mb=peak_mb,
            memory_method=self.memory.method,
            final_loss=final_loss,
            final_metric=final_metric,
            skipped_steps=self.mode.skipped_steps,
            final_scale=self.history[-1]["scale"] if self.history else None,
            data_source=self.data.source,
            wall_s=time.perf_counter() - self.started,
            threads=torch.get_num_threads(),
            history=self.history,
            memory_bytes=self.memory_bytes,
            compiled=self.job.compiled,
        )


def run_job(job: Job, fresh_process: bool = False, round_steps: int | None = None) -> RunResult:
    """Run ``job`` start to end in this process (rounds of ``round_steps``, default the preset's)."""
    trainer = Trainer(job, fresh_process)
    size = round_steps or job.preset.round_steps
    round_index = 0
    while len(trainer.history) < job.total_steps:
        trainer.steps(size, round_index)
        round_index += 1
    return trainer.finish()
