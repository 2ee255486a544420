"""inf, -inf and nan at every position of every gradient; tiny and huge finite values."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import mixprec.scaling

from .helpers import bits_equal

SHAPES = [((4, 3), torch.float32), ((4,), torch.float32), ((5,), torch.bfloat16)]
POSITIONS = [(which, where) for which, (shape, _) in enumerate(SHAPES) for where in range(math.prod(shape))]
OPTIMIZERS = {
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adam-foreach": lambda params: torch.optim.Adam(params, lr=0.1, foreach=True),
    "adam-fused": lambda params: torch.optim.Adam(params, lr=0.1, fused=True),
}


def setup(optimizer_name):
    """Parameters, an optimizer whose state exists already, and a scaler one clean step in."""
    generator = torch.Generator().manual_seed(0)
    params = [
        torch.nn.Parameter(torch.randn(shape, generator=generator).to(dtype)) for shape, dtype in SHAPES
    ]
    optimizer = OPTIMIZERS[optimizer_name](params)
    scaler = mixprec.scaling.GradScaler(init_scale=2.0**10)
    fill_grads(scaler, params)
    scaler.step(optimizer)
    scaler.update()
    return params, optimizer, scaler


def fill_grads(scaler, params):
    for index, param in enumerate(params):
        param.grad = scaler.scale(torch.full_like(param, 0.01 * (index + 1), dtype=torch.float32)).to(
            param.dtype
        )


@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
def test_non_finite_anywhere_skips_and_touches_nothing(optimizer_name, value):
    params, optimizer, scaler = setup(optimizer_name)
    for which, where in POSITIONS:
        fill_grads(scaler, params)
        params[which].grad.view(-1)[where] = value
        before_params = [p.detach().clone() for p in params]
        before_state = copy.deepcopy(optimizer.state)
        scale, skipped = scaler.get_scale(), scaler.skipped_steps
        assert scaler.step(optimizer) is None
        scaler.update()
        assert all(bits_equal(a, b) for a, b in zip(before_params, params, strict=True)), (which, where)
        for param in params:
            for key, tensor in before_state[param].items():
                assert bits_equal(tensor, optimizer.state[param][key]), (which, where, key)
        assert scaler.get_scale() == scale / 2 and scaler.skipped_steps == skipped + 1
        assert scaler.last_step_skipped
        scaler.update(2.0**10)  # keep the scale from drifting towards the floor


@pytest.mark.parametrize("value", [3.0e38, -3.0e38, 1e-45, -1e-45, 0.0, -0.0, 6e-8, 65504.0])
def test_tiny_and_huge_finite_values_step_exactly_like_torch(value):
    results = []
    for scaler in (mixprec.scaling.GradScaler(init_scale=3.0), torch.amp.GradScaler("cpu", init_scale=3.0)):
        params = [
            torch.nn.Parameter(torch.zeros(6)),
            torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16)),
        ]
        optimizer = torch.optim.SGD(params, lr=1.0)
        scaler.scale(torch.ones(()))
        params[0].grad = torch.tensor([value, 1.0, -value, 2.0, value, 0.5])
        params[1].grad = torch.tensor([value, -1.0]).to(torch.bfloat16)
        scaler.step(optimizer)
        scaler.update()
        results.append(([p.detach().clone() for p in params], scaler.get_scale()))
    (ours, our_scale), (theirs, their_scale) = results
    assert our_scale == their_scale
    assert all(bits_equal(a, b) for a, b in zip(ours, theirs, strict=True))


def test_a_finite_gradient_that_overflows_only_after_unscaling_is_not_an_overflow_as_in_torch():
    # Scale below 1: 3e38 / 0.5 is inf in float32, but torch checks before multiplying and so does mixprec.
    for scaler in (mixprec.scaling.GradScaler(init_scale=0.5), torch.amp.GradScaler("cpu", init_scale=0.5)):
        param = torch.nn.Parameter(torch.zeros(2))
        optimizer = torch.optim.SGD([param], lr=1.0)
        scaler.scale(torch.ones(()))
        param.grad = torch.tensor([3.0e38, 1.0])
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        assert scaler.get_scale() == 0.5 and param.grad[0].item() == math.inf
