"""MixprecTrainer: HF's real Trainer on a tiny GPT-2 (random init, nothing downloaded), 20 steps on CPU."""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import transformers

import mixprec
from mixprec.inspect import trace_dtypes
from mixprec.integrations.transformers import MixprecTrainer
from tests.integrations import _tiny_hf as tiny

PINNED = "transformer.h.0.mlp"


@pytest.fixture(scope="module")
def trainer_bf16(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The oracle: the Trainer's own bf16=True path, in a process that never imports mixprec."""
    out = tmp_path_factory.mktemp("oracle") / "hf_bf16.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, tiny.__file__, str(out)], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out)


def assert_bitwise(expected: dict, got: dict) -> None:
    assert len(got["losses"]) == tiny.STEPS
    assert got["losses"] == expected["losses"]
    assert expected["state"].keys() == got["state"].keys()
    for name, tensor in expected["state"].items():
        assert torch.equal(tensor, got["state"][name]), name


@pytest.mark.parametrize("bf16", [False, True], ids=["mixprec-alone", "inside-accelerate-bf16"])
def test_default_policy_matches_the_trainers_bf16_bitwise(
    trainer_bf16: dict, tmp_path: Path, bf16: bool
) -> None:
    trainer, model = tiny.train(MixprecTrainer, str(tmp_path), args={"bf16": bf16}, dtype=torch.bfloat16)
    assert_bitwise(trainer_bf16, tiny.result(trainer, model))


def _pinned_trace(tmp_path: Path, bf16: bool) -> dict:
    policy = mixprec.Policy().with_modules({PINNED: torch.float32})
    model = tiny.make_model()
    args = tiny.training_args(str(tmp_path), max_steps=3, bf16=bf16)
    trainer = MixprecTrainer(model=model, args=args, train_dataset=tiny.TokenData(), policy=policy)
    with trace_dtypes(model) as trace:
        trainer.train()
    return trace.counts


def _check_pinned(counts: dict) -> None:
    for layer in ("c_fc", "c_proj"):
        assert counts[f"{PINNED}.{layer}"]["addmm"] == {torch.float32: 3}, counts[f"{PINNED}.{layer}"]
        assert counts[f"transformer.h.1.mlp.{layer}"]["addmm"] == {torch.bfloat16: 3}
    assert set(counts[f"{PINNED}.act"]["tanh"]) == {torch.float32}


def test_a_module_pinned_to_fp32_runs_in_fp32(tmp_path: Path) -> None:
    _check_pinned(_pinned_trace(tmp_path, bf16=False))


def test_the_pin_holds_inside_accelerates_own_autocast(tmp_path: Path) -> None:
    _check_pinned(_pinned_trace(tmp_path, bf16=True))


class _Snapshots(transformers.TrainerCallback):
    def __init__(self) -> None:
        self.weights: list[torch.Tensor] = []

    def on_step_end(self, args, state, control, model=None, **kwargs):  # type: ignore[no-untyped-def]
        self.weights.append(model.transformer.h[0].attn.c_attn.weight.detach().clone())


def test_fp16_inf_batches_are_skipped_counted_logged_and_diagnosed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    scaler = mixprec.GradScaler(init_scale=2.0**10, growth_interval=1000, hysteresis=2)
    snapshots = _Snapshots()
    with caplog.at_level(logging.WARNING, logger="mixprec.integrations"):
        trainer, model = tiny.train(
            MixprecTrainer,
            str(tmp_path),
            data=tiny.EmbedData(),
            data_collator=tiny.InfCollator(inf_steps=(6, 9)),
            dtype=torch.float16,
            scaler=scaler,
            callbacks=[snapshots],
        )
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["step"] for entry in logs] == list(range(1, tiny.STEPS + 1))
    skipped = [entry["skipped_steps"] for entry in logs]
    assert skipped == [0] * 5 + [1] * 3 + [2] * 12
    scales = [entry["loss_scale"] for entry in logs]
    assert scales == [1024.0] * 8 + [512.0] * 12  # hysteresis=2: the second overflow backs off
    assert scaler.skipped_steps == 2 and scaler.get_scale() == 512.0
    # skipped steps leave the weights and the LR schedule where they were
    assert torch.equal(snapshots.weights[5], snapshots.weights[4])
    assert torch.equal(snapshots.weights[8], snapshots.weights[7])
    assert trainer.lr_scheduler.last_epoch == tiny.STEPS - 2  # 18 scheduler steps for 20 steps
    lrs = [entry["learning_rate"] for entry in logs]
    held = [step for step in range(1, tiny.STEPS) if lrs[step] == lrs[step - 1]]
    # 5.x logs the LR a step ran with, 4.x the one after its scheduler step: the held pair shifts by one
    assert held in ([6, 9], [5, 8])
    assert all(lrs[step] < lrs[step - 1] for step in range(1, tiny.STEPS) if step not in held)
    # gradients are unscaled before the Trainer clips and measures them (scaled, the norm would be ~1000x)
    assert 0 < logs[0]["grad_norm"] < 50
    # training went on
    assert all(math.isfinite(entry["loss"]) for entry in logs[9:])
    assert not torch.equal(snapshots.weights[-1], snapshots.weights[8])
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    # one diagnosis, at the first incident, naming the module and the non-finite data
    assert len(trainer.mixprec_diagnoses) == 1
    sentence = trainer.mixprec_diagnoses[0]
    assert sentence.startswith("mixprec: step 6 gave a non-finite loss.")
    assert "already held inf/nan" in sentence and "transformer" in sentence
    assert [r.getMessage() for r in caplog.records if r.name == "mixprec.integrations"] == [sentence]


class _TargetData(tiny.EmbedData):
    """Labels under another key, which only the subclass's ``compute_loss`` below reads."""

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"inputs_embeds": self.embeds[i], "target": self.ids[i]}


class _OwnLossTrainer(MixprecTrainer):
    """A Trainer subclass with its own loss, as HF's docs show (the model returns no loss)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        target = inputs.pop("target")
        outputs = model(**inputs)
        loss = torch.nn.functional.cross_entropy(outputs.logits.float().flatten(0, 1), target.flatten())
        return (loss, outputs) if return_outputs else loss


def test_the_diagnosis_reruns_a_subclass_s_own_compute_loss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A skipped step is re-run through the Trainer's compute_loss: re-running the model alone found no loss
    there and stopped training at the first skip."""
    # transformers 4.46 leaves an earlier bf16=True TrainingArguments' ACCELERATE_MIXED_PRECISION=bf16 in the
    # environment, where accelerate's bf16 autocast inside the fp16 region would keep the gradients finite
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    args = {"max_steps": 2, "remove_unused_columns": False}
    scaler = mixprec.GradScaler(init_scale=2.0**30)  # the first step's fp16 gradients overflow
    trainer, _ = tiny.train(
        _OwnLossTrainer, str(tmp_path), data=_TargetData(), args=args, policy="16-mixed", scaler=scaler
    )
    assert scaler.skipped_steps >= 1 and trainer.state.global_step == 2
    assert len(trainer.mixprec_diagnoses) == 1
    sentence = trainer.mixprec_diagnoses[0]
    assert sentence.startswith("mixprec: step 1 skipped its optimizer step. Backward:"), sentence
    assert "beyond fp16's largest finite value" in sentence


def test_predictions_come_back_in_float32_under_an_fp16_policy(tmp_path: Path) -> None:
    """As Accelerate converts a prepared model's outputs under its own fp16 (and MixprecAccelerator does):
    fp16 logits would reach ``compute_metrics`` as numpy float16 (bf16 ones HF converts itself)."""
    args = tiny.training_args(str(tmp_path))
    trainer = MixprecTrainer(model=tiny.make_model(), args=args, policy="16-mixed")
    data = torch.utils.data.Subset(tiny.TokenData(), range(8))
    logits = trainer.predict(data).predictions
    logits = logits[0] if isinstance(logits, tuple) else logits
    assert logits.dtype == np.float32 and logits.shape == (8, tiny.SEQ, tiny.VOCAB)
    assert np.array_equal(logits, logits.astype(np.float16).astype(np.float32))  # computed in fp16


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    args = tiny.training_args(str(tmp_path), bf16=True)
    model = tiny.make_model()
    with pytest.raises(TypeError, match="mixprec.GradScaler"):
        MixprecTrainer(model=model, args=args, scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="compute dtype"):
        MixprecTrainer(model=model, args=args, policy="16-mixed")
    # the error names the setting that asked for bf16 (bf16=True), not a dtype= the user never passed
    with pytest.raises(ValueError, match=r"^the TrainingArguments' bf16/fp16 asks for torch\.bfloat16"):
        MixprecTrainer(model=model, args=args, policy="16-mixed")
    with pytest.raises(ValueError, match=r"^dtype asks for torch\.bfloat16"):
        MixprecTrainer(model=model, args=tiny.training_args(str(tmp_path)), policy="16-mixed", dtype="bf16")
    with pytest.raises(ValueError, match="contradicts"):
        MixprecTrainer(model=model, args=args, dtype=torch.float16)
    with pytest.raises(ValueError, match="max_diagnoses"):
        MixprecTrainer(model=model, args=args, max_diagnoses=-1)


def test_checkpoints_hold_the_scaler_and_resume_bitwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not hasattr(transformers.Trainer, "_save_scaler"):
        # transformers 4.x loads its own rng_state.pth with torch.load's default, which torch >= 2.6 made
        # weights_only=True: the Trainer alone cannot resume there without torch's documented escape hatch
        monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")

    def run(out: Path, inf_steps: tuple[int, ...], resume: str | None = None, **args) -> tuple:
        scaler = mixprec.GradScaler(init_scale=2.0**10, growth_interval=3, hysteresis=2)
        model = tiny.make_model()
        trainer = MixprecTrainer(
            model=model,
            args=tiny.training_args(str(out), **args),
            train_dataset=tiny.EmbedData(),
            data_collator=tiny.InfCollator(inf_steps),
            dtype=torch.float16,
            scaler=scaler,
        )
        trainer.train(resume_from_checkpoint=resume)
        return model, scaler

    out = tmp_path / "run"
    straight, straight_scaler = run(out, (6,), save_strategy="steps", save_steps=10)
    saved = torch.load(out / "checkpoint-10" / "scaler.pt", weights_only=True)
    assert saved["scale"] == 4096.0 and saved["_growth_tracker"] == 1 and saved["skipped_steps"] == 1
    assert saved["_hysteresis_tracker"] == 2  # earned back by the growth at step 9
    resumed, resumed_scaler = run(out, (), resume=str(out / "checkpoint-10"), save_strategy="no")
    assert resumed_scaler.state_dict() == straight_scaler.state_dict()
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
