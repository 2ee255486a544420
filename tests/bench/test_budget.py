"""``mixprec bench --time`` (issue 33 item 7): the rounds chosen to fit a budget, re-chosen from the pace
before each workload, and said in the table. No timing is asserted: estimates and the clock are injected."""

from __future__ import annotations

import argparse
import io
import math
from types import SimpleNamespace

import pytest

from mixprec import cli
from mixprec.bench import budget as budget_mod
from mixprec.bench import command, schedule
from mixprec.bench.budget import MIN_ROUNDS, Budget, fit, parse_time
from mixprec.bench.jobs import make_plan
from mixprec.bench.progress import Progress, estimate_s, job_cost_s


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _default_jobs() -> list:
    return make_plan(size="default", device="cpu", threads=1).jobs


def _rounds(job) -> int:
    return math.ceil(job.total_steps / job.preset.round_steps)


@pytest.mark.parametrize(
    ("text", "seconds"), [("300", 300.0), ("300s", 300.0), ("5m", 300.0), ("4.5m", 270.0), (" 2min ", 120.0)]
)
def test_time_values(text: str, seconds: float) -> None:
    assert parse_time(text) == seconds


@pytest.mark.parametrize("text", ["", "5h", "-5m", "0", "0s", "five", "5 m s", "inf", "nan"])
def test_bad_time_values_are_refused_naming_the_value(text: str) -> None:
    with pytest.raises(ValueError, match=rf"--time must be a positive duration .* got {text!r}"):
        parse_time(text)
    assert parse_time("off") is None


@pytest.mark.parametrize("factor", [0.5, 1.0, 1.4, 2.0, 3.0, 6.0])
def test_fit_keeps_the_largest_common_share_of_rounds_that_fits(factor: float) -> None:
    jobs = _default_jobs()
    full = estimate_s(jobs, factor)
    chosen, fraction = fit(jobs, 300.0, factor)
    if full <= 300.0:
        assert fraction == 1.0 and all(a is b for a, b in zip(chosen, jobs, strict=True))
        return
    assert 0 <= fraction < 1
    if {_rounds(job) for job in chosen} != {MIN_ROUNDS}:  # at the minimum it may overrun (and says so)
        assert estimate_s(chosen, factor) <= 300.0
    for old, new in zip(jobs, chosen, strict=True):
        kept = _rounds(new)
        assert kept == max(MIN_ROUNDS, math.floor(fraction * old.total_steps / old.preset.round_steps))
        assert new.total_steps == kept * new.preset.round_steps <= old.total_steps
        assert (new.workload, new.mode, new.replica) == (old.workload, old.mode, old.replica)
    # the share is the largest: the budget less the starts and evaluations, over the training at full length
    training = sum(job_cost_s(job) for job in jobs)
    fixed = estimate_s(jobs, 1.0) - training
    assert fraction == pytest.approx(max(300.0 - fixed * factor, 0) / (training * factor))


def test_a_budget_too_small_cuts_to_the_minimum_and_says_it_overruns() -> None:
    notes: list[str] = []
    chosen = Budget(5.0, 1.0, notes, clock=FakeClock()).first(_default_jobs())
    assert {_rounds(job) for job in chosen} == {MIN_ROUNDS}
    (note,) = notes
    assert note.startswith(
        "time budget 5 s, the plan before the first round: lm 4 of 16 rounds (16 steps), cnn 4 of 15 rounds"
    )
    assert f"at {MIN_ROUNDS} rounds each it still overruns" in note


def test_the_first_choice_is_said_with_its_reason() -> None:
    jobs = _default_jobs()
    notes: list[str] = []
    fitted = Budget(1e6, 1.0, notes, clock=FakeClock()).first(jobs)
    assert fitted == jobs and notes[0].startswith("time budget ") and "the preset's rounds fit" in notes[0]
    notes.clear()
    factor = 2.0 * 300.0 / estimate_s(jobs, 1.0)  # a machine where the preset's rounds take 10 min
    fitted = Budget(300.0, factor, notes, clock=FakeClock()).first(jobs)
    assert estimate_s(fitted, factor) <= 300.0
    assert "the preset's rounds were estimated at 10 min 0 s on this machine" in notes[0]
    lm = next(job for job in fitted if job.workload == "lm")
    assert 4 <= _rounds(lm) < 16 and f"lm {_rounds(lm)} of 16 rounds ({lm.total_steps} steps)" in notes[0]


def test_a_slower_pace_re_chooses_the_workloads_not_started() -> None:
    clock = FakeClock()
    jobs = _default_jobs()
    notes: list[str] = []
    budget = Budget(300.0, 1.0, notes, clock=clock)
    jobs = budget.first(jobs)
    progress = Progress(jobs, 1.0, bar=False, stream=io.StringIO(), clock=clock)
    lm = [job for job in jobs if job.workload == "lm"]
    rest = [job for job in jobs if job.workload != "lm"]
    work = estimate_s(lm, 1.0)
    clock.now = 2.0 * work  # the lm workload ran at half the estimated pace
    progress.advance(work, measured=True)
    before_total = progress.total
    again = budget.rechoose(rest, progress)
    assert estimate_s(again, 2.0) <= 300.0 - clock.now or {_rounds(j) for j in again} == {MIN_ROUNDS}
    assert sum(j.total_steps for j in again) < sum(j.total_steps for j in rest)
    assert (
        "re-chosen for cnn onwards after" in notes[-1]
        and "ran at 2.00x the first estimate's pace" in notes[-1]
    )
    assert notes[-1].startswith("time budget left ")
    assert progress.total < before_total and progress.jobs[len(lm) :] == again
    # the same pace again changes nothing and says nothing more
    count = len(notes)
    assert budget.rechoose(again, progress) == again and len(notes) == count


def test_a_faster_pace_gives_back_rounds_up_to_the_preset() -> None:
    clock = FakeClock()
    notes: list[str] = []
    budget = Budget(300.0, 3.0, notes, clock=clock)
    jobs = budget.first(_default_jobs())
    progress = Progress(jobs, 3.0, bar=False, stream=io.StringIO(), clock=clock)
    lm = [job for job in jobs if job.workload == "lm"]
    rest = [job for job in jobs if job.workload != "lm"]
    work = estimate_s(lm, 3.0)
    clock.now = work / 3.0  # the machine was busy when probed: the rounds ran 3x faster than estimated
    progress.advance(work / 3.0, measured=True)
    again = budget.rechoose(rest, progress)
    originals = [budget.original[(j.workload, j.mode, j.replica)] for j in rest]
    assert all(new.total_steps >= old.total_steps for new, old in zip(again, rest, strict=True))
    assert all(new.total_steps <= o.total_steps for new, o in zip(again, originals, strict=True))


def test_run_plan_runs_the_re_chosen_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    jobs = [
        *make_plan(["tabular-regression"], ["fp32"], size="tiny", device="cpu", threads=1).jobs,
        *make_plan(["cnn"], ["fp32"], size="tiny", device="cpu", threads=1).jobs,
    ]
    seen = []

    def rechoose(remaining: list) -> list:
        seen.append([j.workload for j in remaining])
        return [budget_mod.dataclasses.replace(j, steps=2) for j in remaining]

    progress = Progress(jobs, 1.0, bar=False, stream=io.StringIO())
    results, failures = schedule.run_plan(jobs, isolated=False, progress=progress, rechoose=rechoose)
    assert not failures and seen == [["cnn"]]
    assert [(r.workload, r.steps) for r in results] == [("tabular-regression", 3), ("cnn", 2)]


def _args(**kw: object) -> argparse.Namespace:
    return argparse.Namespace(**{"time": None, "steps": None, "size": None, **kw})


def test_which_runs_get_a_budget() -> None:
    assert command._budget_s(_args()) == 300.0  # the default size: 5 min
    assert command._budget_s(_args(size="full")) is None  # the longer study runs in full
    assert command._budget_s(_args(size="full", time="8m")) == 480.0
    assert command._budget_s(_args(time="off")) is None
    assert command._budget_s(_args(steps=10)) is None
    with pytest.raises(ValueError, match="--time 2m and --steps 10 both set the length"):
        command._budget_s(_args(steps=10, time="2m"))


def test_the_bench_names_a_bad_time_and_its_table_says_the_choice(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["bench", "--size", "tiny", "--device", "cpu", "--threads", "1", "--in-process"]
    assert cli.main([*base, "--time", "5x"]) == 2
    assert "--time must be a positive duration" in capsys.readouterr().err
    tab = ["--workload", "tabular-regression", "--modes", "fp32,bf16-true", "--json", "/dev/null"]
    assert cli.main([*base, *tab, "--time", "1s"]) == 0
    out = capsys.readouterr().out
    assert "time budget 1 s, the plan before the first round: tabular-regression all 3 rounds" in out
    # the last note says what ran, after any cut the run made
    assert "what ran within the time budget 1 s: tabular-regression all 3 rounds" in " ".join(out.split())


def _lm_after_one_round(
    pace: float, budget_s: float = 300.0
) -> tuple[Budget, Progress, list, list[str], int]:
    """The default plan fitted to ``budget_s``; lm started and one round run, at ``pace`` x the estimate."""
    clock = FakeClock()
    notes: list[str] = []
    budget = Budget(budget_s, 1.0, notes, clock=clock)
    jobs = budget.first(_default_jobs())
    progress = Progress(jobs, 1.0, bar=False, stream=io.StringIO(), clock=clock)
    lm = [job for job in jobs if job.workload == "lm"]
    for _ in lm:
        progress.advance(3.5)
    for job in lm:
        progress.advance(job.preset.round_steps * job.preset.cost_ms / 1e3, measured=True)
    clock.now = pace * progress.done
    return budget, progress, lm, notes, _rounds(lm[0])


def test_a_slow_pace_after_round_one_cuts_the_running_workload_and_says_so() -> None:
    budget, progress, lm, notes, rounds = _lm_after_one_round(1.6)
    count = len(notes)
    kept = budget.cut_rounds(lm, 1, rounds, progress)
    assert MIN_ROUNDS < kept < rounds
    (note,) = notes[count:]
    assert f"lm cut to {kept} of {rounds} rounds ({kept * lm[0].preset.round_steps} steps) after " in note
    assert "ran at 1.60x the first estimate's pace" in note
    assert (
        f"every mode stops at round {kept}, its LR schedule (built for {rounds} rounds) truncated alike"
        in note
    )
    # lm's kept rounds leave the later workloads their minimum at this pace, one more round would not
    later = [job for job in progress.jobs if job.workload != "lm"]
    per_round = sum(j.preset.round_steps * j.preset.cost_ms / 1e3 for j in lm) * 1.6
    lm_eval = estimate_s(lm, 1.6) - sum(job_cost_s(j) + 3.5 for j in lm) * 1.6
    later_min = estimate_s([budget_mod._at_least(j) for j in later], 1.6)
    left = 300.0 - progress.clock()
    assert (kept - 1) * per_round + lm_eval + later_min <= left + 1e-9
    assert kept == rounds - 1 or kept * per_round + lm_eval + later_min > left


def test_a_pace_that_fits_cuts_nothing() -> None:
    budget, progress, lm, notes, rounds = _lm_after_one_round(1.0, budget_s=1e6)
    count = len(notes)
    assert budget.cut_rounds(lm, 1, rounds, progress) == rounds and len(notes) == count
    budget, progress, lm, notes, rounds = _lm_after_one_round(0.8)  # faster than estimated
    count = len(notes)
    assert budget.cut_rounds(lm, 1, rounds, progress) == rounds and len(notes) == count


def test_the_cut_never_goes_below_the_rounds_already_run() -> None:
    budget, progress, lm, notes, rounds = _lm_after_one_round(50.0)
    assert budget.cut_rounds(lm, 1, rounds, progress) == MIN_ROUNDS  # far too slow: the minimum
    assert "still overruns the budget" in notes[-1]
    assert budget.cut_rounds(lm, rounds - 1, rounds, progress) == rounds - 1
    assert budget.cut_rounds(lm, rounds, rounds, progress) == rounds  # all run: nothing to cut


def _tabular(steps: int) -> list:
    return make_plan(
        ["tabular-regression"], ["fp32", "bf16-true"], size="tiny", steps=steps, device="cpu", threads=1
    ).jobs


def test_run_workload_without_a_budget_runs_all_rounds() -> None:
    jobs = _tabular(8)
    results, failures = schedule.run_workload(
        jobs, False, Progress(jobs, 1.0, bar=False, stream=io.StringIO())
    )
    assert not failures and len(results) == len(jobs)
    assert all(r.steps == 8 and {h["round"] for h in r.history} == set(range(8)) for r in results)


def test_a_budget_cut_stops_every_mode_at_the_same_round() -> None:
    jobs = _tabular(8)
    holder: list[Progress] = []

    def clock() -> float:  # the rounds run 20x slower than estimated
        return 20.0 * holder[0].done if holder else 0.0

    notes: list[str] = []
    budget = Budget(1.0, 1.0, notes, clock=clock)
    progress = Progress(jobs, 1.0, bar=False, stream=io.StringIO(), clock=clock)
    holder.append(progress)
    calls = []

    def cut(running: list, done: int, rounds: int) -> int:
        calls.append((done, rounds))
        return budget.cut_rounds(running, done, rounds, progress)

    total = progress.total
    results, failures = schedule.run_workload(jobs, False, progress, cut=cut)
    assert not failures and calls[0] == (1, 8) and all(rounds == MIN_ROUNDS for _, rounds in calls[1:])
    assert [r.steps for r in results] == [MIN_ROUNDS] * len(jobs)  # the records say the steps trained
    assert all({h["round"] for h in r.history} == set(range(MIN_ROUNDS)) for r in results)
    (note,) = [n for n in notes if " cut to " in n]
    assert note.startswith(f"time budget 1 s: tabular-regression cut to {MIN_ROUNDS} of 8 rounds")
    assert progress.total < total and all(job.total_steps == MIN_ROUNDS for job in progress.jobs)


def test_on_cuda_the_cut_follows_the_pace_of_the_rounds_not_of_the_process_starts() -> None:
    """No CPU reference on CUDA (factor None): after the first round the running workload keeps as many
    rounds as fit at the rounds' own pace. Ten GPU processes take 15 s to start while a round of all ten
    takes 12 s: counting the starts into the pace (as before) doubled it and cut to 4 of 15 rounds where 7
    fit in the 100 s."""
    from mixprec.bench.runner import Job

    clock = FakeClock()
    notes: list[str] = []
    modes = ("fp32", "torch-amp-bf16", "mixprec-bf16", "mixprec-fp16", "O2-bf16", "bf16-true")
    modes += ("bf16-true-kahan", "fp8-dynamic", "fp8-delayed", "fp32")
    jobs = [Job("lm", mode, "large", device="cuda", replica=i // 9) for i, mode in enumerate(modes)]
    budget = Budget(100.0, None, notes, clock=clock)
    jobs = budget.first(jobs)
    progress = Progress(jobs, None, bar=False, stream=io.StringIO(), clock=clock)
    for job in jobs:
        progress.where(job, phase="starting")
        clock.now += 1.5
        progress.advance(3.5)
    for job in jobs:
        progress.where(job, 0, 15)
        clock.now += 1.2
        progress.advance(job.preset.round_steps * job.preset.cost_ms / 1e3, measured=True)
    kept = budget.cut_rounds(jobs, 1, 15, progress)
    assert kept == 7 and 15 + 7 * 12 <= 100
    assert "lm cut to 7 of 15 rounds (140 steps) after 27 s" in notes[-1]


def test_the_plan_note_is_labelled_and_the_last_note_says_what_ran_after_a_cut() -> None:
    """A new user read 'lm all 16 rounds ... the preset's rounds fit' and later 'lm cut to 12 of 16
    rounds': the first is the plan, and the closing note says what ran."""
    budget, progress, lm, notes, rounds = _lm_after_one_round(1.6)
    assert notes[0].startswith("time budget 5 min 0 s, the plan before the first round: lm 14 of 16 rounds")
    kept = budget.cut_rounds(lm, 1, rounds, progress)
    results = [
        SimpleNamespace(workload="lm", steps=kept * lm[0].preset.round_steps),
        SimpleNamespace(workload="cnn", steps=MIN_ROUNDS * 20),
    ]
    assert budget.outcome(results) == (
        f"what ran within the time budget 5 min 0 s: lm {kept} of 16 rounds, cnn {MIN_ROUNDS} of 15 rounds "
        "(the preset's rounds; the notes above say when and why any were cut)"
    )
