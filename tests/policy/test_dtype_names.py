"""Every dtype argument takes the names ``Policy.parse`` takes ("bf16", "fp16", "half", ...), read by the one
converter ``mixprec.formats.as_dtype``; an unknown name is a ValueError listing the accepted ones."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mixprec
from mixprec import custom_bwd, custom_fwd
from mixprec.formats import _DTYPE_NAMES, as_dtype
from mixprec.inspect import find_nonfinite
from mixprec.optim import CompensatedOptimizer
from mixprec.plan.cost import MeasuredCost
from mixprec.policy import Policy


@pytest.mark.parametrize("name", sorted(_DTYPE_NAMES))
def test_autocast_takes_every_name_policy_parse_takes(name: str) -> None:
    expected = Policy.parse(f"c={name}").compute_dtype
    with mixprec.autocast("cpu", dtype=name) as region:
        assert region.fast_dtype == expected
        assert torch.get_autocast_dtype("cpu") == expected
        out = nn.Linear(4, 4)(torch.randn(2, 4))
    assert out.dtype == expected  # the region runs in the dtype the name gives


def test_the_user_report_autocast_bf16_is_torch_autocast_bf16() -> None:
    x, layer = torch.randn(3, 8), nn.Linear(8, 8)
    with mixprec.autocast("cpu", dtype="bf16"):
        ours = layer(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        theirs = layer(x)
    assert ours.dtype == torch.bfloat16 and torch.equal(ours, theirs)


def test_an_unknown_name_lists_the_accepted_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown dtype 'bf17' for dtype \(did you mean 'bf16'.*'half'"):
        mixprec.autocast("cpu", dtype="bf17")
    with pytest.raises(TypeError, match=r"dtype must be a torch.dtype or a dtype name.*got int: 16"):
        mixprec.autocast("cpu", dtype=16)  # type: ignore[arg-type]
    assert as_dtype(" Torch.BFloat16 ") == torch.bfloat16  # case, blanks and the torch. prefix ignored
    assert as_dtype(torch.float64) is torch.float64  # a dtype passes through; callers check their range


def test_find_nonfinite_takes_a_dtype_name() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4))
    with torch.no_grad():
        model[0].weight.fill_(3e4)  # 4 * 3e4 * 1 overflows fp16 (max 65504), not bf16
    x = torch.ones(1, 4)
    report = find_nonfinite(model, x, dtype="fp16", device_type="cpu")
    assert report is not None and report.dtype == torch.float16
    assert report == find_nonfinite(model, x, dtype=torch.float16, device_type="cpu")
    assert find_nonfinite(model, x, dtype="bf16", device_type="cpu") is None
    with pytest.raises(ValueError, match=r"unknown dtype 'fp61'.*accepted"):
        find_nonfinite(model, x, dtype="fp61", device_type="cpu")


def test_custom_fwd_cast_inputs_takes_a_name() -> None:
    class Double(torch.autograd.Function):
        @staticmethod
        @custom_fwd(device_type="cpu", cast_inputs="fp32")
        def forward(ctx, x):
            ctx.dtype = x.dtype
            return x * 2

        @staticmethod
        @custom_bwd(device_type="cpu")
        def backward(ctx, grad):
            return grad * 2

    x = torch.randn(3, dtype=torch.bfloat16)
    with mixprec.autocast("cpu", dtype="bf16"):
        out = Double.apply(x)
    assert out.dtype == torch.float32
    with pytest.raises(ValueError, match="unknown dtype 'fp3' for cast_inputs"):
        custom_fwd(device_type="cpu", cast_inputs="fp3")


def test_compensated_state_dtype_and_policy_resolve_take_names() -> None:
    params = nn.Linear(4, 4).to(torch.bfloat16).parameters()
    assert CompensatedOptimizer(torch.optim.AdamW(params), state_dtype="fp32").state_dtype is torch.float32
    inner = torch.optim.AdamW(nn.Linear(4, 4).to(torch.bfloat16).parameters())
    with pytest.raises(ValueError, match="unknown dtype 'fp31' for state_dtype"):
        CompensatedOptimizer(inner, state_dtype="fp31")
    assert not hasattr(inner, "_mixprec_wrapped") and inner.state == {}  # refused before anything changed
    assert Policy().resolve("cpu", "half").compute_dtype == torch.float16
    assert MeasuredCost("cpu", dtype="bf16").dtype == torch.bfloat16


def test_initialize_takes_every_half_name() -> None:
    for name in ("bf16", "BFloat16", "fp16", "half", "f16"):
        model = nn.Sequential(nn.Linear(4, 4))
        model, _ = mixprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2", dtype=name)
        assert model[0].weight.dtype == as_dtype(name)
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="unknown dtype 'bf61'"):
        mixprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2", dtype="bf61")
    assert model[0].weight.dtype == torch.float32  # a refused call changes nothing


def test_the_fp8_and_lowbit_layers_take_a_dtype_name_as_their_factory_dtype() -> None:
    from mixprec.float8 import Float8Linear
    from mixprec.lowbit import LowbitLinear

    assert Float8Linear(8, 16, dtype="bf16").weight.dtype == torch.bfloat16
    assert LowbitLinear(8, 16, dtype="half").weight.dtype == torch.float16
    with pytest.raises(ValueError, match="unknown dtype 'bf6' for dtype"):
        LowbitLinear(8, 16, dtype="bf6")
