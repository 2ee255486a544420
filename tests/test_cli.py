"""``mixprec`` / ``python -m mixprec``: subcommand table, exit codes and error messages."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mixprec import cli
from mixprec.bench.report import RECORD_KEYS

TINY = ["bench", "--size", "tiny", "--steps", "3", "--device", "cpu"]


def test_subcommands_register_from_the_table() -> None:
    parser = cli.build_parser()
    assert "bench" in cli.SUBCOMMANDS
    args = parser.parse_args(["bench", "--quick"])
    assert args.command == "bench" and args.size == "quick"


def test_bench_in_process_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    argv = [*TINY, "--workload", "seed-loop", "--modes", "fp32,torch-amp", "--in-process", "--json", str(out)]
    assert cli.main(argv) == 0
    records = json.loads(out.read_text())
    assert [r["mode"] for r in records] == ["fp32", "torch-amp-bf16"]
    assert all(tuple(r) == RECORD_KEYS for r in records)
    table = capsys.readouterr().out
    assert "speedup" in table and "seed-loop" in table


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--workload", "nope"], "unknown workload 'nope'; accepted: lm, cnn, seed-loop, all"),
        (["--modes", "fp33"], "unknown mode 'fp33' (did you mean 'fp32'?); accepted: fp32,"),
        (["--steps", "1"], "steps must be at least 2"),
    ],
)
def test_usage_errors_exit_2_with_a_clear_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main([*TINY, *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown when CUDA is absent")
def test_cuda_without_cuda_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "--device", "cuda", "--size", "tiny"]) == 2
    assert "torch.cuda.is_available() is False" in capsys.readouterr().err


def test_no_subcommand_and_bad_option(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--size", "huge"])
    assert exc.value.code == 2
    assert "invalid choice: 'huge'" in capsys.readouterr().err


def test_python_dash_m_runs_isolated_with_log_and_plots(tmp_path: Path) -> None:
    argv = [*TINY, "--workload", "seed-loop", "--modes", "fp32"]
    argv += [
        "--json",
        str(tmp_path / "b.json"),
        "--log",
        str(tmp_path / "s.jsonl"),
        "--plot",
        str(tmp_path / "p"),
    ]
    done = subprocess.run(
        [sys.executable, "-m", "mixprec", *argv], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    record = json.loads((tmp_path / "b.json").read_text())[0]
    assert record["peak_memory_mb"] is None or record["peak_memory_mb"] >= 0
    assert len((tmp_path / "s.jsonl").read_text().splitlines()) == 3
    assert (tmp_path / "p" / "step_time.png").stat().st_size > 1024
    assert "\r" not in done.stderr  # no progress bar when stderr is not a terminal
