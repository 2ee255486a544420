"""`mixprec report` (mixprec.bench.report_command) and mixprec.bench.write_report on bench's files: a
`mixprec bench --log` JSON Lines log, a `--json` list, errors; and inspect's readers, which refuse them."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import mixprec.bench
from mixprec._files import jsonl_text
from mixprec.bench import report_command as cli
from mixprec.bench.results import incomplete, load_bench_json
from mixprec.inspect import load_log

pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[2]


def _png(path: Path) -> None:
    assert path.exists() and path.stat().st_size > 1024
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _bench_log(path: Path) -> Path:
    records = []
    for mode, scale in (("fp16", 65536.0), ("bf16", None)):
        for step in range(6):
            skipped = mode == "fp16" and step == 2
            scale_now = None if scale is None else scale / (2 if step >= 2 else 1)
            records.append(
                {"step": step, "workload": "cnn", "mode": mode, "loss": 2.0 - 0.1 * step, "scale": scale_now,
                 "skipped": skipped, "step_time_ms": 3.0 + step}
            )  # fmt: skip
    path.write_text(jsonl_text(records, runs=2, runs_planned=2))  # as the bench writes it
    return path


def test_missing_matplotlib_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    log = _bench_log(tmp_path / "bench.jsonl")
    assert cli.report_main([str(log)]) == 1
    assert "mixprec[plot]" in capsys.readouterr().err


def test_report_from_a_bench_log(tmp_path, capsys):
    log = _bench_log(tmp_path / "bench.jsonl")
    assert cli.report_main([str(log), "--out", str(tmp_path / "out")]) == 0
    for name in ("loss_cnn", "step_time", "scale_history"):
        _png(tmp_path / "out" / f"{name}.png")
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "| cnn / fp16 | 6 | 2 → 1.5 | 1 (2) | 2^16 / 2^15 / 2^15 | - | 5.50 |" in summary
    assert "| cnn / bf16 | 6 |" in summary and "![scale_history](scale_history.png)" in summary
    assert "![loss_cnn](loss_cnn.png)" in summary
    assert "wrote" in capsys.readouterr().out


def _bench_record(mode, ms, speedup, low=None, high=None, noisy=False):
    return {
        "workload": "lm", "mode": mode, "step_time_ms": ms, "step_time_q25_ms": ms * 0.9,
        "step_time_q75_ms": ms * 1.1, "speedup_vs_fp32": speedup, "speedup_low": low, "speedup_high": high,
        "noisy": noisy, "peak_memory_mb": 100.0, "final_loss": 2.5, "final_metric": 12.2, "skipped_steps": 0,
        "round_medians_ms": [ms * (1 + 0.01 * i) for i in range(8)],
    }  # fmt: skip


def test_report_reads_what_bench_json_writes(tmp_path, capsys):
    records = [_bench_record("fp32", 250.0, 1.0), _bench_record("O2-bf16", 120.0, 2.08, 2.01, 2.15)]
    records.append(_bench_record("bf16-true", 110.0, 2.3, 1.6, 2.9, noisy=True))
    path = tmp_path / "out.json"
    path.write_text(json.dumps(records, indent=1))
    assert cli.report_main([str(path)]) == 0
    _png(tmp_path / "out_report" / "step_time.png")
    summary = (tmp_path / "out_report" / "summary.md").read_text()
    row = "| lm | O2-bf16 | 120.0 | 108.0-132.0 | 2.08x [2.01-2.15] | 100.0 | 2.5000 | 12.200 | 0 | - |  |"
    assert row in summary  # the cells as the printed table formats them, the scale and noisy columns too
    assert "NOISY (timings spread too widely to trust; rerun on a quieter machine): lm/bf16-true." in summary
    path.write_text(json.dumps([{"mode": "fp32"}]))
    assert cli.report_main([str(path)]) == 2
    err = capsys.readouterr().err
    assert "item 0 of the JSON list lacks workload, step_time_ms, so it is not `mixprec bench --json`" in err
    assert "`mixprec bench --log FILE`" in err


def test_report_errors_name_the_problem(tmp_path, capsys):
    assert cli.report_main([str(tmp_path / "missing.jsonl")]) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 0}\n{"loss": 1}\n')
    assert cli.report_main([str(bad)]) == 2
    assert "bad.jsonl:2: expected a JSON object with an integer 'step'" in capsys.readouterr().err
    bad.write_text("not json\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: not valid JSON.*`mixprec bench --json FILE` writes"):
        load_log(bad)
    bad.write_text("\n")
    with pytest.raises(ValueError, match="no records"):
        load_log(bad)


def test_report_out_naming_a_file_is_a_usage_error(tmp_path, capsys):
    # was: FileExistsError traceback from mkdir, exit code 1
    log = _scaler_log(tmp_path / "run.jsonl")
    (tmp_path / "taken").write_text("")
    assert cli.report_main([str(log), "--out", str(tmp_path / "taken")]) == 2
    assert "taken is a file, not a folder; name a folder with --out DIR" in capsys.readouterr().err
    (tmp_path / "run_report").write_text("")  # the default folder's name, taken by a file
    assert cli.report_main([str(log)]) == 2
    assert "the default output folder" in capsys.readouterr().err


def _scaler_log(path: Path, closed: bool = True) -> Path:
    records = [
        {"step": i, "scale": 1024.0, "skipped": i == 1, "grad_amax": 0.5, "loss": 1.0} for i in range(4)
    ]
    lines = "".join(json.dumps(r) + "\n" for r in records)
    path.write_text(jsonl_text(records) if closed else lines)
    return path


def _files(written: list[Path]) -> list[tuple[str, str | int]]:
    """What a report wrote: each file's name and, for the summary, its text (PNG bytes vary by nothing but
    matplotlib's metadata, so their size stands in)."""
    return [(p.name, p.read_text() if p.suffix == ".md" else p.stat().st_size > 1024) for p in written]


def test_bench_write_report_hands_a_scaler_log_to_inspect(tmp_path):
    from mixprec.inspect import write_report as inspect_write_report

    log = _scaler_log(tmp_path / "run.jsonl", closed=False)
    ours = mixprec.bench.write_report(log, tmp_path / "a")
    theirs = inspect_write_report(log, tmp_path / "b")
    assert [p.name for p in ours] == ["scale_history.png", "summary.md"]
    assert _files(ours) == _files(theirs)
    assert "no end-of-log record after 4 records" in ours[-1].read_text()
    assert incomplete(log) == mixprec.bench.incomplete(log) and "no end-of-log record" in incomplete(log)
    assert load_bench_json(log) is None


@pytest.mark.parametrize("kind", ["log", "json", "folder"])
def test_inspect_readers_refuse_a_bench_file_and_name_mixprec_report(kind, tmp_path):
    """inspect does not import bench: given a bench file, its readers say which command reads it."""
    from mixprec.inspect import write_report as inspect_write_report
    from mixprec.inspect.report import incomplete as inspect_incomplete

    if kind == "log":
        path = _bench_log(tmp_path / "bench.jsonl")
    elif kind == "json":
        path = tmp_path / "out.json"
        path.write_text(json.dumps([_bench_record("fp32", 250.0, 1.0), _bench_record("bf16", 120.0, 2.0)]))
    else:
        path = tmp_path / "results"
        path.mkdir()
        (path / "bench.json").write_text(json.dumps([{**_bench_record("fp32", 9.0, 1.0), "runs_planned": 2}]))
        _bench_log(path / "steps.jsonl")
    refused = r"is a `mixprec bench` file .* use `mixprec report .*` or mixprec\.bench\."
    with pytest.raises(ValueError, match=refused + "write_report"):
        inspect_write_report(path, tmp_path / "old")
    assert not (tmp_path / "old").exists()  # refused before writing anything
    with pytest.raises(ValueError, match=refused + "incomplete"):
        inspect_incomplete(path)
    written = mixprec.bench.write_report(path, tmp_path / "new")  # what the message points at reads it
    assert len(written) >= 2 and written[-1].name == "summary.md"
    assert (incomplete(path) is not None) == (kind == "folder")  # 1 of 2 planned runs in bench.json


def test_the_report_command_is_bench_s():
    from mixprec import cli as top_cli

    assert top_cli.SUBCOMMANDS["report"] == (
        "mixprec.bench.report_command",
        "REPORT_HELP",
        "add_report_arguments",
        "run_report",
    )
    assert top_cli.build_parser().parse_args(["report", "x.jsonl"]).handler is cli.run_report


def test_inspect_reports_a_scaler_log_without_importing_bench(tmp_path):
    """inspect sits below bench: reporting a run log through inspect must not load mixprec.bench."""
    log = _scaler_log(tmp_path / "run.jsonl")
    code = (
        "import sys, mixprec.inspect\n"
        f"written = mixprec.inspect.write_report({str(log)!r}, {str(tmp_path / 'out')!r})\n"
        "from mixprec.inspect.report import incomplete\n"
        f"assert incomplete({str(log)!r}) is None\n"
        "print([p.name for p in written], sorted(m for m in sys.modules if m.startswith('mixprec.bench')))\n"
    )
    env = {"PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['scale_history.png', 'summary.md'] []"


def test_a_folder_report_repeats_the_bench_notes(tmp_path):
    """The budget's notes the bench printed under its table reach the folder's report/summary.md (its
    step log's trailer keeps them)."""
    folder = tmp_path / "run"
    folder.mkdir()
    records = [_bench_record("fp32", 250.0, 1.0), _bench_record("O2-bf16", 120.0, 2.08, 2.01, 2.15)]
    (folder / "bench.json").write_text(json.dumps(records))
    steps = [
        {"step": 0, "workload": "lm", "mode": m, "loss": 2.0, "step_time_ms": 1.0}
        for m in ("fp32", "O2-bf16")
    ]
    notes = [
        "time budget 5 min 0 s: lm cut to 12 of 16 rounds",
        "what ran within the time budget 5 min 0 s: lm",
    ]
    (folder / "steps.jsonl").write_text(jsonl_text(steps, runs=2, runs_planned=2, notes=notes))
    written = mixprec.bench.write_report(folder, folder / "report")
    summary = written[-1].read_text()
    assert f"## Notes\n\n- {notes[0]}\n- {notes[1]}\n" in summary


def test_records_of_a_workload_this_mixprec_lacks_are_refused_by_name(tmp_path, capsys):
    record = {**_bench_record("fp32", 250.0, 1.0), "workload": "lm-huge"}  # a later version's workload
    path = tmp_path / "other.json"
    path.write_text(json.dumps([record]))
    assert cli.report_main([str(path)]) == 2
    err = capsys.readouterr().err
    assert "records of workload(s) lm-huge, which this mixprec does not have (known: lm, " in err
    assert not (tmp_path / "other_report").exists()  # nothing written
    log = _bench_log(tmp_path / "bench.jsonl")
    log.write_text(log.read_text().replace('"workload": "cnn"', '"workload": "cnn-xl"'))
    assert cli.report_main([str(log), "--out", str(tmp_path / "out")]) == 2
    assert "cnn-xl" in capsys.readouterr().err and not (tmp_path / "out").exists()
