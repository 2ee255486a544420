"""A wrapped optimizer edited after wrapping behaves as the plain torch optimizer, on every path.

A new parameter given to ``add_param_group`` or appended to ``param_groups[0]["params"]`` by hand, after
some steps, is stepped with its group's options; under O2 it gets exactly one fp32 master; the parameters
that were there evolve exactly as in the same run without the edit (under stochastic rounding the new
tensor takes random bits from the same generator, so there they differ by rounding). Where the path
steps with torch's own Adam (O1, O2, bf16-true and the bare wrapper), torch's Adam on the same tensor is
the oracle, bitwise.
Refused edits are battery cases (``cases_edits.py``).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from .paths import PATHS, Path, prepared

TORCH_ADAM = {"O1", "O2", "O2-fp16", "bf16-true", "MixedPrecisionOptimizer"}
MASTERS = {"O2", "O2-fp16", "MixedPrecisionOptimizer"}


def _run(path: Path, how: str | None, steps: int = 3) -> tuple[list[torch.Tensor], nn.Parameter, object]:
    ctx = prepared(path, steps=2)
    net, opt, x, y = ctx["model"], ctx["opt"], ctx["x"], ctx["y"]
    extra = nn.Parameter(torch.linspace(-0.2, 0.2, 5).to(path.grad_dtype))
    if how == "add_param_group":
        opt.add_param_group({"params": [extra], "lr": 0.05})
    elif how == "by hand":
        opt.param_groups[0]["params"].append(extra)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(steps):
            opt.zero_grad()
            extra.grad = None
            loss = (net(x).float() - y).pow(2).mean() + extra.float().pow(2).sum()
            opt.backward(loss)
            opt.step()
    return [p.detach().clone() for p in net.parameters()], extra, opt


def _oracle(path: Path, start: torch.Tensor, lr: float, steps: int = 3) -> torch.Tensor:
    """torch's Adam on the tensor the path steps: an fp32 master, or the parameter itself."""
    dtype = torch.float32 if path.name in MASTERS else path.grad_dtype
    weight = nn.Parameter(start.to(dtype))
    opt = torch.optim.Adam([weight], lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        weight.grad = (2 * weight.detach().to(path.grad_dtype).float()).to(path.grad_dtype).to(dtype)
        opt.step()
    return weight.detach()


@pytest.mark.parametrize("how", ["add_param_group", "by hand"])
@pytest.mark.parametrize("path", [pytest.param(p, id=p.name) for p in PATHS])
def test_a_parameter_added_after_wrapping_is_stepped_as_torch_steps_it(path, how):
    start = torch.linspace(-0.2, 0.2, 5).to(path.grad_dtype)
    baseline, _, _ = _run(path, None)
    params, extra, opt = _run(path, how)
    if "stochastic" not in path.name:  # stochastic rounding draws for the new tensor too: another stream
        assert all(torch.equal(a, b) for a, b in zip(baseline, params, strict=True)), "the others changed"
    assert not torch.equal(extra.detach(), start), "not stepped"
    lr = 0.05 if how == "add_param_group" else 1e-2
    if path.name in MASTERS:
        masters = [m for p, m in zip(opt.model_params, opt.master_params, strict=True) if p is extra]
        assert len(masters) == 1 and len({id(m) for m in opt.master_params}) == len(opt.master_params)
        assert torch.equal(extra.detach(), masters[0].detach().to(extra.dtype))
        stepped = masters[0].detach()
    else:
        stepped = extra.detach()
    if path.name in TORCH_ADAM:
        assert torch.equal(stepped, _oracle(path, start, lr))
    held = [p for g in opt.param_groups for p in g["params"]]
    assert len({id(p) for p in held}) == len(held)
