"""The time left and its corrections as a new user met them: no jump to "37 min left" while the worker
processes start, no correction thrown by the warm-up round, a correction said when a budget cut changes
the total, and a step that runs on says "still" rather than repeating its line."""

from __future__ import annotations

import io

import pytest

from mixprec.bench import progress as progress_mod
from mixprec.bench.progress import START_S, Progress
from mixprec.bench.runner import Job


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


MODES = ("fp32", "torch-amp-bf16", "mixprec-bf16", "O2-bf16", "bf16-true", "bf16-true-kahan")


def _progress(clock: FakeClock, out: io.StringIO, steps: int = 240) -> tuple[Progress, list[Job]]:
    jobs = [Job("cnn", mode, "default", steps=steps) for mode in MODES]
    return Progress(jobs, factor=1.0, bar=False, stream=out, clock=clock), jobs


def _round_s(job: Job) -> float:
    return job.preset.round_steps * job.preset.cost_ms / 1e3


def test_the_time_left_holds_to_the_estimate_while_the_processes_start() -> None:
    """All workers start at once, so the first is ready only after most of their start time: before,
    that one start extrapolated over the whole plan (25 s for 3.5 s of work: 7x the total left)."""
    clock, out = FakeClock(), io.StringIO()
    progress, jobs = _progress(clock, out)
    clock.now = 25.0
    progress.where(jobs[0], phase="starting")
    progress.advance(START_S)
    assert progress.left_s() == pytest.approx(progress.total - START_S)
    assert not progress.corrections


def test_a_slow_warm_up_round_does_not_correct_the_estimate() -> None:
    clock, out = FakeClock(), io.StringIO()
    progress, jobs = _progress(clock, out)
    for job in jobs:
        progress.where(job, phase="starting")
        clock.now += START_S
        progress.advance(START_S)
    rounds = 12
    for index in range(rounds):
        for job in jobs:
            progress.where(job, index, rounds)
            clock.now += _round_s(job) * (3.0 if index == 0 else 1.0)  # the warm-up steps' round is slow
            progress.advance(_round_s(job), measured=True)
            if index == 1:
                assert progress.round_pace() == pytest.approx(1.0)
    assert "estimate corrected" not in out.getvalue() and not progress.corrections


def test_a_budget_cut_that_changes_the_total_says_so() -> None:
    """Before, a cut set the estimate silently: a bench announced at 2 min 5 s took 5 min 13 s with no
    'estimate corrected' line."""
    clock, out = FakeClock(), io.StringIO()
    progress, jobs = _progress(clock, out)
    for index in range(3):
        for job in jobs:
            progress.where(job, index, 12)
            clock.now += _round_s(job) * 1.1
            progress.advance(_round_s(job), measured=True)
    assert not progress.corrections
    cut = [Job(job.workload, job.mode, "default", steps=4 * job.preset.round_steps) for job in jobs]
    progress.replan(jobs, cut)
    assert len(progress.corrections) == 1
    assert (
        "estimate corrected: rounds re-chosen to fit the time budget; the total is now 0." in out.getvalue()
    )


def test_a_step_that_runs_on_says_still_instead_of_repeating(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(progress_mod, "HEARTBEAT_S", 0.0)
    clock, out = FakeClock(), io.StringIO()
    progress, jobs = _progress(clock, out)
    progress.where(jobs[0], phase="starting")
    for _ in range(3):
        clock.now += 15.0
        progress.heartbeat()
    first, second, third = out.getvalue().splitlines()
    assert "] starting cnn fp32 (run 1 of 6);" in first
    assert "] still starting cnn fp32 (run 1 of 6), for 30 s now;" in second
    assert "for 45 s now" in third
    monkeypatch.setattr(progress_mod, "LINE_EVERY_S", 0.0)
    progress.advance(START_S)  # fp32's process is ready: that step ended, so no "still" for it
    assert "] starting cnn fp32 (run 1 of 6);" in out.getvalue().splitlines()[-1]
    progress.where(jobs[1], phase="starting")
    clock.now += 15.0
    progress.heartbeat()
    assert "] starting cnn torch-amp-bf16 (run 2 of 6);" in out.getvalue().splitlines()[-1]
