"""MixprecAccelerator in a plain Accelerate loop: a tiny MLP, 20 steps on CPU."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

pytest.importorskip("accelerate")

from accelerate.state import AcceleratorState
from accelerate.utils import AutocastKwargs

import mixprec
from mixprec.inspect import trace_dtypes
from mixprec.integrations.accelerate import MixprecAccelerator
from tests.integrations import _tiny_accelerate as tiny


@pytest.fixture(scope="module")
def accelerate_bf16(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The oracle: Accelerate's own mixed_precision="bf16", in a process that never imports mixprec."""
    out = tmp_path_factory.mktemp("oracle") / "accelerate_bf16.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, tiny.__file__, str(out)], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out)


@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_default_policy_matches_accelerates_bf16_bitwise(accelerate_bf16: dict, mixed_precision: str) -> None:
    accelerator = MixprecAccelerator(mixed_precision=mixed_precision, cpu=True, dtype=torch.bfloat16)
    model, _, _, losses = tiny.train(accelerator)
    got = tiny.result(model, losses)
    assert torch.equal(got["losses"], accelerate_bf16["losses"])
    for name, tensor in accelerate_bf16["state"].items():
        assert torch.equal(tensor, got["state"][name]), name


@pytest.fixture(autouse=True)
def fresh_accelerator_state() -> None:
    """Accelerate keeps one process-wide state; each test builds its own accelerator."""
    AcceleratorState._reset_state(reset_partial_state=True)


def _traced_step(
    accelerator: MixprecAccelerator, explicit_region: bool, model: nn.Module | None = None
) -> dict:
    model = accelerator.prepare(tiny.make_model() if model is None else model)
    with trace_dtypes(model) as trace:
        with accelerator.autocast() if explicit_region else contextlib.nullcontext():
            out = model(torch.randn(4, tiny.FEATURES))
        out.sum().backward()
    return trace.counts


def test_a_module_pinned_to_fp32_runs_in_fp32() -> None:
    policy = mixprec.Policy().with_modules({"1": torch.float32})
    accelerator = MixprecAccelerator(cpu=True, policy=policy, dtype=torch.bfloat16)
    counts = _traced_step(accelerator, explicit_region=True)
    assert counts["1"]["linear"] == {torch.float32: 1}
    assert counts["0.0"]["linear"] == {torch.bfloat16: 1}
    assert counts["0.3"]["linear"] == {torch.bfloat16: 1}


def test_a_filter_pin_needs_no_explicit_region_and_a_name_pin_warns_without_one() -> None:
    model = tiny.make_model()
    policy = mixprec.Policy().with_modules({lambda module, name: module is model[1]: torch.float32})
    counts = _traced_step(MixprecAccelerator(cpu=True, policy=policy), explicit_region=False, model=model)
    assert counts["1"]["linear"] == {torch.float32: 1}
    assert counts["0.0"]["linear"] == {torch.bfloat16: 1}
    AcceleratorState._reset_state(reset_partial_state=True)
    by_name = MixprecAccelerator(cpu=True, policy=mixprec.Policy().with_modules({"1": torch.float32}))
    with pytest.warns(UserWarning, match="accelerator.autocast"):
        _traced_step(by_name, explicit_region=False)


def test_fp16_inf_batches_are_skipped_counted_and_diagnosed(caplog: pytest.LogCaptureFixture) -> None:
    scaler = mixprec.GradScaler(init_scale=2.0**10, growth_interval=1000, hysteresis=2)
    accelerator = MixprecAccelerator(cpu=True, dtype=torch.float16, scaler=scaler)
    scales, skipped, heads = [], [], []

    def after_step(model: nn.Module, batch: tuple, loss: torch.Tensor) -> None:
        scales.append(scaler.get_scale())
        skipped.append(scaler.skipped_steps)
        heads.append(model[1].weight.detach().clone())
        x, y = batch
        accelerator.diagnose_step(
            model, x, loss, loss_fn=lambda model, x: nn.functional.cross_entropy(model(x), y)
        )

    with caplog.at_level(logging.WARNING, logger="mixprec.integrations"):
        # fused AdamW skips inside its kernel: Accelerate alone would not notice the skip
        _, _, scheduler, losses = tiny.train(
            accelerator, inf_batches=(5, 8), fused=True, after_step=after_step
        )
    assert skipped == [0] * 5 + [1] * 3 + [2] * 12
    assert scales == [1024.0] * 8 + [512.0] * 12
    assert torch.equal(heads[5], heads[4]) and torch.equal(heads[8], heads[7])
    assert not torch.equal(heads[-1], heads[8])
    assert scheduler.scheduler.last_epoch == tiny.STEPS - 2  # skipped steps leave the LR schedule alone
    assert all(bool(torch.isfinite(loss)) for loss in losses[9:])
    (sentence,) = accelerator.mixprec_diagnoses
    assert sentence.startswith("mixprec: step")
    assert (
        "skipped its optimizer step" in sentence
        and "inputs of linear in module '0.0' already held inf/nan" in sentence
    )
    assert [r.getMessage() for r in caplog.records if r.name == "mixprec.integrations"] == [sentence]


def test_autocast_honours_autocast_kwargs() -> None:
    accelerator = MixprecAccelerator(cpu=True, dtype=torch.bfloat16)
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with accelerator.autocast():
        assert torch.mm(a, b).dtype == torch.bfloat16
        with accelerator.autocast(AutocastKwargs(enabled=False)):  # Accelerate's fp32 island
            assert torch.mm(a, b).dtype == torch.float32


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(TypeError, match="mixprec.GradScaler"):
        MixprecAccelerator(cpu=True, scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="compute dtype"):
        MixprecAccelerator(cpu=True, policy="16-mixed", dtype=torch.bfloat16)
    AcceleratorState._reset_state(reset_partial_state=True)
    with pytest.raises(ValueError, match="contradicts mixed_precision='bf16'"):
        MixprecAccelerator(cpu=True, mixed_precision="bf16", dtype=torch.float16)
    AcceleratorState._reset_state(reset_partial_state=True)
    with pytest.raises(ValueError, match=r"^mixed_precision='bf16' asks for torch\.bfloat16, but the policy"):
        MixprecAccelerator(cpu=True, mixed_precision="bf16", policy="16-mixed")  # no dtype= given


def test_diagnose_step_takes_the_reports_loss_fn_and_refuses_a_loss_of_the_output() -> None:
    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = MixprecAccelerator(cpu=True, dtype=torch.float16, scaler=mixprec.GradScaler())
    model = accelerator.prepare(nn.Sequential(nn.Linear(4, 3)))
    x, y = torch.randn(2, 4), torch.tensor([0, 2])
    with pytest.raises(TypeError, match=r"diagnose_step: loss_fn takes one required argument.*model, batch"):
        accelerator.diagnose_step(model, x, torch.tensor(float("nan")), loss_fn=lambda out: out.sum())
    with pytest.raises(TypeError, match="must be callable"):
        accelerator.diagnose_step(model, x, torch.tensor(1.0), loss_fn="cross_entropy")
    assert accelerator.mixprec_diagnoses == []  # refused before anything ran
    with torch.no_grad():
        model[0].weight[0, 0] = float("inf")
    sentence = accelerator.diagnose_step(
        model, x, torch.tensor(float("nan")), loss_fn=lambda m, b: nn.functional.cross_entropy(m(b), y)
    )
    assert sentence is not None and sentence.startswith("mixprec: step 0 gave a non-finite loss")
    assert "parameter '0.weight' already held inf before the run" in sentence  # the weight, not the data
    assert accelerator.mixprec_diagnoses == [sentence]


def test_diagnose_step_without_loss_fn_on_a_model_returning_logits_says_to_pass_one() -> None:
    """The common classifier: the output is logits, not a loss. The refusal names the output and the
    missing ``loss_fn=``, not a ``loss_fn(model, batch)`` the caller never passed."""
    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = MixprecAccelerator(cpu=True, dtype=torch.float16, scaler=mixprec.GradScaler())
    model = accelerator.prepare(nn.Sequential(nn.Linear(4, 3)))
    with pytest.raises(ValueError) as caught:
        accelerator.diagnose_step(model, torch.randn(2, 4), torch.tensor(float("nan")))
    message = str(caught.value)
    assert "output (Tensor of shape (2, 3) (float32)) holds no loss" in message, message
    assert "pass loss_fn=" in message and "must return a one-element tensor" not in message, message
    assert accelerator.mixprec_diagnoses == []


def test_dtype_takes_a_dtype_name_as_autocast_does() -> None:
    accelerator = MixprecAccelerator(cpu=True, dtype="fp16")
    assert accelerator.mixprec_dtype is torch.float16 and accelerator.mixprec_scaler is not None
    with accelerator.autocast():
        assert torch.get_autocast_dtype("cpu") == torch.float16
    with pytest.raises(ValueError, match=r"unknown dtype 'fp17' for dtype.*accepted"):
        MixprecAccelerator(cpu=True, dtype="fp17")
