"""Plots, a run log's report, `mixprec inspect` (inspect_main), and the examples (`mixprec report`, which
also reads bench's files, is tested in tests/bench/test_report_command.py)."""

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


def test_plots_are_written(reports, tmp_path):
    _png(plot_gradient_histogram(reports[0], tmp_path / "hist.png"))
    _png(plot_gradient_histogram({"grads": reports[1].parameter_histogram}, tmp_path / "h2.png", scale=8.0))
    _png(plot_underflow(reports, tmp_path / "underflow.png"))
    _png(plot_underflow(reports[0], tmp_path / "one.png"))
    records = [
        {"step": i, "scale": 2.0 ** (10 - (i < 3) * i), "skipped": i < 3, "grad_amax": 0.5} for i in range(9)
    ]
    _png(plot_scale_history(records, tmp_path / "scale.png"))
    for path in ("run.jsonl", tmp_path / "run.jsonl"):  # was: "... got str" / "... got PosixPath", no hint
        with pytest.raises(
            TypeError, match=r"got the path '.*run.jsonl': read a log with .*load_log\(path\)"
        ):
            plot_scale_history(path, tmp_path / "x.png")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="UnderflowReport"):
        plot_underflow([], tmp_path / "x.png")
    with pytest.raises(TypeError, match="Log2Histogram"):
        plot_gradient_histogram([1, 2], tmp_path / "x.png")


def test_missing_matplotlib_is_a_clear_error(reports, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"pip install 'mixprec\[plot\]'"):
        plot_underflow(reports, tmp_path / "x.png")


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


def test_report_says_how_many_parameters_it_leaves_unnamed(tmp_path):
    # was: the 8 most frequent named, the other 2 left out without a word (a reader took them for finite)
    names = [f"blocks.{i}.weight" for i in range(10)]
    records = [
        {"step": 0, "scale": 1024.0, "skipped": True, "grad_amax": None, "nonfinite_params": names},
        {"step": 1, "scale": 512.0, "skipped": True, "grad_amax": None, "nonfinite_params": names[:8]},
    ]
    log = tmp_path / "scaler.jsonl"
    log.write_text(jsonl_text(records))
    summary = write_report(log, tmp_path / "out")[-1].read_text()
    assert "`blocks.7.weight` (2) and 2 more." in summary and "blocks.8" not in summary


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
    (tmp_path / "taken").write_text("")  # was: FileExistsError traceback after the diagnostics
    capsys.readouterr()
    assert cli.inspect_main(["--out", str(tmp_path / "taken")]) == 2
    captured = capsys.readouterr()
    assert "taken is a file, not a folder" in captured.err and captured.out == ""


def test_subcommand_table_points_to_real_commands():
    import argparse
    import importlib

    from mixprec import cli as top_cli

    for module_name, help_name, add_name, run_name in top_cli.SUBCOMMANDS.values():
        module = importlib.import_module(module_name)
        parser = argparse.ArgumentParser()
        getattr(module, add_name)(parser)
        assert isinstance(getattr(module, help_name), str) and callable(getattr(module, run_name))
    assert top_cli.SUBCOMMANDS["inspect"][1:] == ("INSPECT_HELP", "add_inspect_arguments", "run_inspect")
    assert top_cli.build_parser().parse_args(["inspect"]).handler is cli.run_inspect


@pytest.mark.parametrize("name", ["inspect_find_nonfinite.py", "inspect_scaler_log.py"])
def test_examples_run(name, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [name, str(tmp_path)])
    runpy.run_path(str(EXAMPLES / name), run_name="__main__")
    assert capsys.readouterr().out
