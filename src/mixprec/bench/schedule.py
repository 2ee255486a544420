"""Interleave the modes of each workload round by round, so that a busy machine hits every mode alike.

For one workload, every mode's run is started at once (each in a worker process of its own, see
:mod:`mixprec.bench.workers`), then the scheduler hands out rounds: round ``r`` gives each mode
``round_steps`` steps, one mode after another, the order rotated by one each round so that no mode is
always first or last; then round ``r + 1``. A load that comes and goes during the bench thus lands on
all modes of the workload, in time slices of a few steps, and ``mixprec.bench.stats`` pairs each
mode's rounds with fp32's. Workloads run one after another; the results of each are handed to
``on_workload_done`` as soon as it ends, so that they are saved before the next one starts, and after
every round the steps so far of the runs still training go to ``on_round`` (the step log is rewritten
then, so a bench stopped mid-workload keeps every round it finished). A time
budget may shorten the running workload after any round (``cut``): every mode then stops at the same
round, so the modes stay comparable.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from mixprec.bench.progress import EVAL_S, Progress, start_s
from mixprec.bench.runner import Job, RunFailed, RunResult
from mixprec.bench.workers import make_worker

Done = Callable[[list[RunResult]], object]  # the return value, if any, is ignored
#: Called with the runs not started yet before each workload after the first; returns them re-chosen.
Rechoose = Callable[[list[Job]], list[Job]]
#: Called after each round but the last with the workload's runs, the rounds run and the rounds planned;
#: returns the rounds to run (never fewer than those run, never more than planned).
Cut = Callable[[list[Job], int, int], int]


@dataclass
class Running:
    """A run still training, as far as the step log needs it: its workload, mode label and the history
    entries of the rounds it finished (the fields of a RunResult that ``report.write_log`` reads)."""

    workload: str
    mode: str
    history: list[dict[str, Any]] = field(default_factory=list)


#: Called after each round with the results of the workloads done and the runs still training.
Round = Callable[[list[RunResult], list[Running]], object]


def group_by_workload(jobs: Sequence[Job]) -> list[list[Job]]:
    """Jobs grouped by workload, in the order the workloads first appear."""
    groups: dict[str, list[Job]] = {}
    for job in jobs:
        groups.setdefault(job.workload, []).append(job)
    return list(groups.values())


T = TypeVar("T")


def rotation(items: Sequence[T], round_index: int) -> list[T]:
    """``items`` starting at position ``round_index % len(items)``: each round another goes first."""
    shift = round_index % len(items) if items else 0
    return [*items[shift:], *items[:shift]]


def _failure(job: Job, exc: BaseException) -> str:
    if isinstance(exc, RunFailed):
        return str(exc)
    return f"{job.workload}/{job.label} failed:\n{''.join(traceback.format_exception(exc))}"


def run_workload(
    jobs: Sequence[Job],
    isolated: bool,
    progress: Progress,
    cut: Cut | None = None,
    on_round: Callable[[list[Running]], object] | None = None,
) -> tuple[list[RunResult], list[str]]:
    """Run one workload's jobs in interleaved rounds; returns results (in ``jobs`` order) and failures.

    ``cut`` (the time budget's) may lower the rounds after each round; every run then stops at that
    round and is evaluated on the steps it trained (its result's ``steps``). ``on_round`` gets the runs
    still training, with their steps so far, after each round."""
    failures: list[str] = []
    workers = {job: make_worker(job, isolated) for job in jobs}
    running = {job: Running(job.workload, job.label) for job in jobs}
    shown = {job: job for job in jobs}  # the job as the progress knows it (its steps cut, after a cut)
    try:
        for worker in workers.values():
            worker.start()
        active = []
        for job, worker in workers.items():
            progress.where(shown[job], phase="starting")
            try:
                worker.wait_ready(progress.heartbeat)
                active.append(job)
            except Exception as exc:
                failures.append(_failure(job, exc))
            progress.advance(start_s(job))
        size = jobs[0].preset.round_steps
        rounds = math.ceil(jobs[0].total_steps / size)
        round_index = 0
        while round_index < rounds:
            for job in rotation(list(active), round_index):
                progress.where(shown[job], round_index, rounds)
                try:
                    running[job].history += workers[job].steps(size, round_index, progress.heartbeat)
                except Exception as exc:
                    failures.append(_failure(job, exc))
                    active.remove(job)
                progress.advance(size * job.preset.cost_ms / 1e3, measured=True)
            round_index += 1
            if on_round is not None:
                on_round([running[job] for job in active])
            if cut is not None and active and round_index < rounds:
                kept = min(rounds, max(round_index, cut([shown[job] for job in active], round_index, rounds)))
                if kept < rounds:
                    rounds = kept
                    _cut_progress(shown, active, rounds * size, progress)
        results = []
        for job in active:
            progress.where(shown[job], phase="evaluating")
            try:
                results.append(workers[job].finish(progress.heartbeat))
            except Exception as exc:
                failures.append(_failure(job, exc))
            progress.advance(EVAL_S.get(job.workload, 0.2))
        return results, failures
    finally:
        for worker in workers.values():
            worker.close()


def _cut_progress(shown: dict[Job, Job], active: list[Job], steps: int, progress: Progress) -> None:
    """The progress follows a cut: its total loses the rounds that will not run (one replan, so that a
    correction of the estimate it brings is said once, for the whole cut)."""
    before, after = [], []
    for job in active:
        old = shown[job]
        shown[job] = dataclasses.replace(old, steps=min(steps, old.total_steps))
        if old in progress.jobs:
            before.append(old)
            after.append(shown[job])
    if before:
        progress.replan(before, after)


def run_plan(
    jobs: Sequence[Job],
    isolated: bool,
    progress: Progress,
    on_workload_done: Done | None = None,
    rechoose: Rechoose | None = None,
    cut: Cut | None = None,
    on_round: Round | None = None,
) -> tuple[list[RunResult], list[str]]:
    """Every workload in turn (see ``run_workload``); returns all results and failure messages.

    ``rechoose`` (the time budget's) may change the steps of the runs not started yet, before each
    workload after the first; ``cut`` (the budget's too) may lower the rounds of the running one;
    ``on_round`` gets the finished results and the running runs after every round."""
    results: list[RunResult] = []
    failures: list[str] = []
    groups = group_by_workload(jobs)
    for index in range(len(groups)):
        if rechoose is not None and index > 0:
            remaining = [job for group in groups[index:] for job in group]
            groups[index:] = group_by_workload(rechoose(remaining))
        group = groups[index]
        rounds = None if on_round is None else functools.partial(on_round, list(results))
        done, failed = run_workload(group, isolated, progress, cut, rounds)
        results += done
        failures += failed
        if on_workload_done is not None and done:
            on_workload_done(results)
    return results, failures
