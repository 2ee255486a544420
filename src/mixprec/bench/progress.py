"""How long the bench will take and how far it has got: the estimate printed first, then a bar or lines.

The estimate adds, per run, its steps times the preset's ``cost_ms`` (a step's time on the reference:
this project's 2-core CPU, one thread per run) plus the start of its worker process and its evaluation,
scaled by how fast this machine does a fixed fp32 matmul right now, with the threads the runs will use,
against the reference (so a busy machine gets a longer estimate). It is rough (the probe is all matmul,
the steps are not); the time left that the bar and the lines show adapts to the real pace.
Once the first rounds have run, the projected total is compared with the estimate and a line says so
when they differ by more than 25% (:class:`Progress`), also when a time-budget cut changes the total.
On a CPU the time left is the estimate's until enough rounds have run to judge the pace, then the
estimate's times the median pace of the recent rounds, each run's first (warm-up) round left out, so
that the worker processes starting at once or a compile do not throw it off by minutes. A line repeated
for the same step says "still ..., for N s now". On CUDA there is no reference machine: nothing is
estimated until every run of the first workload has trained one round; the estimate is then the time
so far plus the rest of the plan at the pace of those rounds (their wall time over their reference
seconds; the process starts before them are not part of that pace), and later corrections compare
against that. On a terminal a tqdm bar spans the whole plan
(work measured in estimated seconds, so its "left" adapts to the real pace); elsewhere, and on a
terminal too small to draw it (0x0 under ``script``), a plain line goes to stderr after a round when
10 s have passed, and at least every 15 s while a round is running.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import IO, Any

import torch

from mixprec.bench.runner import Job

REFERENCE_PROBE_S = 0.022  # _probe_seconds() on the reference (2-core x86_64, one thread)
START_S = 3.5  # one worker process: spawn, import torch, load data, probe step (reference)
EVAL_S = {"lm": 2.0, "cnn": 0.7, "lm-gemm": 2.0}
#: torch.compile of a run's model (``--compile``): inductor's first compile of a small model on the
#: reference, counted with the run's fixed part (it happens in the first, untimed steps)
COMPILE_S = 40.0
LINE_EVERY_S = 10.0
HEARTBEAT_S = 14.0  # + up to 1 s of polling: a line at least every 15 s
MIN_BAR_COLUMNS = 40  # narrower (or a 0x0 terminal): plain lines instead of a bar
REESTIMATE_OFF = 0.25  # say so when the projected total is off the announced one by more than this
MEASURE_MIN_S = 10.0  # estimated seconds of training rounds before the pace is trusted
#: the pace is the median of the last this many rounds' (wall / estimated) ratios, each run's first
#: round left out: it holds the warm-up steps (and a compile), which say nothing of the rounds to come
PACE_ROUNDS = 9


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


def start_s(job: Job) -> float:
    """Reference seconds of ``job``'s fixed part before its steps: the worker's start, its compile."""
    return START_S + (COMPILE_S if job.compiled else 0.0)


def job_cost_s(job: Job) -> float:
    """Reference-machine seconds of the training steps of ``job``."""
    return job.total_steps * job.preset.cost_ms / 1e3


def estimate_s(jobs: Sequence[Job], factor: float) -> float:
    """Estimated wall seconds for ``jobs`` on a machine ``factor`` times slower than the reference."""
    total = sum(job_cost_s(job) + start_s(job) + EVAL_S.get(job.workload, 0.2) for job in jobs)
    return total * factor


def format_duration(seconds: float) -> str:
    """``"45 s"``, ``"3 min 5 s"``."""
    seconds = max(0, round(seconds))
    return f"{seconds} s" if seconds < 60 else f"{seconds // 60} min {seconds % 60} s"


def can_draw_bar(stream: IO[str]) -> bool:
    """Whether a bar can be drawn on ``stream``: a terminal at least ``MIN_BAR_COLUMNS`` wide.

    A terminal of size 0x0 (``script`` without a size, some CI runners) is a tty on which tqdm draws
    nothing at all, so it gets the plain lines instead.
    """
    try:
        return stream.isatty() and os.get_terminal_size(stream.fileno()).columns >= MIN_BAR_COLUMNS
    except (AttributeError, OSError, ValueError):
        return False


class Progress:
    """Progress over the whole plan: ``advance`` by estimated seconds, ``where`` names what is running.

    The estimate is checked against the real pace once the first rounds have run (``measured`` work of
    at least ``MEASURE_MIN_S`` estimated seconds), and from then on at every step of progress and every
    wait: when the projected total
    (elapsed + what is left at the pace so far) differs from the last one announced by more than
    ``REESTIMATE_OFF`` (25%), a line says so and gives the corrected total.

    Args:
        jobs: the plan's runs (their order numbers the "run i of N").
        factor: the machine factor (None: unknown, as on CUDA; the first round of every run of the first
            workload measures it, see the module docstring).
        bar: draw a tqdm bar if ``stream`` can show one (see ``can_draw_bar``), else plain lines.
        stream: where plain lines and the bar go (default stderr).
        clock: seconds, monotonic (default ``time.perf_counter``; tests pass a fake one).
    """

    def __init__(
        self,
        jobs: Sequence[Job],
        factor: float | None,
        bar: bool,
        stream: IO[str] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.jobs = list(jobs)
        self.factor = factor or 1.0
        self.total = estimate_s(self.jobs, self.factor)
        self.announced_total = self.total
        #: the first total said, None until known (on CUDA: after the first round of every run)
        self.first_total: float | None = None if factor is None else self.total
        self.corrections: list[tuple[float, float]] = []  # (elapsed s, corrected total s)
        self.stream = stream or sys.stderr
        self.clock = clock
        self.done = 0.0
        self.measured = 0.0
        self.started = clock()
        self.last_line = self.started
        self.label = "starting"
        # Without a reference the pace is the training rounds' own: their wall seconds (each from the
        # ``where`` that starts it to its ``advance``) over their estimated seconds.
        self.from_rounds = factor is None
        self.rounds_wall = 0.0
        self._rounds_seen = 0
        self._first_rounds = sum(1 for job in self.jobs if job.workload == self.jobs[0].workload)
        self._mark = self.started
        self._round_index: int | None = None  # the round ``where`` named last (None: a start or an eval)
        self._ratios: list[float] = []  # wall / estimated seconds of each round after a run's first
        # the label and start of the step the last plain line named, so that a repeat says "still"
        self._printed: tuple[str, float] | None = None
        self._bar = self._make_bar() if bar and can_draw_bar(self.stream) else None

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
        label = f"{phase + ' ' if phase else ''}{job.workload} {job.label} (run {number} of {len(self.jobs)})"
        if round_index is not None:
            label += f", round {round_index + 1} of {rounds}"
        self.label = label
        self._round_index = round_index
        self._mark = self.clock()
        if self._bar is not None:
            self._bar.set_description_str(label, refresh=True)

    def advance(self, estimated_s: float, measured: bool = False) -> None:
        """Count ``estimated_s`` (reference seconds x factor) of the plan as done.

        ``measured``: the work was training rounds (not process starts or evaluation), whose pace is
        what the estimate is checked against.
        """
        now = self.clock()
        self.done = min(self.done + estimated_s * self.factor, self.total)
        if measured:
            self.measured += estimated_s * self.factor
            self.rounds_wall += now - self._mark
            self._rounds_seen += 1
            if self._round_index != 0 and estimated_s > 0:
                self._ratios = [*self._ratios, (now - self._mark) / (estimated_s * self.factor)]
                self._ratios = self._ratios[-PACE_ROUNDS:]
        self._mark = now
        if self.first_total is None:
            self._first_estimate()
        else:
            self._check_estimate()
        if self._bar is not None and not can_draw_bar(self.stream):
            self._bar.close()  # the terminal shrank to nothing: plain lines from now on
            self._bar = None
        if self._bar is not None:
            self._bar.n = round(self.done, 1)
            self._bar.refresh()
        elif self.clock() - self.last_line >= LINE_EVERY_S:
            self._line()

    def replan(self, before: Sequence[Job], after: Sequence[Job]) -> None:
        """Runs not started yet were re-chosen (``mixprec.bench.budget``): ``before[i]`` is now
        ``after[i]``; the total follows, and the new total is the one later corrections compare with."""
        for old, new in zip(before, after, strict=True):
            self.jobs[self.jobs.index(old)] = new
        self.total += estimate_s(after, self.factor) - estimate_s(before, self.factor)
        if self._bar is not None:
            self._bar.total = round(self.total, 1)
        if self.first_total is not None and self._trusted():
            self._check_estimate(why="rounds re-chosen to fit the time budget")
        else:
            self.announced_total = self.projected_total_s()

    def _first_estimate(self) -> None:
        """Without a reference: once every run of the first workload has trained a round, the machine
        factor is their pace, the plan is rescaled to it and its total is said."""
        if self._rounds_seen < self._first_rounds or self.measured <= 0 or self.rounds_wall <= 0:
            return
        pace = self.rounds_wall / self.measured  # wall seconds per (reference) second
        self.factor *= pace
        self.total, self.done, self.measured = self.total * pace, self.done * pace, self.measured * pace
        if self._bar is not None:
            self._bar.total = round(self.total, 1)
        self.first_total = self.announced_total = self.projected_total_s()
        self._say(
            f"estimate from the first round of each mode: about {format_duration(self.first_total)} in all, "
            f"{format_duration(self.left_s())} left"
        )

    def pace(self) -> float:
        """Wall seconds per reference second so far (the machine factor the runs showed): the whole
        run's, or without a reference the training rounds' own. Call once some work is done."""
        if self.from_rounds and self.measured > 0:
            return self.factor * self.rounds_wall / self.measured
        return self.factor * (self.clock() - self.started) / self.done

    def projected_total_s(self) -> float:
        """Elapsed seconds plus ``left_s``: the whole run's wall time at the pace so far."""
        return self.clock() - self.started + self.left_s()

    def _trusted(self) -> bool:
        """Whether enough training rounds ran (``MEASURE_MIN_S``, or 5% of a short plan) to judge the pace."""
        return self.measured >= min(MEASURE_MIN_S, 0.05 * self.total)

    def _check_estimate(self, why: str = "") -> None:
        if not self._trusted() or self.done >= self.total:
            return
        projected = self.projected_total_s()
        if abs(projected - self.announced_total) <= REESTIMATE_OFF * self.announced_total:
            return
        elapsed = self.clock() - self.started
        pace = projected / self.announced_total
        self.announced_total = projected
        self.corrections.append((elapsed, projected))
        because = (
            f"{why}; the total is now {pace:.2f}x the last estimate"
            if why
            else f"the rounds so far ran at {pace:.2f}x the pace of the last estimate"
        )
        self._say(
            f"estimate corrected: {because}; "
            f"now about {format_duration(projected)} in all, {format_duration(self.left_s())} left"
        )

    def _say(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def heartbeat(self) -> None:
        """Called while waiting on a run: check the estimate, keep the bar's clock moving, or print a
        line every 15 s."""
        self._check_estimate()
        if self._bar is not None:
            self._bar.refresh()
        elif self.clock() - self.last_line >= HEARTBEAT_S:
            self._line()

    def left_s(self) -> float:
        """Seconds left at the pace so far: the whole run's (elapsed over work done), or without a
        reference the training rounds' own (process starts on a GPU machine say nothing of its pace)."""
        if self.from_rounds and self.measured > 0:
            return (self.total - self.done) * self.rounds_wall / self.measured
        return max(self.total - self.done, 0.0) * self.round_pace()

    def round_pace(self) -> float:
        """How much slower than estimated the rounds run: the median (wall / estimated) of the last
        ``PACE_ROUNDS`` rounds after each run's first, once the pace is trusted; 1.0 before. A median of
        recent rounds follows a load that comes or goes, and one slow round (a process starting, the
        warm-up's compile) does not throw the time left off by minutes."""
        if not self._trusted() or not self._ratios:
            return 1.0
        return statistics.median(self._ratios)

    def _line(self) -> None:
        self.last_line = self.clock()
        elapsed = self.last_line - self.started
        label = self.label
        if (label, self._mark) == self._printed:  # the same step still running: say so, not the same line
            label = f"still {label}, for {format_duration(self.last_line - self._mark)} now"
        self._printed = (self.label, self._mark)
        percent = 100.0 * self.done / self.total if self.total else 100.0
        left = (
            f"about {format_duration(self.left_s())} left"
            if self.first_total is not None
            else "time left known after the first round"
        )
        print(
            f"[{percent:3.0f}%] {label}; {format_duration(elapsed)} elapsed, {left}",
            file=self.stream,
            flush=True,
        )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.n = self._bar.total
            self._bar.close()
            self._bar = None
