"""fp8 rowwise against torchao's rowwise on torch's own ``_scaled_mm`` (emulate=False), not its emulation.

Two differences were measured between them (1-5% relative on a GPT): under bf16 autocast mixprec rounded
an fp32 master weight to bf16 before its fp8 cast (two roundings where torchao has one): fixed, the three
GEMMs are now bitwise torchao's. In fp32, torchao's rowwise GEMMs write bf16 and cast that up (its
workaround for ``_scaled_mm`` having no fp32 rowwise output, pytorch#156771); mixprec keeps the fp32
output, so its results rounded to bf16 are torchao's bitwise (docs/guide/float8.md says so).

torchao casts the input to the autocast dtype only where ``torch.is_autocast_enabled()`` (CUDA's state)
is on, so on a CPU its CUDA behaviour is reproduced by handing it the input in bf16 outside the region.
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
    ao = pytest.importorskip("torchao.float8")

RECIPES = ["tensorwise", "rowwise", "rowwise_with_gw_hp"]
BF16 = torch.bfloat16


def _models(name: str, *layers: nn.Module) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    base = (
        nn.Sequential(*layers)
        if layers
        else nn.Sequential(nn.Linear(256, 192), nn.GELU(), nn.Linear(192, 128))
    )
    theirs = ao.convert_to_float8_training(
        copy.deepcopy(base), config=ao.Float8LinearConfig.from_recipe_name(name)
    )
    ours = convert_to_float8_training(copy.deepcopy(base), config=Float8Config.from_recipe_name(name))
    return theirs, ours


def _grads(model: nn.Module, x: torch.Tensor, grad: torch.Tensor, autocast: bool) -> list[torch.Tensor]:
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=BF16, enabled=autocast):
        out = model(x)
    out.backward(grad)
    weights = [m.weight.grad for m in model.modules() if isinstance(m, nn.Linear)]
    return [out.detach(), x.grad, *weights]


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("name", RECIPES)
def test_under_bf16_autocast_every_gemm_is_torchaos_bitwise(name: str) -> None:
    theirs, ours = _models(name)
    x = torch.randn(4, 32, 256)
    grad = torch.randn(4, 32, 128, dtype=BF16)
    expected = _grads(theirs, x.to(BF16), grad, autocast=False)  # torchao's CUDA autocast path
    got = _grads(ours, x, grad, autocast=True)
    for label, a, b in zip(["out", "grad_x", "grad_w0", "grad_w1"], got, expected, strict=True):
        assert torch.equal(a, b.to(a.dtype)), label  # grad_x: fp32 for our fp32 input, the same values


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("name", ["rowwise", "rowwise_with_gw_hp"])
def test_in_fp32_torchao_rounds_the_rowwise_output_to_bf16_and_mixprec_keeps_fp32(name: str) -> None:
    theirs, ours = _models(name, nn.Linear(256, 192, bias=False))  # no bias: it is added after the GEMM
    x, grad = torch.randn(64, 256), torch.randn(64, 192)
    expected, got = _grads(theirs, x, grad, autocast=False), _grads(ours, x, grad, autocast=False)
    gemms = ["out", "grad_x", "grad_w"]
    rounded_by_torchao = gemms if name == "rowwise" else gemms[:2]  # gw_hp: its wgrad is a plain fp32 mm
    for label, a, b in zip(gemms, got, expected, strict=True):
        assert a.dtype == b.dtype == torch.float32, label
        if label in rounded_by_torchao:
            assert torch.equal(b, b.to(BF16).float()), label  # torchao's values are bf16 values
            assert not torch.equal(a, a.to(BF16).float()), label  # ours carry fp32 precision
            assert torch.equal(a.to(BF16).float(), b), label
        else:
            assert torch.equal(a, b), label
