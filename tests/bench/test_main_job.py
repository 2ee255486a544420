"""The main job as a user meets it: re-estimates under load, a 0x0 terminal, 100 columns, missing output
parents, the default results folder, and the A/A run that widens every interval."""

from __future__ import annotations

import io
import json
import os
import pty
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from mixprec import cli
from mixprec.bench import command, report, stats
from mixprec.bench.progress import EVAL_S, START_S, Progress, can_draw_bar
from mixprec.bench.runner import Job

ROOT = Path(__file__).resolve().parents[2]
TINY = ["bench", "--size", "tiny", "--steps", "3", "--device", "cpu", "--threads", "1"]
TAB = [*TINY, "--workload", "tabular-regression", "--in-process"]


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _progress(clock: FakeClock, stream: io.StringIO) -> Progress:
    jobs = [Job("cnn", mode, "default") for mode in ("fp32", "torch-amp-bf16", "mixprec-bf16")]
    return Progress(jobs, factor=1.0, bar=False, stream=stream, clock=clock)


@pytest.mark.parametrize("slowdown", [0.5, 1.0, 1.2, 2.0, 4.7])
def test_estimate_corrected_as_soon_as_off_by_25_percent_and_then_holds(slowdown: float) -> None:
    clock, out = FakeClock(), io.StringIO()
    progress = _progress(clock, out)
    total = progress.total
    work = [total / 100] * 100  # the plan in 100 equal rounds, each taking ``slowdown`` x its estimate
    first_said = None
    for index, estimated in enumerate(work):
        clock.now += estimated * slowdown
        progress.advance(estimated, measured=True)
        if first_said is None and progress.corrections:
            first_said = index
    finished = clock.now
    if abs(slowdown - 1) <= 0.25:
        assert progress.corrections == [] and "estimate corrected" not in out.getvalue()
        return
    # said once, as soon as the measured rounds reached MEASURE_MIN_S (5% of a short plan)
    assert len(progress.corrections) == 1 and first_said is not None and first_said <= 10
    assert f"ran at {slowdown:.2f}x the pace" in out.getvalue()
    assert abs(finished - progress.corrections[-1][1]) <= 0.25 * progress.corrections[-1][1]


def test_a_load_arriving_midway_is_announced_and_the_end_is_within_25_percent() -> None:
    rng = random.Random(0)
    clock, out = FakeClock(), io.StringIO()
    progress = _progress(clock, out)
    for index in range(100):
        pace = 1.0 if index < 30 else 3.0 * rng.uniform(0.8, 1.2)  # busy loops start at 30%
        clock.now += progress.total / 100 * pace
        progress.advance(progress.total / 100, measured=True)
    assert progress.corrections and out.getvalue().count("estimate corrected") == len(progress.corrections)
    last = progress.corrections[-1][1]
    assert abs(clock.now - last) <= 0.25 * last


def test_a_long_wait_is_announced_by_the_heartbeat() -> None:
    clock, out = FakeClock(), io.StringIO()
    progress = _progress(clock, out)
    clock.now += progress.total * 0.2
    progress.advance(progress.total * 0.2, measured=True)  # on time so far
    assert not progress.corrections
    clock.now += progress.total * 2  # then one round takes very long: said while it is still running
    progress.heartbeat()
    assert len(progress.corrections) == 1 and "estimate corrected" in out.getvalue()


def _cuda_lm_run(clock: FakeClock, stream: io.StringIO, walls: dict[str, float]) -> Progress:
    """Drive a Progress without a CPU reference (factor None, as on CUDA) through a run as the scheduler
    does: the processes start (12 s in all), 8 interleaved rounds (round wall seconds per mode from
    ``walls``), then the evaluations (0.5 s each)."""
    jobs = [Job("lm", mode, "large", steps=160, device="cuda") for mode in walls]
    progress = Progress(jobs, None, bar=False, stream=stream, clock=clock)
    for job in jobs:
        progress.where(job, phase="starting")
        clock.now += 12.0 / len(jobs)
        progress.advance(START_S)
    for index in range(8):
        for job in jobs:
            progress.where(job, index, 8)
            clock.now += walls[job.mode]
            progress.advance(job.preset.round_steps * job.preset.cost_ms / 1e3, measured=True)
            if index == 0 and job is not jobs[-1]:
                assert "estimate" not in stream.getvalue()  # not before every mode has run a round
    for job in jobs:
        progress.where(job, phase="evaluating")
        clock.now += 0.5
        progress.advance(EVAL_S["lm"])
    return progress


def test_without_a_cpu_reference_the_estimate_comes_from_the_first_round_of_every_mode() -> None:
    """On CUDA there is no reference machine: the first estimate is the elapsed time plus the rest of the
    plan at the pace of the rounds run so far, said once every mode has run one round; process starts are
    not counted in that pace. (Before, the CPU reference's seconds were the estimate: 74 min 20 s for a
    bench that took 1 min 1 s.)"""
    clock, out = FakeClock(), io.StringIO()
    progress = _cuda_lm_run(clock, out, {"fp32": 2.0, "torch-amp-bf16": 1.0, "mixprec-bf16": 1.0})
    real = clock.now  # 12 s of starts + 8 rounds of 4 s + 1.5 s of evaluation
    said = re.search(r"estimate from the first round of each mode: about (\d+) s in all", out.getvalue())
    assert said and abs(int(said.group(1)) - real) <= 0.1 * real, out.getvalue()
    assert "estimate corrected" not in out.getvalue()  # the pace held, so nothing to correct
    first = re.fullmatch(r" \(estimated (\d+) s\)", command._estimates(progress))
    assert first and int(first.group(1)) == int(said.group(1))


def test_without_a_cpu_reference_a_slower_pace_later_is_still_corrected() -> None:
    clock, out = FakeClock(), io.StringIO()
    jobs = [Job("lm", mode, "large", steps=160, device="cuda") for mode in ("fp32", "mixprec-bf16")]
    progress = Progress(jobs, None, bar=False, stream=out, clock=clock)
    for index in range(8):
        for job in jobs:
            progress.where(job, index, 8)
            clock.now += 1.0 if index == 0 else 3.0  # the GPU got busy after the first round
            progress.advance(job.preset.round_steps * job.preset.cost_ms / 1e3, measured=True)
    assert "estimate from the first round of each mode: about 16 s in all" in out.getvalue()
    assert progress.corrections and "estimate corrected" in out.getvalue()
    assert abs(progress.corrections[-1][1] - clock.now) <= 0.25 * clock.now


def test_a_0x0_terminal_gets_plain_lines() -> None:
    leader, follower = pty.openpty()  # a fresh pty has size 0x0, as under `script` without a size
    try:
        with os.fdopen(follower, "w", closefd=False) as tty:
            assert tty.isatty() and os.get_terminal_size(follower) == os.terminal_size((0, 0))
            assert not can_draw_bar(tty)
            clock = FakeClock()
            progress = Progress([Job("cnn", "fp32", "tiny")], 1.0, bar=True, stream=tty, clock=clock)
            assert progress._bar is None  # plain lines instead
            clock.now = 15.0
            progress.heartbeat()
        assert b"[  0%] starting; 15 s elapsed" in os.read(leader, 4096)
    finally:
        os.close(leader)
        os.close(follower)
    assert not can_draw_bar(io.StringIO())


@pytest.mark.skipif(shutil.which("script") is None, reason="needs util-linux `script`")
def test_bench_under_script_0x0_prints_lines(tmp_path: Path) -> None:
    command = f"{sys.executable} -m mixprec {' '.join(TAB)} --modes fp32 --json {tmp_path / 'b.json'}"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(
        ["script", "-qec", f"stty rows 0 cols 0; {command}", "/dev/null"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:]
    assert "mixprec bench: 1 runs" in done.stdout and "tabular-regression" in done.stdout
    assert "%|" not in done.stdout and not re.search(r"\r(?!\n)", done.stdout)  # no bar drawn


def _result(workload: str, mode: str, ms: float, **extra: object) -> SimpleNamespace:
    history = [{"step": i, "round": i, "step_time_ms": ms, "loss": 1.0} for i in range(12)]
    return SimpleNamespace(
        workload=workload,
        mode=mode,
        device="cpu",
        threads=1,
        dtype="bfloat16",
        steps=12,
        warmup=0,
        history=history,
        peak_memory_mb=12345.6,
        memory_method="cpu-hwm",
        final_loss=2.81234,
        final_metric=16.79,
        skipped_steps=12,
        final_scale=1048576.0,
        data_source="a corpus",
        **extra,
    )


def test_table_fits_100_columns_and_the_noisy_footnote_wraps() -> None:
    modes = ["fp32", "torch-amp-bf16", "bf16-true-kahan", "fp8-delayed", stats.AA_LABEL]
    results = [
        _result(w, m, 5408.2 * (1 + i) if w == "lm" else 1.25)
        for w in ("lm", "cnn", "tabular-regression")
        for i, m in enumerate(modes)
    ]
    table = report.format_table(results, ["a note " * 40], header="mixprec bench: cpu")
    lines = table.splitlines()
    assert max(map(len, lines)) <= report.WIDTH, max(lines, key=len)
    assert any(line.startswith("lm (metric: perplexity") for line in lines)
    assert sum(line.startswith("note: a note") for line in lines) == 1 and len(lines) > 30


def test_the_noisy_footnote_counts_the_runs_and_names_them_one_line_per_workload() -> None:
    """The user's bench: 21 runs (3 workloads x 7), every one NOISY on a loaded machine. The footnote was
    one paragraph listing all 21 as workload/mode; now a count, then each workload's rows on a line."""
    modes = ["fp32", "torch-amp-bf16", "mixprec-bf16", "O2-bf16", "bf16-true", "bf16-true-kahan"]
    results = [
        _result(w, m, 5.0 * (1 + i)) for w in ("lm", "cnn", "tabular-regression") for i, m in enumerate(modes)
    ]
    results += [_result(w, stats.AA_LABEL, 5.0) for w in ("lm", "cnn", "tabular-regression")]
    records = report.make_records(results)
    for record in records:
        record["noisy"] = True
    lines = report.noisy_lines(records)
    assert lines[0].startswith("NOISY: 21 of 21 runs: the step times of these runs spread widely")
    assert lines[1:] == [
        f"  {w}: {', '.join([*modes, stats.AA_LABEL])}" for w in ("lm", "cnn", "tabular-regression")
    ]
    records[0]["noisy"] = records[8]["noisy"] = True
    for record in records[1:8] + records[9:]:
        record["noisy"] = False
    assert report.noisy_lines(records)[1:] == ["  lm: fp32", "  cnn: mixprec-bf16"]
    for record in records:
        record["noisy"] = False
    assert report.noisy_lines(records) == []


@pytest.mark.parametrize(
    ("ms", "text"),
    [
        (5408.2, "5408"),
        (1000.0, "1000"),
        (311.46, "311.5"),
        (120.0, "120.0"),
        (15.0, "15.0"),
        (1.034, "1.03"),
    ],
)
def test_one_record_prints_its_time_one_way_in_the_table_and_the_report(ms: float, text: str) -> None:
    """bench's table and the Markdown that `mixprec report` writes from the same record share one rule."""
    assert report._ms(ms) == text and report._ms(None) == "-" and report._ms(float("nan")) == "nan"
    results = [_result("cnn", "fp32", ms)]
    table = report.format_table(results)
    summary = report.bench_summary(report.make_records(results), "run", [])
    row = next(line for line in summary.splitlines() if line.startswith("| cnn | fp32 |"))
    assert row.split(" | ")[2] == text  # the step time's cell
    assert any(line.split()[:2] == ["fp32", text] for line in table.splitlines())


def test_the_aa_run_widens_every_other_row() -> None:
    base = [10.0 * (1 + 0.01 * (r % 3)) for r in range(16)]
    fp32 = SimpleNamespace(**{**vars(_result("w", "fp32", 1.0)), "history": _history(base)})
    twin = SimpleNamespace(
        **{**vars(fp32), "mode": stats.AA_LABEL, "history": _history([b * 1.1 for b in base])}
    )
    fast = SimpleNamespace(**{**vars(fp32), "mode": "bf16", "history": _history([b / 2 for b in base])})
    plain = stats.timings([fp32, fast])[1]
    ref, widened, aa = stats.timings([fp32, fast, twin])
    assert aa.speedup == pytest.approx(1 / 1.1) and stats.process_factor(aa) == pytest.approx(1.1)
    assert widened.speedup == plain.speedup
    assert widened.speedup_low == pytest.approx(plain.speedup_low / 1.1)
    assert widened.speedup_high == pytest.approx(plain.speedup_high * 1.1)
    assert ref.speedup == 1.0 and widened.noisy  # 2 x 10% wider than the 15% that counts as noisy


def _history(round_ms: list[float]) -> list[dict[str, float]]:
    return [{"step": r, "round": r, "step_time_ms": ms, "loss": 1.0} for r, ms in enumerate(round_ms)]


def test_a_missing_parent_is_an_error_unless_mkdir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "no" / "such" / "dir"
    for option, value in (("--json", missing / "x.json"), ("--log", missing / "x.jsonl"), ("--out", missing)):
        assert cli.main([*TAB, "--modes", "fp32", option, str(value)]) == 2
        err = capsys.readouterr().err
        assert f"the directory '{value.parent}' does not exist" in err and "--mkdir" in err, err
        assert not (tmp_path / "no").exists()  # nothing created
    assert cli.main([*TAB, "--modes", "fp32", "--json", str(missing / "x.json"), "--mkdir"]) == 0
    assert json.loads((missing / "x.json").read_text())[0]["mode"] == "fp32"


def test_default_run_writes_a_results_folder_that_report_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert cli.main([*TAB, "--modes", "fp32,torch-amp-bf16"]) == 0
    (folder,) = tmp_path.glob("mixprec-bench-*")
    err = capsys.readouterr().err
    names = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    assert names == [
        "bench.json",
        "plots/loss_tabular-regression.png",
        "plots/step_time.png",
        "steps.jsonl",
        "summary.md",
    ]
    for name in names:  # named at the end, as the user gave them (here: relative to the cwd)
        assert f"wrote {Path(folder.name) / name}" in err
    assert f"results in {folder.name}/" in err
    summary = (folder / "summary.md").read_text()
    assert "tabular-regression (metric: R^2" in summary and "`steps.jsonl`" in summary
    assert cli.main(["report", str(folder)]) == 0
    assert (folder / "report" / "summary.md").exists() and (folder / "report" / "step_time.png").exists()
    assert "fp32 (A/A)" in capsys.readouterr().out
