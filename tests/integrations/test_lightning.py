"""MixprecPrecision and MixprecDiagnostics in Lightning's real Trainer: a tiny module, 20 steps on CPU."""

from __future__ import annotations

import csv
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

L = pytest.importorskip("lightning")

import mixprec  # noqa: E402
from mixprec.inspect import trace_dtypes  # noqa: E402
from mixprec.integrations.lightning import MixprecDiagnostics, MixprecPrecision  # noqa: E402
from tests.integrations import _tiny_lightning as tiny  # noqa: E402


@pytest.fixture(scope="module")
def lightning_bf16(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The oracle: Lightning's own precision="bf16-mixed", in a process that never imports mixprec."""
    out = tmp_path_factory.mktemp("oracle") / "lightning_bf16.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, tiny.__file__, str(out)], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out)


def test_default_policy_matches_lightnings_bf16_bitwise(lightning_bf16: dict) -> None:
    model = tiny.make_model()
    tiny.trainer(plugins=[MixprecPrecision("bf16-mixed")]).fit(model, tiny.loader())
    got = tiny.result(model)
    assert len(got["losses"]) == tiny.STEPS
    assert torch.equal(got["losses"], lightning_bf16["losses"])
    for name, tensor in lightning_bf16["state"].items():
        assert torch.equal(tensor, got["state"][name]), name


def test_a_module_pinned_to_fp32_runs_in_fp32() -> None:
    policy = mixprec.Policy().with_modules({"head": torch.float32})
    model = tiny.make_model()
    with trace_dtypes(model) as trace:
        tiny.trainer(max_steps=3, plugins=[MixprecPrecision("bf16-mixed", policy=policy)]).fit(
            model, tiny.loader()
        )
    assert trace.counts["head"]["linear"] == {torch.float32: 3}
    assert trace.counts["body.0"]["linear"] == {torch.bfloat16: 3}
    assert trace.counts["body.3"]["linear"] == {torch.bfloat16: 3}


class _Snapshots(L.Callback):
    def __init__(self) -> None:
        self.weights: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        self.weights.append(pl_module.head.weight.detach().clone())


def _metrics(log_dir: Path) -> list[dict[str, str]]:
    (path,) = log_dir.rglob("metrics.csv")
    with open(path) as handle:
        return [row for row in csv.DictReader(handle) if row.get("loss_scale")]


def test_fp16_inf_batches_are_skipped_counted_logged_and_diagnosed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    scaler = mixprec.GradScaler(init_scale=2.0**10, growth_interval=1000, hysteresis=2)
    plugin = MixprecPrecision("16-mixed", scaler=scaler)
    diagnostics, snapshots = MixprecDiagnostics(), _Snapshots()
    model = tiny.make_model()
    logger = L.pytorch.loggers.CSVLogger(tmp_path)
    with caplog.at_level(logging.WARNING, logger="mixprec.integrations"):
        tiny.trainer(
            plugins=[plugin], callbacks=[diagnostics, snapshots], logger=logger, log_every_n_steps=1
        ).fit(model, tiny.loader(inf_batches=(5, 8)))
    rows = _metrics(tmp_path)
    assert [int(row["step"]) for row in rows] == list(range(tiny.STEPS))
    assert [float(row["skipped_steps"]) for row in rows] == [0] * 5 + [1] * 3 + [2] * 12
    assert [float(row["loss_scale"]) for row in rows] == [1024.0] * 8 + [512.0] * 12  # hysteresis=2
    assert scaler.skipped_steps == 2 and scaler.get_scale() == 512.0
    assert torch.equal(snapshots.weights[5], snapshots.weights[4])  # skipped: weights untouched
    assert torch.equal(snapshots.weights[8], snapshots.weights[7])
    assert not torch.equal(snapshots.weights[-1], snapshots.weights[8])  # and training went on
    # the diagnosis re-ran training_step once (its self.log muted): the module recorded 21 losses
    assert len(model.losses) == tiny.STEPS + 1 and not bool(torch.isfinite(model.losses[6]))
    assert all(bool(torch.isfinite(loss)) for loss in model.losses[10:])
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert len(diagnostics.diagnoses) == 1
    sentence = diagnostics.diagnoses[0]
    assert sentence.startswith("mixprec: step 6 skipped its optimizer step.")
    assert "inputs of linear in module 'body.0' already held inf/nan" in sentence
    assert [r.getMessage() for r in caplog.records if r.name == "mixprec.integrations"] == [sentence]


def _fit_epochs(epochs: int, ckpt: Path | None = None, save: Path | None = None) -> tuple:
    scaler = mixprec.GradScaler(init_scale=2.0**10, growth_interval=4, hysteresis=2)
    model = tiny.make_model()
    trainer = tiny.trainer(
        max_steps=-1, max_epochs=epochs, plugins=[MixprecPrecision("16-mixed", scaler=scaler)]
    )
    trainer.fit(model, tiny.loader(inf_batches=(7,), batches=10), ckpt_path=ckpt)
    if save is not None:
        trainer.save_checkpoint(save)
    return model, scaler


def test_checkpoints_hold_the_scaler_and_resume_bitwise(tmp_path: Path) -> None:
    straight, straight_scaler = _fit_epochs(2)
    _, first_half = _fit_epochs(1, save=tmp_path / "half.ckpt")
    saved = torch.load(tmp_path / "half.ckpt", weights_only=True)["MixprecPrecision"]
    assert saved == first_half.state_dict()
    assert saved["_hysteresis_tracker"] == 1 and saved["_growth_tracker"] == 2  # mid-window state travels
    resumed, resumed_scaler = _fit_epochs(2, ckpt=tmp_path / "half.ckpt")
    assert resumed_scaler.state_dict() == straight_scaler.state_dict()
    exact = dict(rtol=0, atol=0, equal_nan=True)  # the inf batch's loss is nan in both
    torch.testing.assert_close(torch.stack(resumed.losses), torch.stack(straight.losses[10:]), **exact)
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="'bf16-mixed' or '16-mixed'"):
        MixprecPrecision("32-true")
    with pytest.raises(ValueError, match="compute dtype"):
        MixprecPrecision("bf16-mixed", policy="16-mixed")
    with pytest.raises(TypeError, match="mixprec.GradScaler"):
        MixprecPrecision("16-mixed", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError):
        MixprecPrecision("bf16-mixed", device="tpu")
    assert MixprecPrecision("16-mixed").scaler is not None and MixprecPrecision().scaler is None
