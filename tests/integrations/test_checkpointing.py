"""Pinned policies under gradient checkpointing, in MixprecTrainer and MixprecAccelerator (tiny GPT-2)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import mixprec
from mixprec.integrations.accelerate import MixprecAccelerator
from mixprec.integrations.transformers import MixprecTrainer
from tests.integrations import _tiny_hf as tiny

POLICY = mixprec.Policy().with_modules({"transformer.h.0.mlp": torch.float32})
STEPS = 5


def _assert_equal(expected: dict, got: dict) -> None:
    assert got["losses"] == expected["losses"] and len(got["losses"]) == STEPS
    for name, tensor in expected["state"].items():
        assert torch.equal(tensor, got["state"][name]), name


def test_trainer_with_a_pin_and_gradient_checkpointing_equals_the_run_without(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    runs = {}
    for checkpointing in (False, True):
        args = {"gradient_checkpointing": checkpointing, "max_steps": STEPS}
        with caplog.at_level(logging.INFO, logger="mixprec.integrations"):
            trainer, model = tiny.train(
                MixprecTrainer, str(tmp_path / str(checkpointing)), args=args, policy=POLICY
            )
        runs[checkpointing] = tiny.result(trainer, model)
    _assert_equal(runs[False], runs[True])  # dropout included: the recompute replays the RNG and the pin
    (line,) = [r.getMessage() for r in caplog.records if "gradient checkpointing" in r.getMessage()]
    assert "context_fn=mixprec.autocast_context_fn" in line


def test_a_reentrant_checkpoint_the_user_enabled_is_refused_naming_the_fix(tmp_path: Path) -> None:
    model = tiny.make_model()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    args = tiny.training_args(str(tmp_path), max_steps=2)
    trainer = MixprecTrainer(model=model, args=args, train_dataset=tiny.TokenData(), policy=POLICY)
    with pytest.raises(ValueError, match=r"use_reentrant=True.*'context_fn': mixprec.autocast_context_fn"):
        trainer.train()


def _accelerate_run(checkpointing: bool) -> dict:
    accelerator = MixprecAccelerator(cpu=True, policy=POLICY)
    model = tiny.make_model()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    model.train()
    data, losses = tiny.TokenData(), []
    for step in range(STEPS):
        ids = data.ids[step * tiny.BATCH : (step + 1) * tiny.BATCH]
        with accelerator.autocast():
            loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def test_accelerator_with_a_pin_and_gradient_checkpointing_equals_the_run_without() -> None:
    torch.manual_seed(0)
    plain = _accelerate_run(False)
    torch.manual_seed(0)
    _assert_equal(plain, _accelerate_run(True))


def _lightning_run(checkpointing: bool) -> dict:
    L = pytest.importorskip("lightning")
    from mixprec.integrations.lightning import MixprecPrecision
    from tests.integrations import _tiny_lightning

    class LM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lm = tiny.make_model()
            if checkpointing:
                self.lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            self.losses: list[float] = []

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            loss = self.lm(input_ids=batch, labels=batch).loss
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    policy = mixprec.Policy().with_modules({"lm.transformer.h.0.mlp": torch.float32})
    module = LM()
    loader = torch.utils.data.DataLoader(tiny.TokenData().ids, batch_size=tiny.BATCH)
    plugin = MixprecPrecision("bf16-mixed", policy=policy)
    _tiny_lightning.trainer(max_steps=STEPS, plugins=[plugin]).fit(module, loader)
    return {"losses": module.losses, "state": {k: v.detach().clone() for k, v in module.state_dict().items()}}


def test_lightning_plugin_with_a_pin_and_gradient_checkpointing_equals_the_run_without() -> None:
    _assert_equal(_lightning_run(False), _lightning_run(True))
