"""Fit the bench into a time budget (``--time 5m``): choose each workload's rounds from the estimate.

The estimate (:func:`mixprec.bench.progress.estimate_s`) is linear in the training steps: a fixed part
(each run's process start and evaluation) plus each run's steps times its step cost. When the preset's
rounds would overrun the budget, every workload keeps the same fraction of its rounds (at least
:data:`MIN_ROUNDS`, never more than the preset's), the largest fraction that fits. Before each workload
starts the choice is made again for the workloads still to run, from the time left and the pace the
rounds so far ran at. After each round the running workload may be cut too (:meth:`Budget.cut_rounds`):
to the most rounds that leave the later workloads :data:`MIN_ROUNDS` each; every mode stops at the same
round, its learning-rate schedule (built for the planned steps) truncated alike. Each choice and each cut
is a line in the table's notes, saying what was chosen and why.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Callable, Sequence

from mixprec.bench.progress import EVAL_S, Progress, estimate_s, format_duration, job_cost_s, start_s
from mixprec.bench.runner import Job, RunResult

#: The budget of the default size when ``--time`` is not given (the other sizes run in full then).
DEFAULT_TIME = "5m"
#: Fewest rounds a workload is cut to: the paired speedup needs a few rounds for its interval.
MIN_ROUNDS = 4
_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*(s|m|min)?")


def parse_time(text: str) -> float | None:
    """Seconds of a ``--time`` value: ``"300"``, ``"300s"``, ``"5m"``, ``"4.5m"``, ``"5min"``; None for
    ``"off"`` (no budget).

    Raises:
        ValueError: naming the value and the accepted forms, for anything else or a budget of 0.
    """
    value = str(text).strip().lower()
    if value in ("off", "none"):
        return None
    match = _DURATION.fullmatch(value)
    seconds = float(match.group(1)) * (60 if match and match.group(2) in ("m", "min") else 1) if match else 0
    if not match or not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(
            f"--time must be a positive duration in seconds or minutes (e.g. 300, 300s, 5m, 4.5m) or 'off', "
            f"got {text!r}"
        )
    return seconds


def _rounds(job: Job) -> int:
    return math.ceil(job.total_steps / job.preset.round_steps)


def _fixed_s(jobs: Sequence[Job]) -> float:
    return sum(start_s(job) + EVAL_S.get(job.workload, 0.2) for job in jobs)


def fit(jobs: Sequence[Job], budget_s: float, factor: float) -> tuple[list[Job], float]:
    """``jobs`` with their steps cut (a whole number of rounds each) to fit ``budget_s`` wall seconds.

    Args:
        jobs: the runs still to do, at the steps they would have without a budget.
        budget_s: the wall seconds left for them.
        factor: wall seconds per reference second (the machine factor, corrected by the pace so far).

    Returns:
        The jobs (the same objects where nothing is cut) and the fraction of rounds kept (1.0: none cut).
        Cut to :data:`MIN_ROUNDS` each, they may still overrun; the caller says so.
    """
    training = sum(job_cost_s(job) for job in jobs) * factor
    room = budget_s - _fixed_s(jobs) * factor
    if training <= room:
        return list(jobs), 1.0
    fraction = max(room, 0.0) / training
    out = []
    for job in jobs:  # whole rounds within the share of the steps, so the estimate stays within the budget
        rounds = max(
            min(MIN_ROUNDS, _rounds(job)), math.floor(fraction * job.total_steps / job.preset.round_steps)
        )
        steps = min(rounds * job.preset.round_steps, job.total_steps)
        out.append(job if steps == job.total_steps else dataclasses.replace(job, steps=steps))
    return out, fraction


def describe(
    before: Sequence[Job], after: Sequence[Job], budget_s: float, estimate_s: float, why: str
) -> str:
    """The table's note on one choice: each workload's rounds kept of its preset's, and why."""
    parts = []
    seen: dict[str, tuple[Job, Job]] = {}
    for old, new in zip(before, after, strict=True):
        seen.setdefault(old.workload, (old, new))
    for workload, (old, new) in seen.items():
        if new.total_steps != old.total_steps:
            parts.append(f"{workload} {_rounds(new)} of {_rounds(old)} rounds ({new.total_steps} steps)")
        else:
            parts.append(f"{workload} all {_rounds(old)} rounds")
    return (
        f"time budget {format_duration(budget_s)}: {', '.join(parts)}; {why} "
        f"(estimate at these rounds {format_duration(estimate_s)})"
    )


class Budget:
    """The bench's time budget over a run: the first choice, then one before each later workload.

    Args:
        budget_s: wall seconds for the whole bench, from the moment ``clock`` reads at construction.
        factor: the machine factor (None on CUDA: no CPU reference, so nothing is cut until the first
            workload has shown the pace).
        notes: the plan's notes (the table prints them); each choice adds one.
        clock: seconds, monotonic (tests pass a fake one).
    """

    def __init__(
        self,
        budget_s: float,
        factor: float | None,
        notes: list[str],
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.budget_s, self.factor, self.notes, self.clock = budget_s, factor, notes, clock
        self.started = clock()
        self.original: dict[tuple[str, str, int], Job] = {}

    def first(self, jobs: Sequence[Job]) -> list[Job]:
        """The jobs cut to the budget at the machine factor (all of them, before anything runs)."""
        self.original = {_key(job): job for job in jobs}
        if self.factor is None:
            self.notes.append(
                f"time budget {format_duration(self.budget_s)}: all rounds to start with (no CPU reference "
                "on this device); the workloads after the first are fitted to the pace it shows"
            )
            return list(jobs)
        chosen, fraction = fit(jobs, self.budget_s, self.factor)
        full = estimate_s(jobs, self.factor)
        if fraction >= 1.0:
            why = "the preset's rounds fit"
        else:
            why = f"the preset's rounds were estimated at {format_duration(full)} on this machine"
            why += f" ({self.factor:.1f}x the reference's time)"
        self._note(jobs, chosen, self.budget_s, self.factor, why, fraction, plan=True)
        return chosen

    def outcome(self, results: Sequence[RunResult]) -> str | None:
        """The closing note: the rounds each workload ran of its preset's, whatever the plan and the cuts
        said before (None before :meth:`first`, or without results)."""
        parts = []
        for workload in dict.fromkeys(r.workload for r in results):
            job = next((j for j in self.original.values() if j.workload == workload), None)
            if job is None:
                continue
            steps = max(r.steps for r in results if r.workload == workload)
            ran, planned = math.ceil(steps / job.preset.round_steps), _rounds(job)
            parts.append(
                f"{workload} all {planned} rounds"
                if ran >= planned
                else f"{workload} {ran} of {planned} rounds"
            )
        if not parts:
            return None
        return (
            f"what ran within the time budget {format_duration(self.budget_s)}: {', '.join(parts)} "
            f"(the preset's rounds; the notes above say when and why any were cut)"
        )

    def rechoose(self, remaining: Sequence[Job], progress: Progress) -> list[Job]:
        """The jobs not started yet, cut anew to the time left at the pace the rounds so far ran at."""
        if not progress.done or not progress.measured:
            return list(remaining)
        elapsed = self.clock() - self.started
        factor = progress.pace()
        originals = [self.original.get(_key(job), job) for job in remaining]
        left = self.budget_s - elapsed
        chosen, fraction = fit(originals, left, factor)
        if [job.total_steps for job in chosen] == [job.total_steps for job in remaining]:
            return list(remaining)
        why = (
            f"re-chosen for {remaining[0].workload} onwards after {format_duration(elapsed)}: the runs "
            f"so far ran at {factor / (self.factor or 1.0):.2f}x the first estimate's pace"
        )
        self._note(originals, chosen, left, factor, why, fraction, total=False)
        progress.replan(remaining, chosen)
        return chosen

    def cut_rounds(self, jobs: Sequence[Job], round_done: int, rounds: int, progress: Progress) -> int:
        """The rounds the running workload's ``jobs`` should end at, after ``round_done`` of ``rounds``.

        At the pace the rounds so far ran at (as :meth:`rechoose` measures it), the largest count, at least
        ``round_done`` and :data:`MIN_ROUNDS` (or ``rounds`` if fewer), that leaves the workloads after
        this one (in ``progress.jobs``) :data:`MIN_ROUNDS` each within the time left. A cut is a note.
        """
        if not jobs or round_done >= rounds or not progress.done or not progress.measured:
            return rounds
        elapsed = self.clock() - self.started
        factor = progress.pace()
        order = list(dict.fromkeys(job.workload for job in progress.jobs))
        running = jobs[0].workload
        after = order[order.index(running) + 1 :] if running in order else []
        later = [_at_least(job) for job in progress.jobs if job.workload in after]
        per_round = sum(job.preset.round_steps * job.preset.cost_ms / 1e3 for job in jobs) * factor
        evaluation = sum(EVAL_S.get(job.workload, 0.2) for job in jobs) * factor
        room = self.budget_s - elapsed - evaluation - estimate_s(later, factor)
        floor = max(round_done, min(MIN_ROUNDS, rounds))
        extra = math.floor(max(room, 0.0) / per_round) if per_round > 0 else rounds
        kept = min(rounds, max(floor, round_done + extra))
        if kept == rounds:
            return rounds
        steps = kept * jobs[0].preset.round_steps
        pace = (
            f"the rounds ran at {factor / self.factor:.2f}x the first estimate's pace"
            if self.factor
            else f"the rounds ran at {factor:.2f}x the reference's time"
        )
        overrun = "" if round_done + extra >= floor else f"; at {kept} rounds it still overruns the budget"
        self.notes.append(
            f"time budget {format_duration(self.budget_s)}: {running} cut to {kept} of {rounds} rounds "
            f"({steps} steps) after {format_duration(elapsed)}: {pace}; every mode stops at round {kept}, "
            f"its LR schedule (built for {rounds} rounds) truncated alike{overrun}"
        )
        return kept

    def _note(
        self,
        before: Sequence[Job],
        after: Sequence[Job],
        budget_s: float,
        factor: float,
        why: str,
        fraction: float,
        total: bool = True,
        plan: bool = False,
    ) -> None:
        if fraction < 1.0 and min(_rounds(job) for job in after) <= MIN_ROUNDS:
            fits = estimate_s(after, factor) <= budget_s
            why += (
                "" if fits else f"; at {MIN_ROUNDS} rounds each it still overruns: use --workload or --modes"
            )
        label = "" if total else "left "
        text = describe(before, after, budget_s, estimate_s(after, factor), why)
        text = text.replace("time budget ", f"time budget {label}", 1)
        if plan:  # said before anything ran: the rounds may be cut later, the last note says what ran
            text = text.replace(":", ", the plan before the first round:", 1)
        self.notes.append(text)


def _at_least(job: Job) -> Job:
    """``job`` at :data:`MIN_ROUNDS` rounds (or all its rounds, if fewer): what a later workload keeps."""
    steps = min(MIN_ROUNDS * job.preset.round_steps, job.total_steps)
    return job if steps == job.total_steps else dataclasses.replace(job, steps=steps)


def _key(job: Job) -> tuple[str, str, int]:
    return job.workload, job.mode, job.replica
