"""Idioms library code writes for torch.autocast, each inside a mixprec region.

The expected values are written without any autocast (what torch.autocast gives, spelled out), so the
tests hold even if the engine registers process-wide kernels that torch.autocast would then run. Where
the spelled-out value is a claim about torch, the test checks it against torch.autocast too (only
when torch.autocast in this process is torch's own).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from tests.models.zoo import DTYPES, oracle_in_subprocess

DTYPE_PARAMS = [pytest.param(d, id=n) for n, d in DTYPES.items()]


def _mats(n: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(8, 8, generator=g) for _ in range(n)]


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
def test_torch_autocast_disabled_island_keeps_fp32(dtype: torch.dtype) -> None:
    a, b, _ = _mats()
    with mixprec.autocast("cpu", dtype=dtype):
        with torch.autocast("cpu", enabled=False):
            inside = torch.mm(a, b)
            assert not torch.is_autocast_enabled("cpu")
        after = torch.mm(a, b)
    assert inside.dtype == torch.float32
    assert torch.equal(inside, torch.mm(a, b))
    assert after.dtype == dtype
    assert torch.equal(after, torch.mm(a.to(dtype), b.to(dtype)))


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
def test_mixprec_disabled_island_inside_torch_autocast_keeps_fp32(dtype: torch.dtype) -> None:
    # Drop-in both ways: mixprec.autocast(enabled=False) disables torch.autocast as torch's own would.
    a, b, _ = _mats()
    with torch.autocast("cpu", dtype=dtype), mixprec.autocast("cpu", enabled=False):
        inside = torch.mm(a, b)
    assert inside.dtype == torch.float32
    assert torch.equal(inside, torch.mm(a, b))


class Fp32Matmul(torch.autograd.Function):
    """``x @ w.T`` in fp32 whatever the region: the apex/Megatron custom-op idiom."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        return grad @ w, grad.t() @ x


def _custom_fwd_in_region(region: object) -> list[torch.Tensor]:
    torch.manual_seed(0)
    lin, w = nn.Linear(8, 8), nn.Parameter(torch.randn(4, 8))
    x = _mats(1)[0]
    with region:
        y = Fp32Matmul.apply(lin(x), w)
    y.sum().backward()
    return [y.detach(), lin.weight.grad, lin.bias.grad, w.grad]


def _spelled_out(dtype: torch.dtype) -> list[torch.Tensor]:
    torch.manual_seed(0)
    lin, w = nn.Linear(8, 8), nn.Parameter(torch.randn(4, 8))
    x = _mats(1)[0]
    h = F.linear(x.to(dtype), lin.weight.to(dtype), lin.bias.to(dtype))
    y = Fp32Matmul.apply(h.float(), w)
    y.sum().backward()
    return [y.detach(), lin.weight.grad, lin.bias.grad, w.grad]


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
def test_torch_custom_fwd_casts_inputs_and_custom_bwd_follows(dtype: torch.dtype) -> None:
    expected = _spelled_out(dtype)
    if not oracle_in_subprocess():
        for e, t in zip(expected, _custom_fwd_in_region(torch.autocast("cpu", dtype=dtype)), strict=True):
            assert e.dtype == t.dtype and torch.equal(e, t), "the spelled-out oracle is not torch's"
    actual = _custom_fwd_in_region(mixprec.autocast("cpu", dtype=dtype))
    assert actual[0].dtype == torch.float32
    for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
        assert a.dtype == e.dtype, f"tensor {i}"
        assert torch.equal(a, e), f"tensor {i}"


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
def test_torch_autocast_state_queries_inside_a_region(dtype: torch.dtype) -> None:
    before = torch.get_autocast_dtype("cpu")
    with mixprec.autocast("cpu", dtype=dtype):
        assert torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") == dtype
        with mixprec.autocast("cpu", enabled=False):
            assert not torch.is_autocast_enabled("cpu")
        assert torch.is_autocast_enabled("cpu")
    assert not torch.is_autocast_enabled("cpu")
    assert torch.get_autocast_dtype("cpu") == before


def test_nested_regions_report_the_inner_dtype() -> None:
    with mixprec.autocast("cpu", dtype=torch.bfloat16):
        with mixprec.autocast("cpu", dtype=torch.float16):
            assert torch.get_autocast_dtype("cpu") == torch.float16
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16


def test_out_argument_is_written_and_returned_as_torch_does() -> None:
    # torch.autocast does not autocast `out=` calls: they run in the inputs' dtype into `out`.
    a, b, _ = _mats()
    out = torch.full((8, 8), float("nan"))
    with mixprec.autocast("cpu", dtype=torch.bfloat16):
        result = torch.mm(a, b, out=out)
    assert result is out
    assert torch.equal(out, torch.mm(a, b))


def test_disabled_region_accepts_any_dtype() -> None:
    # The `autocast(enabled=use_amp, dtype=run_dtype)` idiom: torch accepts any dtype when disabled.
    a, b, _ = _mats()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch does not warn either
        with mixprec.autocast("cpu", dtype=torch.float64, enabled=False):
            y = torch.mm(a, b)
            assert not torch.is_autocast_enabled("cpu")
    assert y.dtype == torch.float32 and torch.equal(y, torch.mm(a, b))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_region_without_cuda_warns_like_torch() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.autocast("cuda")
    category = caught[0].category
    a, b, _ = _mats()
    with pytest.warns(category, match="CUDA"):
        region = mixprec.autocast("cuda")
    with region:
        y = torch.mm(a, b)
    assert y.dtype == torch.float32
