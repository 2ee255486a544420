"""Plots, `mixprec report` / `mixprec inspect` (report_main / inspect_main), and the examples."""

import json
import runpy
import sys
from pathlib import Path

import pytest
import torch

from mixprec._files import jsonl_text
from mixprec.inspect import (
    Log2Histogram,
    cli,
    demo,
    load_log,
    plot_gradient_histogram,
    plot_scale_history,
    plot_underflow,
    underflow_report,
    write_report,
)

pytest.importorskip("matplotlib")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _png(path: Path) -> None:
    assert path.exists() and path.stat().st_size > 1024
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def reports():
    torch.set_num_threads(1)
    inputs = demo.demo_inputs()
    return [
        underflow_report(demo.healthy_model(), inputs, loss_fn=demo.tiny_loss, scale=s)
        for s in (1.0, 2.0**16)
    ]


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


def test_plots_are_written(reports, tmp_path):
    _png(plot_gradient_histogram(reports[0], tmp_path / "hist.png"))
    _png(plot_gradient_histogram({"grads": reports[1].parameter_histogram}, tmp_path / "h2.png", scale=8.0))
    _png(plot_underflow(reports, tmp_path / "underflow.png"))
    _png(plot_underflow(reports[0], tmp_path / "one.png"))
    records = [
        {"step": i, "scale": 2.0 ** (10 - (i < 3) * i), "skipped": i < 3, "grad_amax": 0.5} for i in range(9)
    ]
    _png(plot_scale_history(records, tmp_path / "scale.png"))
    with pytest.raises(TypeError, match="UnderflowReport"):
        plot_underflow([], tmp_path / "x.png")
    with pytest.raises(TypeError, match="Log2Histogram"):
        plot_gradient_histogram([1, 2], tmp_path / "x.png")


def test_missing_matplotlib_is_a_clear_error(reports, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"pip install 'mixprec\[plot\]'"):
        plot_underflow(reports, tmp_path / "x.png")
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
    assert "| lm | O2-bf16 | 120.0 | 108.0-132.0 | 2.08x [2.01-2.15] | 100.0 | 2.5000 | 12.2 | 0 |" in summary
    assert "NOISY (timings spread too widely to trust; rerun on a quieter machine): lm/bf16-true." in summary
    path.write_text(json.dumps([{"mode": "fp32"}]))
    assert cli.report_main([str(path)]) == 2
    err = capsys.readouterr().err
    assert "item 0 of the JSON list lacks workload, step_time_ms, so it is not `mixprec bench --json`" in err
    assert "`mixprec bench --log FILE`" in err


def test_report_from_a_scaler_log_with_histograms(tmp_path):
    histogram = Log2Histogram()
    histogram.add(torch.randn(1000) * 1e-3)
    records = [
        {"step": 0, "scale": 1024.0, "skipped": True, "grad_amax": None, "nonfinite_params": ["fc.weight"]},
        {
            "step": 1,
            "scale": 1024.0,
            "skipped": False,
            "grad_amax": 0.3,
            "grad_log2_hist": histogram.to_dict(),
        },
    ]
    log = tmp_path / "scaler.jsonl"
    log.write_text(jsonl_text(records))  # with the trailer ScalerLog.close() writes
    written = write_report(log, tmp_path / "out")
    assert [p.name for p in written] == ["scale_history.png", "grad_histogram.png", "summary.md"]
    for png in written[:2]:
        _png(png)
    assert "`fc.weight` (1)" in written[-1].read_text()


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


def test_inspect_command_end_to_end(tmp_path, capsys):
    assert cli.inspect_main(["--out", str(tmp_path), "--steps", "12"]) == 0
    out = capsys.readouterr().out
    assert "module 'blocks.2.fc' produced inf in float16" in out
    assert "module 'blocks.1.fc' (AddmmBackward0) produced inf" in out
    assert "At loss scale 2^0, 72.7% of activation gradients" in out
    assert "At loss scale 2^16, 1.4% of activation gradients" in out
    assert "max |grad| x scale = 302, 217x below fp16's largest value 65504 (margin required: 2x)." in out
    assert "head                         linear                         -         1" in out
    for name in ("grad_histogram_scale1", "grad_histogram_scale65536", "underflow"):
        _png(tmp_path / f"{name}.png")
    _png(tmp_path / "report" / "scale_history.png")
    assert (tmp_path / "report" / "summary.md").exists()
    assert cli.inspect_main(["--steps", "0"]) == 2


def test_subcommand_table_points_to_real_commands():
    import argparse
    import importlib

    from mixprec import cli as top_cli

    for module_name, help_name, add_name, run_name in top_cli.SUBCOMMANDS.values():
        module = importlib.import_module(module_name)
        parser = argparse.ArgumentParser()
        getattr(module, add_name)(parser)
        assert isinstance(getattr(module, help_name), str) and callable(getattr(module, run_name))
    assert top_cli.SUBCOMMANDS["report"][1:] == ("REPORT_HELP", "add_report_arguments", "run_report")
    assert top_cli.build_parser().parse_args(["report", "x.jsonl"]).handler is cli.run_report


@pytest.mark.parametrize("name", ["inspect_find_nonfinite.py", "inspect_scaler_log.py"])
def test_examples_run(name, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [name, str(tmp_path)])
    runpy.run_path(str(EXAMPLES / name), run_name="__main__")
    assert capsys.readouterr().out


def test_the_bench_report_names_moved_to_bench_and_the_old_path_warns():
    import mixprec.bench.plots
    import mixprec.bench.report
    import mixprec.inspect.bench_report as old

    with pytest.warns(DeprecationWarning, match="moved to mixprec.bench.report.bench_summary"):
        assert old.bench_summary is mixprec.bench.report.bench_summary
    with pytest.warns(DeprecationWarning, match="moved to mixprec.bench.plots.plot_bench_log"):
        from mixprec.inspect.bench_report import plot_bench_log
    assert plot_bench_log is mixprec.bench.plots.plot_bench_log
    with pytest.raises(AttributeError, match="no attribute 'plot_everything'"):
        old.plot_everything  # noqa: B018
