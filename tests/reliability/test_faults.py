"""Faults from bug reports (issue 11), loss-scaling side: each failed before the fix."""

from __future__ import annotations

import copy
import math
import pickle

import pytest
import torch
from torch import nn

import mixprec

FLOAT32_TINY = torch.finfo(torch.float32).tiny


OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05),
    "adam-fused": lambda params: torch.optim.Adam(params, lr=1e-3, fused=True),
}


def _fp16_model(optimizer: str = "sgd"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    return model, OPTIMIZERS[optimizer](model.parameters())


def _iteration(model, opt, scaler, x, poison=1.0):
    opt.zero_grad()
    with mixprec.autocast("cpu", dtype=torch.float16):
        loss = model(x).float().pow(2).mean() * poison
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_training_resumes_after_a_long_run_of_nan_losses(optimizer):
    """200 NaN losses push the scale to the floor, where every fp16 gradient flushed to 0 and the weights
    never moved again. All-zero gradients under a finite loss are underflow: the scale goes back to
    init_scale and training resumes on its own (amax measured at the step's sync, or in the fused
    optimizer's check pass on every underflow_check_interval-th update)."""
    model, opt = _fp16_model(optimizer)
    scaler = mixprec.GradScaler("cpu")
    x = torch.randn(16, 8)
    for _ in range(200):
        _iteration(model, opt, scaler, x, poison=math.nan)
    assert scaler.get_scale() == FLOAT32_TINY  # at the floor, never 0
    before = [p.detach().clone() for p in model.parameters()]
    fused = optimizer.endswith("fused")
    for _ in range(scaler.rule.underflow_check_interval + 2 if fused else 3):
        _iteration(model, opt, scaler, x)
    assert scaler.get_scale() == 2.0**16
    assert not scaler.last_step_skipped
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))


def test_genuine_gradients_at_a_low_scale_do_not_reset_it():
    model, opt = _fp16_model()
    scaler = mixprec.GradScaler("cpu", init_scale=2.0**16)
    scaler.scale(torch.ones(()))  # create the scale
    scaler.update(2.0**4)
    _iteration(model, opt, scaler, torch.randn(16, 8))
    assert scaler.get_scale() == 2.0**4


def test_complex_gradients_are_unscaled_and_checked():
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(4, dtype=torch.complex64))
    opt = torch.optim.SGD([weight], lr=0.1)
    scaler = mixprec.GradScaler("cpu", init_scale=2.0**10)
    x = torch.randn(4, dtype=torch.complex64)
    scaler.scale((weight * x).abs().sum()).backward()
    scaled = weight.grad.clone()
    scaler.unscale_(opt)
    assert torch.equal(weight.grad, scaled / 2.0**10)  # a power of two: exact
    scaler.step(opt)
    scaler.update()
    assert not scaler.last_step_skipped
    opt.zero_grad()
    scaler.scale((weight * x).abs().sum()).backward()
    weight.grad[1] = complex(0.0, math.inf)
    kept = weight.detach().clone()
    scaler.step(opt)
    scaler.update()
    assert scaler.last_step_skipped and torch.equal(weight.detach(), kept)


def test_huge_init_scale_is_refused_naming_it():
    with pytest.raises(ValueError, match="init_scale"):
        mixprec.GradScaler(init_scale=1e39)  # inf in float32


def test_min_scale_below_float32_tiny_is_refused():
    with pytest.raises(ValueError, match="min_scale"):
        mixprec.GradScaler(min_scale=1e-50)  # would let the scale reach 0.0


def test_update_with_a_huge_scale_fails_cleanly_and_the_scaler_steps_on():
    model, opt = _fp16_model()
    scaler = mixprec.GradScaler("cpu")
    x = torch.randn(16, 8)
    _iteration(model, opt, scaler, x)
    scaler.scale(model(x).sum()).backward()
    scaler.step(opt)
    scale = scaler.get_scale()
    with pytest.raises(ValueError, match="new_scale"):
        scaler.update(1e39)
    assert scaler.get_scale() == scale
    scaler.update()
    _iteration(model, opt, scaler, x)
    assert 0 < scaler.get_scale() <= scale


def test_a_refused_state_dict_changes_nothing():
    model, opt = _fp16_model()
    scaler = mixprec.GradScaler("cpu")
    _iteration(model, opt, scaler, torch.randn(16, 8))
    saved = scaler.state_dict()
    with pytest.raises(ValueError, match="growth_factor"):
        scaler.load_state_dict({**saved, "scale": 8.0, "growth_factor": 0.5})
    assert scaler.state_dict() == saved
    with pytest.raises(ValueError, match="_growth_tracker"):
        scaler.load_state_dict({k: v for k, v in saved.items() if k != "_growth_tracker"})
    with pytest.raises(ValueError, match="growth_factor"):
        scaler.validate_state_dict({**saved, "growth_factor": 0.5})
    assert scaler.state_dict() == saved


def test_last_step_skipped_is_false_after_an_update_that_only_set_the_scale():
    model, opt = _fp16_model()
    scaler = mixprec.GradScaler("cpu")
    x = torch.randn(16, 8)
    _iteration(model, opt, scaler, x, poison=math.inf)
    assert scaler.last_step_skipped
    scaler.update(1024.0)  # an iteration with no step: nothing was skipped
    assert not scaler.last_step_skipped and scaler.get_scale() == 1024.0


def test_scalers_round_trip_deepcopy_and_pickle_mid_training():
    model, opt = _fp16_model()
    scaler = mixprec.GradScaler("cpu", rule=mixprec.HeadroomScale())
    for poison in (1.0, math.inf, 1.0):
        _iteration(model, opt, scaler, torch.randn(16, 8), poison)
    for copied in (copy.deepcopy(scaler), pickle.loads(pickle.dumps(scaler))):
        assert copied.state_dict() == scaler.state_dict()
        _iteration(model, opt, copied, torch.randn(16, 8))  # and it keeps working
