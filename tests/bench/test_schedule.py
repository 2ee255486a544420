"""Interleaved rounds, worker processes, the statistics over rounds, and progress reporting."""

from __future__ import annotations

import io
import random
import statistics
import sys
from types import SimpleNamespace

import pytest

from mixprec.bench import progress as progress_mod
from mixprec.bench import runner, schedule, stats
from mixprec.bench.progress import Progress
from mixprec.bench.runner import Job

TINY = {"size": "tiny", "steps": 3}


def _run(mode: str, round_ms: list[float], per_round: int = 4, warmup: int = 0) -> SimpleNamespace:
    """A stand-in RunResult whose steps in round r all take ``round_ms[r]`` (plus a little jitter)."""
    history = [
        {"step": r * per_round + i, "round": r, "step_time_ms": ms * (1 + 0.001 * i)}
        for r, ms in enumerate(round_ms)
        for i in range(per_round)
    ]
    return SimpleNamespace(workload="w", mode=mode, history=history, warmup=warmup)


def test_quantile_matches_statistics_and_interval_uses_order_statistics() -> None:
    values = [float(v) for v in (5, 1, 4, 2, 3, 9, 7)]
    assert stats.quantile(values, 0.5) == statistics.median(values)
    assert stats.quantile(values, 0.25) == statistics.quantiles(values, n=4, method="inclusive")[0]
    assert stats.median_interval(list(range(1, 17))) == (5, 12)  # n=16: P(B<=4)=3.8% <= 5% < P(B<=5)
    assert stats.median_interval([1.0, 2.0, 3.0, 4.0]) is None  # too few for a 90% interval
    with pytest.raises(ValueError, match="empty"):
        stats.quantile([], 0.5)


def test_paired_speedup_cancels_drift_between_rounds() -> None:
    drift = [10.0 * (1 + 0.5 * r) for r in range(12)]  # the machine slows down 6.5x over the run
    fp32 = _run("fp32", drift)
    fast = _run("bf16", [ms / 2 for ms in drift])
    reference, timing = stats.timings([fp32, fast])
    assert timing.speedup == pytest.approx(2.0) and timing.rounds == 12
    assert timing.speedup_low == pytest.approx(2.0) and timing.speedup_high == pytest.approx(2.0)
    assert not timing.noisy  # the step times spread 6x, but round by round the ratio holds
    assert reference.speedup == 1.0 and reference.noisy  # fp32's own IQR is wide


def test_wild_rounds_are_flagged_noisy() -> None:
    rng = random.Random(0)
    fp32 = _run("fp32", [10.0] * 12)
    wild = _run("bf16", [5.0 * rng.uniform(0.3, 3.0) for _ in range(12)])
    timing = stats.timing(wild, fp32)
    assert timing.noisy and timing.speedup_low < timing.speedup < timing.speedup_high


def test_rotation_and_grouping() -> None:
    assert [schedule.rotation("abc", r) for r in range(4)] == [
        ["a", "b", "c"],
        ["b", "c", "a"],
        ["c", "a", "b"],
        ["a", "b", "c"],
    ]
    jobs = [Job("cnn", "fp32"), Job("lm", "fp32"), Job("cnn", "bf16-true")]
    assert [[j.mode for j in group] for group in schedule.group_by_workload(jobs)] == [
        ["fp32", "bf16-true"],
        ["fp32"],
    ]


def test_modes_train_interleaved_round_by_round(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    original = runner.Trainer.steps

    def spy(self: runner.Trainer, count: int, round_index: int) -> list[float]:
        calls.append((self.job.mode, round_index, count))
        return original(self, count, round_index)

    monkeypatch.setattr(runner.Trainer, "steps", spy)
    jobs = [Job("tabular-regression", mode, **TINY) for mode in ("fp32", "bf16-true")]
    progress = Progress(jobs, 1.0, bar=False, stream=io.StringIO())
    results, failures = schedule.run_workload(jobs, isolated=False, progress=progress)
    assert not failures and [r.mode for r in results] == ["fp32", "bf16-true"]
    assert calls == [
        ("fp32", 0, 1),
        ("bf16-true", 0, 1),
        ("bf16-true", 1, 1),
        ("fp32", 1, 1),
        ("fp32", 2, 1),
        ("bf16-true", 2, 1),
    ]
    assert progress.done == pytest.approx(progress.total)


def test_worker_processes_measure_memory_and_report_failures() -> None:
    jobs = [Job("tabular-regression", "fp32", **TINY), Job("tabular-regression", "no-such-mode", **TINY)]
    progress = Progress(jobs, 1.0, bar=False, stream=io.StringIO())
    results, failures = schedule.run_workload(jobs, isolated=True, progress=progress)
    assert [r.mode for r in results] == ["fp32"] and len(results[0].history) == 3
    if sys.platform == "linux":
        assert results[0].memory_method in ("cpu-hwm", "cpu-maxrss")
    assert len(failures) == 1 and "tabular-regression/no-such-mode failed" in failures[0]
    assert "KeyError: 'no-such-mode'" in failures[0]


def test_plain_progress_lines_name_the_run_and_the_time_left(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(progress_mod, "LINE_EVERY_S", 0.0)
    monkeypatch.setattr(progress_mod, "HEARTBEAT_S", 0.0)
    jobs = [Job("lm", "fp32", **TINY), Job("lm", "bf16-true", **TINY)]
    stream = io.StringIO()
    progress = Progress(jobs, 2.0, bar=False, stream=stream)
    assert progress.total == pytest.approx(2.0 * progress_mod.estimate_s(jobs, 1.0))
    progress.where(jobs[1], 2, 3)
    progress.advance(1.0)
    progress.heartbeat()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2 and "\r" not in stream.getvalue()
    assert "lm bf16-true (run 2 of 2), round 3 of 3" in lines[0] and "left" in lines[0]
    assert progress_mod.format_duration(185) == "3 min 5 s" and progress_mod.format_duration(7.4) == "7 s"


def test_threads_follow_the_idle_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    from mixprec.bench import machine

    assert 0.0 <= machine.busy_cores(0.05) <= (machine.os.cpu_count() or 1) + 0.5
    assert machine.choose_threads("3", "cpu") == (3, "set by --threads")
    with pytest.raises(ValueError, match="--threads must be 'auto' or a positive integer, got '0'"):
        machine.choose_threads("0", "cpu")
    monkeypatch.setattr(machine.torch, "get_num_threads", lambda: 4)
    monkeypatch.setattr(machine.os, "cpu_count", lambda: 4)
    monkeypatch.setattr(machine, "busy_cores", lambda: 0.2)
    assert machine.choose_threads("auto", "cpu") == (4, "torch's default")
    monkeypatch.setattr(machine, "busy_cores", lambda: 1.3)
    threads, why = machine.choose_threads("auto", "cpu")
    assert threads == 3 and "keep 1.3 of 4 cores busy, so 3 threads instead of 4" in why
    assert machine.choose_threads("auto", "cuda") == (4, "torch's default")
    monkeypatch.setattr(machine.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(machine, "busy_cores", lambda: 2.0)
    threads, why = machine.choose_threads("auto", "cpu")
    assert threads == 1 and "keep 2.0 of 2 cores busy, so 1 thread instead of 4" in why
    # the user's case: torch already runs one thread, so nothing changed and nothing is said
    monkeypatch.setattr(machine.torch, "get_num_threads", lambda: 1)
    assert machine.choose_threads("auto", "cpu") == (1, "torch's default")
