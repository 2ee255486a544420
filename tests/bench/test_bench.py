"""The bench harness at its ``tiny`` size: records, determinism, data, modes, planning and output files."""

from __future__ import annotations

import argparse
import gzip
import json
import math
import struct
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from mixprec.bench import data, modes, plan, report, runner
from mixprec.bench.modes import MODES, ModeSpec
from mixprec.bench.runner import Job, run_job
from mixprec.bench.workloads import WORKLOADS

TINY = {"size": "tiny", "steps": 3}


@pytest.fixture(scope="module")
def seed_loop_results() -> list[runner.RunResult]:
    return [run_job(Job("seed-loop", mode, **TINY)) for mode in ("fp32", "torch-amp-bf16")]


def test_registries_are_consistent() -> None:
    assert list(WORKLOADS) == ["lm", "cnn", "seed-loop"]
    for device, names in modes.DEFAULT_MODES.items():
        assert set(names) <= set(MODES), device
    for alias, per_device in modes.ALIASES.items():
        assert alias not in MODES
        assert set(per_device.values()) <= set(MODES)
    for spec in WORKLOADS.values():
        assert set(spec.presets) == {"tiny", "quick", "default", "large"}


def test_records_have_exact_keys_and_sane_values(seed_loop_results: list[runner.RunResult]) -> None:
    records = report.make_records(seed_loop_results)
    assert [r["mode"] for r in records] == ["fp32", "torch-amp-bf16"]
    for record in records:
        assert tuple(record) == report.RECORD_KEYS
        assert record["workload"] == "seed-loop" and record["device"] == "cpu" and record["steps"] == 3
        assert record["step_time_ms"] > 0 and math.isfinite(record["final_loss"])
        assert record["skipped_steps"] == 0 and record["final_scale"] is None
    assert records[0]["dtype"] == "float32" and records[1]["dtype"] == "bfloat16"
    assert records[0]["speedup_vs_fp32"] == 1.0
    assert len(seed_loop_results[0].history) == 3


def test_same_seed_gives_the_same_run(seed_loop_results: list[runner.RunResult]) -> None:
    again = run_job(Job("seed-loop", "fp32", **TINY))
    assert [h["loss"] for h in again.history] == [h["loss"] for h in seed_loop_results[0].history]
    assert again.final_loss == seed_loop_results[0].final_loss


@pytest.mark.parametrize("workload", ["lm", "cnn"])
def test_each_workload_trains_and_evaluates(workload: str) -> None:
    result = run_job(Job(workload, "fp32", **TINY))
    assert math.isfinite(result.final_loss) and result.final_metric > 0
    assert result.data_source


def test_isolated_run_measures_peak_memory() -> None:
    result = runner.run_isolated(Job("seed-loop", "fp32", **TINY))
    assert result.steps == 3 and len(result.history) == 3
    if sys.platform == "linux":
        assert result.memory_method in ("cpu-hwm", "cpu-maxrss")
        assert result.peak_memory_mb is None or result.peak_memory_mb >= 0


def test_isolated_failure_is_reported() -> None:
    with pytest.raises(runner.RunFailed, match="seed-loop/fp32 failed"):
        runner.run_isolated(Job("seed-loop", "fp32", size="no-such-size"))


@pytest.mark.parametrize("name", list(MODES))
def test_every_available_mode_runs_on_cpu(name: str) -> None:
    reason = MODES[name].unavailable("cpu")
    if reason is not None:
        pytest.skip(f"{name}: {reason}")
    result = run_job(Job("seed-loop", name, **TINY))
    assert math.isfinite(result.final_loss)
    assert result.dtype == str(MODES[name].dtype).removeprefix("torch.")


def test_scaled_mode_counts_a_skipped_step() -> None:
    mode = MODES["torch-amp-fp16"].create("cpu")
    model = nn.Linear(4, 2)
    mode.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    before = model.weight.detach().clone()
    mode.train_step(torch.randn(3, 4), torch.zeros(3, 2), lambda out, _: out.float().sum() * math.inf)
    scale, skipped = mode.observe()
    assert skipped and mode.skipped_steps == 1 and scale == 32768.0
    assert torch.equal(model.weight, before)


def test_missing_component_makes_a_mode_unavailable() -> None:
    spec = ModeSpec("needs-nothing-real", torch.bfloat16, "test", requires=("no_such_part",))
    reason = spec.unavailable("cpu")
    assert reason is not None and "mixprec.no_such_part" in reason


def test_unknown_names_list_the_accepted_ones() -> None:
    with pytest.raises(
        ValueError, match=r"unknown workload 'lmm' \(did you mean 'lm'\?\); accepted: lm, cnn"
    ):
        plan.make_plan(workloads=["lmm"], device="cpu")
    with pytest.raises(ValueError, match=r"unknown mode 'fp33'.*accepted: fp32, torch-amp-bf16"):
        plan.make_plan(modes=["fp33"], device="cpu")
    with pytest.raises(ValueError, match="steps must be at least 2"):
        plan.make_plan(steps=1, device="cpu")


def test_plan_resolves_aliases_and_leaves_out_what_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    assert plan.resolve_modes(["torch-amp", "O2"], "cpu") == ["torch-amp-bf16", "O2-bf16"]
    assert plan.resolve_modes(["torch-amp", "O2"], "cuda") == ["torch-amp-fp16", "O2-fp16"]
    broken = ModeSpec("broken", torch.bfloat16, "test", requires=("no_such_part",))
    monkeypatch.setitem(MODES, "broken", broken)
    result = plan.make_plan(
        workloads=["lm", "seed-loop"], modes=["fp32", "torch-amp-fp16", "broken"], size="quick", device="cpu"
    )
    assert [(j.workload, j.mode) for j in result.jobs] == [
        ("lm", "fp32"),
        ("seed-loop", "fp32"),
        ("seed-loop", "torch-amp-fp16"),
    ]
    assert any("broken left out" in note for note in result.notes)
    assert any("fp16 on a CPU" in note and "lm/torch-amp-fp16" in note for note in result.notes)


def test_text_corpus_from_a_file(tmp_path: Path) -> None:
    corpus = data.text_corpus(50_000, path=argparse.__file__)
    assert len(corpus.train) > len(corpus.val) > 0 and corpus.vocab == "".join(sorted(corpus.vocab))
    small = tmp_path / "small.txt"
    small.write_text("too short")
    with pytest.raises(ValueError, match="at least 10000"):
        data.text_corpus(50_000, path=small)
    with pytest.raises(FileNotFoundError, match="is not a file"):
        data.text_corpus(50_000, path=tmp_path / "missing.txt")


def _write_idx(path: Path, array: torch.Tensor) -> None:
    header = struct.pack(">HBB", 0, 0x08, array.dim()) + struct.pack(f">{array.dim()}I", *array.shape)
    with gzip.open(path, "wb") as handle:
        handle.write(header + array.to(torch.uint8).numpy().tobytes())


def test_fashion_mnist_reader_and_fallback(tmp_path: Path) -> None:
    assert data.fashion_mnist((tmp_path,)) is None  # absent: the cnn workload falls back to sklearn digits
    images = torch.randint(0, 256, (6, 28, 28))
    labels = torch.arange(6) % 10
    for key, stem in data.FASHION_MNIST_FILES.items():
        _write_idx(tmp_path / f"{stem}.gz", images if "images" in key else labels)
    split = data.fashion_mnist((tmp_path,))
    assert split is not None and split.x_train.shape == (6, 1, 28, 28)
    assert torch.equal(split.y_test, labels)
    digits = data.sklearn_digits(0)
    assert digits.x_train.shape[1:] == (1, 8, 8) and len(digits.y_test) == 359


def test_cnn_falls_back_to_sklearn_digits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(data, "FASHION_MNIST_DIRS", (tmp_path,))
    result = run_job(Job("cnn", "fp32", **TINY))
    assert "digits" in result.data_source and 0.0 <= result.final_metric <= 1.0


def test_outputs_json_log_plots_and_table(seed_loop_results: list[runner.RunResult], tmp_path: Path) -> None:
    report.write_json(seed_loop_results, tmp_path / "bench.json")
    records = json.loads((tmp_path / "bench.json").read_text())
    assert len(records) == 2 and all(tuple(r) == report.RECORD_KEYS for r in records)

    report.write_log(seed_loop_results, tmp_path / "steps.jsonl")
    lines = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert len(lines) == 6 and all(tuple(line) == report.LOG_KEYS for line in lines)

    written = report.write_plots(seed_loop_results, tmp_path / "plots")
    assert {p.name for p in written} == {"loss_seed-loop.png", "step_time.png"}
    assert all(p.stat().st_size > 1024 for p in written)

    table = report.format_table(seed_loop_results, notes=["a note"])
    assert "torch-amp-bf16" in table and "R^2" in table and "note: a note" in table
    assert "median wall time" in table and "peak MiB" in table
