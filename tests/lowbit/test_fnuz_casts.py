"""AMD MI300's fnuz float8 (e4m3fnuz, e5m2fnuz): every cast mixprec makes is bitwise torch's own on the CPU.

The oracle is torch's ``.to(torch.float8_e4m3fnuz)`` (and e5m2fnuz) of the same float32 values in the same
run, compared as bytes: random values across every binade, values near and beyond ``±max``, the format's
subnormals and the float32 ones, ties, ±0.0 and nan / ±inf. torch's fnuz cast turns a finite value beyond
the range into nan (torch >= 2.12 saturates e4m3fn in eager mode, not the fnuz dtypes), mixprec's casts
saturate: they are compared with torch's ``x.clamp(-max, max).to(dtype)``. torchao's float8 scaling
(``tensor_to_scale``), which takes the fnuz dtypes, is the oracle for the scaled casts.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from mixprec import formats, lowbit
from mixprec.lowbit import quantize
from mixprec.lowbit.history import amax_to_scale, to_float8

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    ao_utils = pytest.importorskip("torchao.float8.float8_utils")
    from torchao.float8.config import ScalingGranularity

FNUZ = [formats.FP8_E4M3FNUZ, formats.FP8_E5M2FNUZ]
LOWBIT_ELEMENT = {"fp8_e4m3fnuz": "fnuz", "fp8_e5m2fnuz": "e5m2fnuz"}


def _values(fmt: formats.Format, seed: int = 0) -> torch.Tensor:
    """float32 values that exercise every rounding case of ``fmt`` (see the module doc)."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = -(fmt.bias + fmt.mantissa_bits + 3), int(torch.log2(torch.tensor(fmt.max)).item()) + 3
    exponents = torch.randint(lo, hi, (20000,), generator=g).to(torch.float32)
    mantissas = 1 + torch.rand(20000, generator=g)
    signs = torch.where(torch.rand(20000, generator=g) < 0.5, -1.0, 1.0)
    codes = torch.arange(256, dtype=torch.uint8).view(fmt.dtype).to(torch.float32)
    grid = codes[torch.isfinite(codes)]
    midpoints = (grid.sort().values[1:] + grid.sort().values[:-1]) / 2  # ties: nearest-even decides
    edges = torch.tensor([fmt.max, fmt.max * (1 + fmt.eps / 4), fmt.max * (1 + fmt.eps / 2), fmt.max * 1.5])
    special = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-45, -1e-45, 3e38, 1e-30])
    subnormal = torch.arange(0, 2**fmt.mantissa_bits * 4) * fmt.smallest_subnormal / 4
    near = torch.cat([edges, -edges, torch.nextafter(edges, torch.zeros(()))])
    return torch.cat([signs * mantissas * torch.exp2(exponents), grid, midpoints, near, special, subnormal])


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.mark.parametrize("fmt", FNUZ, ids=str)
def test_the_saturating_cast_is_torchs_clamp_then_cast_bitwise(fmt: formats.Format) -> None:
    x = _values(fmt)
    ours = to_float8(x, torch.ones((), dtype=torch.float32), fmt)
    assert ours.dtype == fmt.dtype
    assert torch.equal(_bytes(ours), _bytes(x.clamp(-fmt.max, fmt.max).to(fmt.dtype)))
    inside = x.abs() <= fmt.max  # within the range the clamp changes nothing: torch's plain cast
    assert torch.equal(_bytes(ours[inside]), _bytes(x[inside].to(fmt.dtype)))
    beyond = torch.isfinite(x) & (x.abs() > fmt.max * (1 + fmt.eps / 2))
    assert torch.isnan(x[beyond].to(fmt.dtype).float()).all()  # why mixprec clamps first
    assert (ours[beyond].float().abs() == fmt.max).all()


@pytest.mark.parametrize("fmt", FNUZ, ids=str)
def test_zero_nan_and_inf_take_torchs_fnuz_codes(fmt: formats.Format) -> None:
    special = torch.tensor([-0.0, 0.0, float("nan"), float("inf"), -float("inf")])
    torch_bytes = _bytes(special.to(fmt.dtype)).tolist()
    assert torch_bytes == [0, 0, 0x80, 0x80, 0x80]  # no -0, one nan, no inf: the fnuz layout
    ours = _bytes(to_float8(special, torch.ones(()), fmt)).tolist()
    assert ours == [0, 0, 0x80, 0x7F, 0xFF]  # ±inf saturate to ±max, as torch's clamp-then-cast does
    assert ours == _bytes(special.clamp(-fmt.max, fmt.max).to(fmt.dtype)).tolist()


@pytest.mark.parametrize("fmt", FNUZ, ids=str)
def test_round_to_element_is_torchs_fnuz_rounding(fmt: formats.Format) -> None:
    x = _values(fmt)
    x = x[torch.isfinite(x)].clamp(-fmt.max, fmt.max)
    ours = lowbit.round_to_element(x, fmt)
    assert torch.equal(_bytes(ours.to(fmt.dtype)), _bytes(x.to(fmt.dtype)))
    assert torch.equal(ours, x.to(fmt.dtype).to(torch.float32))
    g = torch.Generator().manual_seed(1)
    stochastic = lowbit.round_to_element(x, fmt, stochastic=True, generator=g)
    assert torch.equal(stochastic.to(fmt.dtype).to(torch.float32), stochastic)  # on fmt's grid


@pytest.mark.parametrize("pow2", [False, True], ids=["fp32_scale", "pow2_scale"])
@pytest.mark.parametrize("fmt", FNUZ, ids=str)
def test_tensorwise_quantize_is_torchaos_scaled_cast_bitwise(fmt: formats.Format, pow2: bool) -> None:
    x = _values(fmt)
    x = x[torch.isfinite(x)][: 64 * 256].reshape(64, -1)
    name = f"fp8_tensorwise_{LOWBIT_ELEMENT[fmt.name]}" + ("_pow2" if pow2 else "")
    scale = ao_utils.tensor_to_scale(x, fmt.dtype, round_scales_to_power_of_2=pow2)
    q = quantize(x, name)
    assert q.data.dtype == fmt.dtype and lowbit.FORMATS[name].elem is fmt
    assert torch.equal(q.scale.reshape(()), scale)
    assert torch.equal(_bytes(q.data), _bytes(ao_utils.to_fp8_saturated(x * scale, fmt.dtype)))
    assert torch.equal(q.dequantize(), q.data.to(torch.float32) / scale)


@pytest.mark.parametrize("axis", [-1, 0])
@pytest.mark.parametrize("fmt", FNUZ, ids=str)
def test_rowwise_quantize_is_torchaos_axiswise_cast_bitwise(fmt: formats.Format, axis: int) -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(48, 96, generator=g) * torch.logspace(-6, 6, 96)
    x[5] = 0.0
    for suffix, pow2 in (("", True), ("_fp32", False)):
        name = f"fp8_rowwise_{LOWBIT_ELEMENT[fmt.name]}{suffix}"
        scale = ao_utils.tensor_to_scale(
            x, fmt.dtype, scaling_granularity=ScalingGranularity.AXISWISE, axiswise_dim=axis,
            round_scales_to_power_of_2=pow2,
        )  # fmt: skip
        data = ao_utils.to_fp8_saturated(x * scale, fmt.dtype)
        q = quantize(x, name, axis=axis)
        assert torch.equal(_bytes(q.data), _bytes(data if axis == -1 else data.t())), name
        assert torch.equal(q.scale.reshape(-1), scale.reshape(-1)), name


@pytest.mark.parametrize("fmt", FNUZ, ids=str)
def test_the_scale_is_torchaos_and_finite_for_small_amax_in_fp16(fmt: formats.Format) -> None:
    # torchao's test_small_amax_float16 (test/float8/test_base.py), on mixprec's own scale function.
    target = fmt.max / (torch.finfo(torch.float16).max + 1e-12)
    x = torch.tensor([target], dtype=torch.float16)
    ours = amax_to_scale(x.abs().max().to(torch.float32), fmt)
    assert torch.isfinite(ours) and torch.equal(ours, ao_utils.tensor_to_scale(x, fmt.dtype))


def test_lowbit_names_and_a_user_fnuz_format() -> None:
    assert lowbit.formats.ELEMENTS["e4m3fnuz"] is formats.FP8_E4M3FNUZ
    assert lowbit.formats.ELEMENTS["e5m2fnuz"] is formats.FP8_E5M2FNUZ
    fmt = lowbit.LowbitFormat("mx_fnuz", "e4m3fnuz", "e8m0", (1, 32), lowbit.ScaleRounding.FLOOR)
    x = torch.randn(4, 64)
    q = quantize(x, fmt)
    assert q.data.dtype == torch.float8_e4m3fnuz
    assert (q.values().abs() <= 240).all() and (q.dequantize() - x).abs().max() < 0.1 * x.abs().max()
    with pytest.raises(ValueError, match="element must be one of .*'e4m3fnuz'.*got 'e4m3fnu'"):
        lowbit.LowbitFormat("bad", "e4m3fnu", "fp32", (-1, -1))
