"""How long the bench will take and how far it has got: the estimate printed first, then a bar or lines.

The estimate adds, per run, its steps times the preset's ``cost_ms`` (a step's time on the reference:
this project's 2-core CPU, one thread per run) plus the start of its worker process and its evaluation,
scaled by how fast this machine does a fixed fp32 matmul right now, with the threads the runs will use,
against the reference (so a busy machine gets a longer estimate). It is rough (the probe is all matmul,
the steps are not); the time left that the bar and the lines show adapts to the real pace.
On a terminal a tqdm bar spans the whole plan (work measured in estimated seconds, so its "left" adapts
to the real pace); elsewhere a plain line goes to stderr after a round when 10 s have passed, and at
least every 15 s while a round is running.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import IO, Any

import torch

from mixprec.bench.runner import Job

REFERENCE_PROBE_S = 0.022  # _probe_seconds() on the reference (2-core x86_64, one thread)
START_S = 3.5  # one worker process: spawn, import torch, load data, probe step (reference)
EVAL_S = {"lm": 2.0, "cnn": 0.7}
LINE_EVERY_S = 10.0
HEARTBEAT_S = 14.0  # + up to 1 s of polling: a line at least every 15 s


def _probe_seconds() -> float:
    """Best of 3 timings of eight 384x384 fp32 matmuls on the CPU."""
    a = torch.randn(384, 384)
    best = float("inf")
    for _ in range(3):
        begin = time.perf_counter()
        for _ in range(8):
            a @ a
        best = min(best, time.perf_counter() - begin)
    return best


def machine_factor(device: str) -> float | None:
    """This CPU's time for the probe over the reference's (>1: slower); None on CUDA (no reference)."""
    if device.startswith("cuda"):
        return None
    return max(_probe_seconds() / REFERENCE_PROBE_S, 0.25)


def job_cost_s(job: Job) -> float:
    """Reference-machine seconds of the training steps of ``job``."""
    return job.total_steps * job.preset.cost_ms / 1e3


def estimate_s(jobs: Sequence[Job], factor: float) -> float:
    """Estimated wall seconds for ``jobs`` on a machine ``factor`` times slower than the reference."""
    total = sum(job_cost_s(job) + START_S + EVAL_S.get(job.workload, 0.2) for job in jobs)
    return total * factor


def format_duration(seconds: float) -> str:
    """``"45 s"``, ``"3 min 5 s"``."""
    seconds = max(0, round(seconds))
    return f"{seconds} s" if seconds < 60 else f"{seconds // 60} min {seconds % 60} s"


class Progress:
    """Progress over the whole plan: ``advance`` by estimated seconds, ``where`` names what is running.

    Args:
        jobs: the plan's runs (their order numbers the "run i of N").
        factor: the machine factor (None: unknown; work is then counted in reference seconds).
        bar: draw a tqdm bar (on a terminal) instead of plain lines.
        stream: where plain lines and the bar go (default stderr).
    """

    def __init__(self, jobs: Sequence[Job], factor: float | None, bar: bool, stream: IO[str] | None = None):
        self.jobs = list(jobs)
        self.factor = factor or 1.0
        self.total = estimate_s(self.jobs, self.factor)
        self.stream = stream or sys.stderr
        self.done = 0.0
        self.started = time.perf_counter()
        self.last_line = self.started
        self.label = "starting"
        self._bar = self._make_bar() if bar else None

    def _make_bar(self) -> Any:
        try:
            from tqdm import tqdm
        except ImportError:
            return None
        return tqdm(
            total=round(self.total, 1),
            file=self.stream,
            bar_format="{desc} {percentage:3.0f}%|{bar}| {elapsed} elapsed, {remaining} left",
            dynamic_ncols=True,
        )

    def where(
        self, job: Job, round_index: int | None = None, rounds: int | None = None, phase: str = ""
    ) -> None:
        """Say what runs now: ``lm O2-bf16 (run 4 of 18), round 3 of 16`` or ``starting lm fp32 (...)``."""
        number = self.jobs.index(job) + 1 if job in self.jobs else 0
        label = f"{phase + ' ' if phase else ''}{job.workload} {job.mode} (run {number} of {len(self.jobs)})"
        if round_index is not None:
            label += f", round {round_index + 1} of {rounds}"
        self.label = label
        if self._bar is not None:
            self._bar.set_description_str(label, refresh=True)

    def advance(self, estimated_s: float) -> None:
        """Count ``estimated_s`` (reference seconds x factor) of the plan as done."""
        self.done = min(self.done + estimated_s * self.factor, self.total)
        if self._bar is not None:
            self._bar.n = round(self.done, 1)
            self._bar.refresh()
        elif time.perf_counter() - self.last_line >= LINE_EVERY_S:
            self._line()

    def heartbeat(self) -> None:
        """Called while waiting on a run: keep the bar's clock moving, or print a line every 15 s."""
        if self._bar is not None:
            self._bar.refresh()
        elif time.perf_counter() - self.last_line >= HEARTBEAT_S:
            self._line()

    def left_s(self) -> float:
        elapsed = time.perf_counter() - self.started
        if self.done <= 0:
            return self.total
        return (self.total - self.done) * elapsed / self.done

    def _line(self) -> None:
        self.last_line = time.perf_counter()
        elapsed = self.last_line - self.started
        percent = 100.0 * self.done / self.total if self.total else 100.0
        print(
            f"[{percent:3.0f}%] {self.label}; {format_duration(elapsed)} elapsed, "
            f"about {format_duration(self.left_s())} left",
            file=self.stream,
            flush=True,
        )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.n = self._bar.total
            self._bar.close()
            self._bar = None
