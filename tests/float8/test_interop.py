"""Float8Linear inside torch.autocast and mixprec.autocast, with mixprec.GradScaler, under torch.compile."""

from __future__ import annotations

import copy

import torch
from torch import nn

import mixprec
from mixprec.float8 import Float8Config, convert_to_float8_training

BF16 = torch.bfloat16


def _mlp(scaling: str = "dynamic", seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    return convert_to_float8_training(model, config=Float8Config(scaling=scaling))


def test_torch_autocast_does_not_recast_the_fp8_matmul() -> None:
    # Inside autocast the layer sees its input in bf16 and computes as it would outside on a bf16 input:
    # bitwise the same output, so autocast changed nothing inside the fp8 function.
    layer = _mlp()[0]
    x = torch.randn(4, 3, 16)
    with torch.autocast("cpu", dtype=BF16):
        inside = layer(x)
    outside = layer(x.to(BF16))
    assert inside.dtype == BF16
    assert torch.equal(inside, outside)


def test_mixprec_autocast_region() -> None:
    # Whatever the engine (its own op handlers, or torch's autocast state), the fp8 function computes in
    # its own dtypes: the output equals the layer run outside the region on the input as the region
    # hands it over (cast to bf16 where the region sets torch's autocast state, else unchanged).
    model = _mlp()
    x = torch.randn(4, 16)
    with mixprec.autocast("cpu", dtype=BF16):
        torch_state = torch.is_autocast_enabled("cpu")
        inside = model[0](x)
        other = inside @ torch.ones(32, 2)  # a non-Linear op follows the region's policy: bf16
        out = model(x)
        out.float().sum().backward()
    expected = model[0](x.to(BF16) if torch_state else x)
    assert torch.equal(inside, expected)
    assert other.dtype == BF16
    assert model[0].weight.grad is not None and torch.isfinite(model[0].weight.grad).all()


def _loss(model: nn.Module, step: int, poison: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)
    if poison:
        x[0, 0] = float("inf")
    return nn.functional.mse_loss(model(x), y)


def test_grad_scaler_unscaled_grads_equal_unscaled_training_bitwise() -> None:
    # Dynamic scaling divides the power-of-two loss scale out of the e5m2 scale exactly, so the fp8
    # gradients and, after unscale_, the weight gradients are bitwise those of an unscaled backward.
    model, reference = _mlp(), _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = mixprec.GradScaler("cpu", init_scale=2.0**12)
    scaler.scale(_loss(model, 0)).backward()
    scaler.unscale_(optimizer)
    _loss(reference, 0).backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


def test_grad_scaler_skips_a_non_finite_step_and_the_history_survives() -> None:
    model = _mlp("delayed")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = mixprec.GradScaler("cpu", init_scale=2.0**12)
    for step in range(3):
        optimizer.zero_grad()
        scaler.scale(_loss(model, step)).backward()
        scaler.step(optimizer)
        scaler.update()
    params = copy.deepcopy(list(model.parameters()))
    history = model[0].amax_history.clone()
    optimizer.zero_grad()
    scaler.scale(_loss(model, 3, poison=True)).backward()
    scaler.step(optimizer)
    scaler.update()
    assert scaler.get_scale() == 2.0**11  # the step was skipped and the scale backed off
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params, strict=True))
    assert torch.equal(model[0].amax_history[0], history[0])  # the inf amax was not pushed
    assert torch.isfinite(model[0].amax_history).all()
    optimizer.zero_grad()
    scaler.scale(_loss(model, 4)).backward()
    scaler.step(optimizer)
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), params, strict=True))


def test_torch_compile_matches_eager_with_delayed_scaling() -> None:
    model = _mlp("delayed")
    eager = copy.deepcopy(model)
    compiled = torch.compile(model)
    for step in range(3):
        loss = _loss(compiled, step)
        loss.backward()
        expected = _loss(eager, step)
        expected.backward()
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    for (name, a), b in zip(model.state_dict().items(), eager.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)  # the history advanced too
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
