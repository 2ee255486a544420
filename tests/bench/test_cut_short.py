"""A bench stopped mid-workload (Ctrl-C, or the SIGTERM of a time limit such as gpu.sh's ``timeout``)
keeps the steps of every round that finished: the step log is rewritten after each round, and its
trailer says how many runs had finished and how many were still training."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mixprec import cli
from mixprec._files import read_jsonl
from mixprec.bench import runner
from mixprec.bench.results import incomplete

ROOT = Path(__file__).resolve().parents[2]
TAB = ["bench", "--size", "tiny", "--device", "cpu", "--threads", "1", "--in-process"]
TAB += ["--workload", "tabular-regression"]


def test_an_interrupt_before_the_evaluation_keeps_every_round_in_the_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def interrupted(self: runner.Trainer) -> runner.RunResult:
        raise KeyboardInterrupt

    monkeypatch.setattr(runner.Trainer, "finish", interrupted)  # every round ran, then Ctrl-C
    log, out = tmp_path / "steps.jsonl", tmp_path / "bench.json"
    argv = [*TAB, "--modes", "fp32,bf16-true", "--steps", "3", "--log", str(log), "--json", str(out)]
    assert cli.main(argv) == 130
    assert f"{log} keeps the steps of every round that finished" in capsys.readouterr().err
    lines, trailer = read_jsonl(log)
    assert sorted((r["mode"], r["step"], r["round"]) for r in lines) == sorted(
        (mode, step, step) for mode in ("fp32", "bf16-true", "fp32 (A/A)") for step in range(3)
    )
    assert all(r["step_time_ms"] > 0 and r["loss"] is not None for r in lines)
    assert trailer == {"records": 9, "runs": 0, "runs_planned": 3, "running": 3}
    assert "incomplete: 0 of 3 planned runs" in (incomplete(log) or "")
    assert not out.exists()  # no run finished: no records


def test_a_sigterm_stops_the_bench_as_an_interrupt_and_the_log_keeps_the_rounds(tmp_path: Path) -> None:
    log = tmp_path / "steps.jsonl"
    command = [sys.executable, "-m", "mixprec", *TAB, "--modes", "fp32", "--steps", "100000"]
    command += ["--log", str(log), "--json", str(tmp_path / "bench.json")]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        while not log.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert log.exists(), "no round was logged while the bench ran"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130 and "interrupted" in err, err[-2000:]
    lines, trailer = read_jsonl(log)
    assert lines and trailer is not None and trailer["runs"] == 0 and trailer["running"] >= 1
    assert {r["mode"] for r in lines} <= {"fp32", "fp32 (A/A)"}
