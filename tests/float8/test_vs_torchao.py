"""Differential tests: mixprec.float8 against torchao's emulated fp8 linear (the oracle), fp32 as reference.

The bound is the issue's: ``‖mixprec - torchao‖ <= 0.01 · ‖torchao - fp32‖`` for the output, the input
gradient and the weight gradient, in the Frobenius (elementwise L2) norm of the whole tensor, so mixprec
differs from torchao by at most 1% of the fp8 error itself.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from mixprec.float8 import Float8Config, convert_to_float8_training

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torchao_float8 = pytest.importorskip("torchao.float8")

CASES = [  # input shape, (in, out), bias
    ((32, 64), (64, 48), True),
    ((16, 32), (32, 16), False),
    ((2, 16, 32), (32, 64), False),
    ((3, 5, 40), (40, 24), True),
    ((2, 3, 4, 24), (24, 8), True),
]


def _run(model: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:
    x = x.clone().requires_grad_()
    out = model(x)
    out.backward(grad)
    weight = next(m for m in model.modules() if isinstance(m, nn.Linear)).weight
    return [out.detach(), x.grad, weight.grad]


def _ratios(base: nn.Module, mixprec_model: nn.Module, x: torch.Tensor) -> list[float]:
    ao = torchao_float8.convert_to_float8_training(
        copy.deepcopy(base), config=torchao_float8.Float8LinearConfig(emulate=True)
    )
    grad = torch.randn(*x.shape[:-1], base[0].out_features, generator=torch.Generator().manual_seed(7))
    ref, oracle, ours = (_run(m, x, grad) for m in (base, ao, mixprec_model))
    ratios = []
    for r, o, m in zip(ref, oracle, ours, strict=True):
        assert m.dtype == o.dtype and m.shape == o.shape
        fp8_error = (o - r).norm()
        assert fp8_error > 0  # fp8 really is lossy here, so the bound is not vacuous
        ratios.append(float((m - o).norm() / fp8_error))
    return ratios


@pytest.mark.parametrize("emulate", [False, True], ids=["scaled_mm", "emulate"])
@pytest.mark.parametrize(("shape", "features", "bias"), CASES)
def test_forward_and_backward_match_torchao(shape, features, bias, emulate) -> None:
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(*features, bias=bias))
    ours = convert_to_float8_training(copy.deepcopy(base), config=Float8Config(emulate=emulate))
    x = torch.randn(*shape) * 3.0
    for name, ratio in zip(("output", "grad_input", "grad_weight"), _ratios(base, ours, x), strict=True):
        assert ratio <= 0.01, f"{name}: |mixprec - torchao| = {ratio:.3g} x |torchao - fp32|"


def test_delayed_first_step_is_the_dynamic_recipe() -> None:
    # An empty history falls back to the tensor's own amax: step one of delayed equals torchao too.
    torch.manual_seed(1)
    base = nn.Sequential(nn.Linear(32, 16))
    ours = convert_to_float8_training(copy.deepcopy(base), config=Float8Config(scaling="delayed"))
    assert max(_ratios(base, ours, torch.randn(4, 8, 32))) <= 0.01


def test_bf16_model_matches_torchao() -> None:
    torch.manual_seed(2)
    base = nn.Sequential(nn.Linear(48, 32)).to(torch.bfloat16)
    ours = convert_to_float8_training(copy.deepcopy(base))
    x = torch.randn(6, 48).to(torch.bfloat16)
    grad = torch.randn(6, 32).to(torch.bfloat16)
    ao = torchao_float8.convert_to_float8_training(
        copy.deepcopy(base), config=torchao_float8.Float8LinearConfig(emulate=True)
    )
    for o, m in zip(_run(ao, x, grad), _run(ours, x, grad), strict=True):
        assert m.dtype == torch.bfloat16
        torch.testing.assert_close(m, o, rtol=0.0079, atol=1e-6)  # one bf16 ulp: rounding order only
