"""The bench harness at its ``tiny`` size: records, determinism, data, modes and planning."""

from __future__ import annotations

import argparse
import gzip
import math
import struct
from pathlib import Path

import pytest
import torch
from torch import nn

from mixprec.bench import data, jobs, modes, report, runner
from mixprec.bench.modes import MODES, ModeSpec, TrainMode
from mixprec.bench.runner import Job, run_job
from mixprec.bench.workloads import WORKLOADS

TINY = {"size": "tiny", "steps": 3}


@pytest.fixture(scope="module")
def tabular_results() -> list[runner.RunResult]:
    return [run_job(Job("tabular-regression", mode, **TINY)) for mode in ("fp32", "torch-amp-bf16")]


def test_registries_are_consistent() -> None:
    assert list(WORKLOADS) == ["lm", "lm-gemm", "cnn", "tabular-regression"]
    assert [name for name, spec in WORKLOADS.items() if spec.default] == ["lm", "cnn", "tabular-regression"]
    for device, names in modes.DEFAULT_MODES.items():
        assert set(names) <= set(MODES), device
    for alias, per_device in modes.ALIASES.items():
        assert alias not in MODES
        assert set(per_device.values()) <= set(MODES)
    for spec in WORKLOADS.values():
        assert set(spec.presets) == {"tiny", "quick", "default", "full", "large"}
        for preset in spec.presets.values():
            assert 1 <= preset.round_steps <= preset.steps and preset.warmup < preset.steps


def test_records_have_exact_keys_and_sane_values(tabular_results: list[runner.RunResult]) -> None:
    records = report.make_records(tabular_results)
    assert [r["mode"] for r in records] == ["fp32", "torch-amp-bf16"]
    for record in records:
        assert tuple(record) == report.RECORD_KEYS
        assert (
            record["workload"] == "tabular-regression" and record["device"] == "cpu" and record["steps"] == 3
        )
        assert record["step_time_ms"] > 0 and math.isfinite(record["final_loss"])
        assert record["step_time_q25_ms"] <= record["step_time_ms"] <= record["step_time_q75_ms"]
        assert record["rounds"] == 2 and len(record["round_medians_ms"]) == 2  # 3 steps, 1 warm-up
        assert record["skipped_steps"] == 0 and record["final_scale"] is None
    assert records[0]["dtype"] == "float32" and records[1]["dtype"] == "bfloat16"
    assert records[0]["compiled"] is False and records[1]["compiled"] is False  # eager runs
    assert records[0]["speedup_vs_fp32"] == 1.0
    history = tabular_results[0].history
    assert [h["round"] for h in history] == [0, 1, 2] and [h["step"] for h in history] == [0, 1, 2]


def test_same_seed_gives_the_same_run(tabular_results: list[runner.RunResult]) -> None:
    again = run_job(Job("tabular-regression", "fp32", **TINY))
    assert [h["loss"] for h in again.history] == [h["loss"] for h in tabular_results[0].history]
    assert again.final_loss == tabular_results[0].final_loss


@pytest.mark.parametrize("workload", ["lm", "cnn"])
def test_each_workload_trains_and_evaluates(workload: str) -> None:
    result = run_job(Job(workload, "fp32", **TINY))
    assert math.isfinite(result.final_loss) and result.final_metric > 0
    assert result.data_source


@pytest.mark.parametrize("name", list(MODES))
def test_every_mode_runs_on_cpu(name: str) -> None:
    """Every mode trains on a CPU (fp16 and fp8 ones emulated); only a missing optional dependency skips."""
    try:
        MODES[name].probe("cpu")
    except ImportError as exc:
        pytest.skip(f"{name} needs an optional dependency: {exc}")
    assert MODES[name].unavailable("cpu") is None
    result = run_job(Job("tabular-regression", name, **TINY))
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


class _BrokenMode(TrainMode):
    def prepare(self, model, optimizer):
        raise RuntimeError("this mode cannot run here")


def test_a_mode_whose_probe_step_fails_is_unavailable_with_the_reason() -> None:
    spec = ModeSpec("broken", torch.bfloat16, "test", runner=_BrokenMode)
    reason = spec.unavailable("cpu")
    assert reason is not None and "RuntimeError: this mode cannot run here" in reason


def test_unknown_names_list_the_accepted_ones() -> None:
    with pytest.raises(
        ValueError, match=r"unknown workload 'lmm' \(did you mean 'lm'\?\); accepted: lm, lm-gemm, cnn"
    ):
        jobs.make_plan(workloads=["lmm"], device="cpu")
    with pytest.raises(ValueError, match=r"unknown mode 'fp33'.*accepted: fp32, torch-amp-bf16"):
        jobs.make_plan(modes=["fp33"], device="cpu")
    with pytest.raises(ValueError, match="steps must be at least 2"):
        jobs.make_plan(steps=1, device="cpu")


def test_plan_resolves_aliases_and_leaves_out_what_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    assert jobs.resolve_modes(["torch-amp", "O2"], "cpu") == ["torch-amp-bf16", "O2-bf16"]
    assert jobs.resolve_modes(["torch-amp", "O2"], "cuda") == ["torch-amp-fp16", "O2-fp16"]
    broken = ModeSpec("broken", torch.bfloat16, "test", runner=_BrokenMode)
    monkeypatch.setitem(MODES, "broken", broken)
    result = jobs.make_plan(
        workloads=["lm", "tabular-regression"],
        modes=["fp32", "torch-amp-fp16", "broken"],
        size="quick",
        device="cpu",
    )
    assert [(j.workload, j.label) for j in result.jobs] == [
        ("lm", "fp32"),
        ("tabular-regression", "fp32"),
        ("tabular-regression", "torch-amp-fp16"),
        ("tabular-regression", "fp32 (A/A)"),  # the A/A run, only where fp32 has company
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


def test_idx_image_reader(tmp_path: Path) -> None:
    assert data.fashion_mnist((tmp_path,)) is None
    with pytest.raises(
        FileNotFoundError, match="lacks train-images-idx3-ubyte.*apt-get install dataset-fashion"
    ):
        data.idx_images(tmp_path)
    images = torch.randint(0, 256, (6, 28, 28))
    labels = torch.arange(6) % 10
    for key, stem in data.FASHION_MNIST_FILES.items():
        _write_idx(tmp_path / f"{stem}.gz", images if "images" in key else labels)
    split = data.fashion_mnist((tmp_path,))
    assert split is not None and split.x_train.shape == (6, 1, 28, 28)
    assert torch.equal(split.y_test, labels)
    digits = data.sklearn_digits(0)
    assert digits.x_train.shape[1:] == (1, 8, 8) and len(digits.y_test) == 359


def test_cnn_reads_digits_by_default_and_idx_images_on_request(tmp_path: Path) -> None:
    result = run_job(Job("cnn", "fp32", **TINY))
    assert "digits" in result.data_source and 0.0 <= result.final_metric <= 1.0
    for key, stem in data.FASHION_MNIST_FILES.items():
        shape = (40, 28, 28) if "images" in key else (40,)
        _write_idx(tmp_path / f"{stem}.gz", torch.randint(0, 256 if "images" in key else 10, shape))
    result = run_job(Job("cnn", "fp32", images=str(tmp_path), **TINY))
    assert "IDX images" in result.data_source and "28x28" in result.data_source


def test_plan_checks_data_and_images_up_front(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="--data .* is not a file"):
        jobs.make_plan(data=str(tmp_path / "missing.txt"), device="cpu", size="tiny")
    with pytest.raises(FileNotFoundError, match="--images .* lacks"):
        jobs.make_plan(images=str(tmp_path), device="cpu", size="tiny")
    text = tmp_path / "corpus.txt"
    text.write_text("x" * 20_000)
    made = jobs.make_plan(workloads=["cnn"], data=str(text), device="cpu", size="tiny")
    assert any("--data is read by the lm, lm-gemm workload(s) only" in note for note in made.notes)
    # lm-gemm reads --data as lm does: no note that it goes unread
    made = jobs.make_plan(workloads=["lm-gemm"], data=str(text), device="cpu", size="tiny")
    assert not any("--data" in note for note in made.notes)


@pytest.mark.parametrize(
    ("alias", "cpu", "cuda"),
    [
        ("bf16-mixed", "mixprec-bf16", "mixprec-bf16"),
        ("16-mixed", "mixprec-fp16", "mixprec-fp16"),
        ("32-true", "fp32", "fp32"),
        ("O0", "fp32", "fp32"),
        ("O1", "mixprec-bf16", "mixprec-fp16"),
        ("O3", "bf16-true", None),
    ],
)
def test_preset_names_and_apex_levels_resolve_to_the_bench_mode_that_runs_them(
    alias: str, cpu: str, cuda: str | None
) -> None:
    assert jobs.resolve_modes([alias], "cpu") == [cpu]
    if cuda is not None:
        assert jobs.resolve_modes([alias], "cuda") == [cuda]
    else:
        with pytest.raises(ValueError, match=r"mode 'O3' cannot run on cuda: .*closest are 'bf16-true'"):
            jobs.resolve_modes([alias], "cuda")


def test_a_preset_without_a_bench_mode_names_the_closest_ones() -> None:
    with pytest.raises(
        ValueError, match=r"mode '16-true' cannot run on cpu: fp16 weights without fp32 masters"
    ):
        jobs.make_plan(modes=["16-true"], device="cpu")


@pytest.mark.parametrize(
    ("mode", "scaled"), [("bf16-true", False), ("bf16-true-kahan", False), ("O2-bf16", True)]
)
def test_the_loss_scale_reads_none_when_the_mode_does_not_scale(mode: str, scaled: bool) -> None:
    """bf16-true's static scale of 1 only skips non-finite steps: the table's '-' (no scaling), not 1."""
    runner = MODES[mode].create("cpu")
    model = torch.nn.Linear(4, 2)
    runner.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    runner.train_step(torch.randn(3, 4), torch.randn(3, 2), lambda out, y: (out.float() - y).pow(2).mean())
    scale, skipped = runner.observe()
    assert (scale is not None) == scaled and not skipped
