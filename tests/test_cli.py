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
from mixprec.bench.workloads import WORKLOADS

TINY = ["bench", "--size", "tiny", "--steps", "3", "--device", "cpu"]


def test_subcommands_register_from_the_table() -> None:
    parser = cli.build_parser()
    assert "bench" in cli.SUBCOMMANDS
    args = parser.parse_args(["bench", "--quick"])
    assert args.command == "bench" and args.size == "quick"
    assert parser.parse_args(["bench", "--full"]).size == "full"
    assert parser.parse_args(["bench"]).size is None  # the default size


def test_bench_in_process_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    argv = [
        *TINY,
        "--workload",
        "tabular-regression",
        "--modes",
        "fp32,torch-amp",
        "--in-process",
        "--json",
        str(out),
    ]
    assert cli.main(argv) == 0
    records = json.loads(out.read_text())
    assert [r["mode"] for r in records] == ["fp32", "torch-amp-bf16", "fp32 (A/A)"]  # + the A/A run
    assert all(tuple(r) == RECORD_KEYS for r in records)
    table = capsys.readouterr().out
    assert "speedup" in table and "tabular-regression" in table


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--workload", "nope"],
            "unknown workload 'nope'; accepted: lm, lm-gemm, cnn, tabular-regression, all",
        ),
        (["--modes", "fp33"], "unknown mode 'fp33' (did you mean 'fp32'?); accepted: fp32,"),
        (["--steps", "1"], "steps must be at least 2"),
        (["--modes", "16-true"], "mode '16-true' cannot run on cpu: fp16 weights without fp32 masters"),
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
    argv = [*TINY, "--workload", "tabular-regression", "--modes", "fp32"]
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
    # A fresh process on Linux measures its peak RSS (the high-water mark, or ru_maxrss where clear_refs
    # is not writable); elsewhere it reports None rather than a number it did not measure.
    if Path("/proc/self/status").exists():
        assert isinstance(record["peak_memory_mb"], float) and record["peak_memory_mb"] >= 0
    else:
        assert record["peak_memory_mb"] is None
    lines = (tmp_path / "s.jsonl").read_text().splitlines()
    trailer = json.loads(lines[-1])["end_of_log"]
    notes = trailer.pop("notes", [])  # the table's notes (threads chosen under load), for `mixprec report`
    assert len(lines) == 4 and trailer == {"records": 3, "runs": 1, "runs_planned": 1}
    assert all(isinstance(note, str) for note in notes)
    assert (tmp_path / "p" / "step_time.png").stat().st_size > 1024
    assert "\r" not in done.stderr  # no progress bar when stderr is not a terminal
    assert done.stderr.startswith(
        "mixprec bench: 1 runs (1 workloads x up to 1 modes, size tiny, cpu); about"
    )
    for name in ("b.json", "s.jsonl", "p/step_time.png", "p/loss_tabular-regression.png"):
        assert f"wrote {tmp_path / name}" in done.stderr


def _bad_inputs(tmp_path: Path) -> list[tuple[list[str], str]]:
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    incomplete = tmp_path / "images"
    incomplete.mkdir()
    return [
        (["--json", str(tmp_path)], f"--json '{tmp_path}' is a directory; give a file path"),
        (["--log", str(tmp_path)], f"--log '{tmp_path}' is a directory"),
        (["--plot", str(a_file)], f"--plot '{a_file}' is a file; give a directory"),
        (["--json", str(a_file / "x.json")], "is a file, not a directory"),
        (
            ["--json", str(tmp_path / "o"), "--log", str(tmp_path / "o")],
            "--json and --log name the same file",
        ),
        (
            ["--data", str(tmp_path / "missing.txt")],
            "--data '{}' is not a file".format(tmp_path / "missing.txt"),
        ),
        (["--data", str(a_file)], "holds 1 bytes; the lm workload needs at least 10000"),
        (["--images", str(incomplete)], "lacks train-images-idx3-ubyte"),
        (["--modes", "fp32", "--modes", "nope"], "unknown mode 'nope'"),
        (["--device", "tpu"], "unknown device 'tpu'; accepted: auto, cpu, cuda, cuda:N"),
    ]


def test_every_input_is_checked_before_training(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for argv, message in _bad_inputs(tmp_path):
        assert cli.main([*TINY, *argv]) == 2, argv
        err = capsys.readouterr().err
        assert message in err, (argv, err)
        assert err.count("error:") == 1 and "runs (" not in err  # one error, before the plan is announced


def test_results_are_written_before_the_plots_can_fail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from mixprec.bench import plots

    def broken(*args: object) -> None:
        raise RuntimeError("the plotting library broke")

    monkeypatch.setattr(plots, "write_plots", broken)
    out = tmp_path / "bench.json"
    argv = [*TINY, "--workload", "tabular-regression", "--modes", "fp32", "--in-process"]
    with pytest.raises(RuntimeError, match="plotting library broke"):
        cli.main([*argv, "--json", str(out), "--plot", str(tmp_path / "p")])
    assert json.loads(out.read_text())[0]["mode"] == "fp32"
    table = capsys.readouterr().out
    assert "\ntabular-regression (metric: R^2" in table and "\nfp32  " in table


def test_help_names_the_results_folder_for_report_and_the_preset_aliases_for_bench(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    top = " ".join(capsys.readouterr().out.split())
    assert "report" in top and "`mixprec bench` results folder" in top
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    bench = " ".join(capsys.readouterr().out.split())
    assert "bf16-mixed = mixprec-bf16" in bench and "O1 = mixprec-bf16 (cpu)/mixprec-fp16 (cuda)" in bench
    # --quick promises no duration (the user's took 3 min 45 s against "1-2 min"): the preset's steps
    quick = {name: WORKLOADS[name].presets["quick"].steps for name in ("lm", "cnn", "tabular-regression")}
    assert (
        f"steps per mode lm {quick['lm']}, cnn {quick['cnn']}, tabular-regression "
        f"{quick['tabular-regression']}; the bench prints its time estimate" in bench
    )
    assert "1-2 min" not in bench


@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_every_workload_goes_through_every_report_path(
    workload: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each registered workload at --size tiny (the user's lm-gemm modes, plus fp32 for the speedup and
    advice paths): the printed table and its footer, the results folder's summary, and `mixprec report`."""
    from mixprec.bench.report_command import report_main

    out = tmp_path / "results"
    modes = "fp32,torch-amp-bf16,fp8-dynamic"
    argv = [*TINY[:3], "--steps", "2", "--device", "cpu", "--workload", workload, "--modes", modes]
    assert cli.main([*argv, "--in-process", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    spec = WORKLOADS[workload]
    assert f"\n{workload} (metric: {spec.metric}" in table
    assert f"\n{workload}: " in table and f"loss = {spec.loss_meaning}"[:60] in " ".join(table.split())
    assert spec.loss_meaning  # every built-in workload says what its loss is
    assert f"```text\n{table.rstrip()}" in (out / "summary.md").read_text()
    assert report_main([str(out), "--out", str(tmp_path / "report")]) == 0
    summary = (tmp_path / "report" / "summary.md").read_text()
    assert f"| {workload} | fp8-dynamic |" in summary
