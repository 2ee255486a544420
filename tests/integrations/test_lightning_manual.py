"""MixprecDiagnostics where users push Lightning: manual optimization, a two-optimizer GAN, accumulation."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

L = pytest.importorskip("lightning")

import mixprec  # noqa: E402
from mixprec.integrations.lightning import MixprecDiagnostics, MixprecPrecision  # noqa: E402
from tests.integrations import _tiny_lightning as tiny  # noqa: E402
from tests.integrations import _tiny_lightning_manual as manual  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXACT = dict(rtol=0, atol=0, equal_nan=True)


@pytest.fixture(scope="module")
def native(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The oracle: Lightning's own MixedPrecision plugin, in a process that never imports mixprec."""
    out = tmp_path_factory.mktemp("oracle") / "manual.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "tests.integrations._tiny_lightning_manual", str(out)],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out)


def _assert_same(expected: dict, got: dict) -> None:
    torch.testing.assert_close(got["losses"], expected["losses"], **EXACT)
    for name, tensor in expected["state"].items():
        assert torch.equal(tensor, got["state"][name]), name
    assert got["scale"] == expected["scale"]


def test_manual_optimization_inf_run_equals_lightnings_16_mixed(native: dict) -> None:
    model, diagnostics = manual.make(manual.Manual), MixprecDiagnostics()
    plugin = MixprecPrecision("16-mixed")
    got = manual.result(model, manual.fit(model, plugin, [diagnostics]))
    expected = native["manual-16"]
    _assert_same(expected, got)  # weights, losses and the scale (32768: halved once)
    assert got["scheduler_steps"] == expected["scheduler_steps"] == 20  # advanced on the skip, as Lightning
    assert got["lr"] == expected["lr"]
    assert plugin.scaler.skipped_steps == 1 and len(model.losses) == 20  # training_step never re-run
    (sentence,) = diagnostics.diagnoses
    assert sentence.startswith(f"mixprec: step {manual.INF_BATCH + 1} skipped its optimizer step.")
    assert "'body.0.weight'" in sentence and "manual optimization" in sentence


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_a_gan_returning_none_runs_with_diagnostics(native: dict, precision: str) -> None:
    model, diagnostics = manual.make(manual.Gan), MixprecDiagnostics()
    plugin = MixprecPrecision(precision)
    got = manual.result(model, manual.fit(model, plugin, [diagnostics]))
    _assert_same(native["gan-16" if precision == "16-mixed" else "gan-bf16"], got)
    if precision == "bf16-mixed":
        stale = native["gan-bf16-cached"]["losses"]  # torch.autocast's stale cast: not what mixprec does
        assert not torch.equal(torch.nan_to_num(stale), torch.nan_to_num(got["losses"]))
        assert diagnostics.diagnoses == []  # no scaler, and training_step returns no loss to check
        return
    assert plugin.scaler.skipped_steps == 1  # the discriminator's step; the generator's went on
    (sentence,) = diagnostics.diagnoses
    # Lightning's global step counts both optimizers' steps: the D step of batch 5 is the 11th
    assert sentence.startswith(f"mixprec: step {2 * manual.INF_BATCH + 2} skipped its optimizer step.")
    assert "'disc.0.weight'" in sentence and "'gen." not in sentence


class _Plain(tiny.Tiny):
    """Tiny without its LayerNorm, so a large input makes the head's weight gradient large."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(tiny.FEATURES, 32))


def test_under_accumulation_the_overflowing_micro_batch_is_diagnosed() -> None:
    """Batch 4 (the first micro-batch of step 3) overflows only in the scaled backward; 5 is clean."""
    scaler = mixprec.GradScaler(init_scale=2.0**16)
    diagnostics = MixprecDiagnostics()
    loader = tiny.loader(batches=8)
    x, _ = loader.dataset.tensors
    x[4 * tiny.BATCH : 5 * tiny.BATCH] *= 30  # the head's weight gradient overflows at scale 2**16
    torch.manual_seed(0)
    model = _Plain()
    tiny.trainer(
        max_steps=4, accumulate_grad_batches=2, plugins=[MixprecPrecision("16-mixed", scaler=scaler)],
        callbacks=[diagnostics],
    ).fit(model, loader)  # fmt: skip
    assert scaler.skipped_steps == 1
    (sentence,) = diagnostics.diagnoses
    assert sentence.startswith("mixprec: step 3 skipped its optimizer step.")
    assert "In micro-batch 1 of 2: Backward: the backward of linear in module 'head'" in sentence
