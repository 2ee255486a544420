"""Formats derived from bit layouts agree with torch.finfo; the scale helpers answer correctly."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mixprec import formats

WITH_DTYPE = [f for f in formats.FORMATS.values() if f.dtype is not None]
FLOAT8 = [f for f in WITH_DTYPE if f.bits == 8]
DTYPE_OF_BITS = {8: torch.uint8, 16: torch.int16, 32: torch.int32}


# torch.finfo(torch.float8_e5m2fnuz).eps is 0.125 (c10 encodes it as 0x34, with bias 16 that is 2**-3), but
# the value after 1.0 in that dtype is 1.25 as torch itself decodes it: the gap is checked on decoded codes.
FINFO_EPS_DIFFERS = {"fp8_e5m2fnuz"}


def _decoded(fmt: formats.Format) -> torch.Tensor:
    """Every value of an 8-bit ``fmt``, decoded by torch from the 256 codes (float32)."""
    return torch.arange(256, dtype=torch.uint8).view(fmt.dtype).to(torch.float32)


@pytest.mark.parametrize("fmt", WITH_DTYPE, ids=str)
def test_matches_torch_finfo(fmt: formats.Format) -> None:
    info = torch.finfo(fmt.dtype)
    assert fmt.max == info.max
    assert fmt.smallest_normal == info.tiny == info.smallest_normal
    assert fmt.bits == info.bits
    one_up = torch.tensor(1.0, dtype=fmt.dtype).view(DTYPE_OF_BITS[fmt.bits]) + 1
    assert fmt.eps == one_up.view(fmt.dtype).item() - 1.0  # the gap after 1.0, decoded by torch
    if fmt.name in FINFO_EPS_DIFFERS:
        assert info.eps in (fmt.eps / 2, fmt.eps)  # the latter once torch corrects its constant
    else:
        assert fmt.eps == info.eps
        assert fmt.smallest_subnormal == info.smallest_normal * info.eps


@pytest.mark.parametrize("fmt", FLOAT8, ids=str)
def test_every_property_matches_the_256_codes_torch_decodes(fmt: formats.Format) -> None:
    values = _decoded(fmt)
    finite = values[torch.isfinite(values)]
    positive = finite[finite > 0]
    assert fmt.max == finite.max().item() == -finite.min().item()
    assert fmt.smallest_subnormal == positive.min().item()
    normal = positive[positive >= fmt.smallest_normal]
    assert (positive[positive < fmt.smallest_normal] / fmt.smallest_subnormal).frac().eq(0).all()
    # Normal binades: every non-zero exponent, less the all-ones one where it holds inf; e4m3fn's nan
    # takes one code of the last binade.
    binades = 2**fmt.exponent_bits - (2 if fmt.has_inf else 1)
    nan_in_last = not (fmt.fnuz or fmt.has_inf)
    assert normal.numel() == binades * 2**fmt.mantissa_bits - nan_in_last
    assert fmt.has_inf == bool(torch.isinf(values).any())
    negative_zero = (values == 0) & torch.signbit(values)
    assert fmt.has_negative_zero == bool(negative_zero.any())
    if fmt.fnuz:
        assert torch.isnan(values).nonzero().flatten().tolist() == [0x80]
        assert fmt.bias == 2 ** (fmt.exponent_bits - 1)
    else:
        assert fmt.bias == 2 ** (fmt.exponent_bits - 1) - 1


def test_fnuz_needs_has_inf_false_and_a_bool() -> None:
    with pytest.raises(ValueError, match="fnuz format has no inf.*'x'"):
        formats.Format("x", 4, 3, fnuz=True)
    with pytest.raises(TypeError, match="fnuz must be a bool, got 1"):
        formats.Format("x", 4, 3, has_inf=False, fnuz=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("fmt", WITH_DTYPE, ids=str)
def test_round_trip_through_torch_agrees_with_under_and_overflow(fmt: formats.Format) -> None:
    values = torch.tensor([fmt.max, fmt.smallest_normal, fmt.smallest_subnormal, fmt.smallest_subnormal / 4])
    cast = values.to(fmt.dtype).float()
    assert cast[0].item() == fmt.max and not fmt.overflows(fmt.max)
    assert cast[1].item() == fmt.smallest_normal and not fmt.underflows(fmt.smallest_normal)
    assert cast[2].item() == fmt.smallest_subnormal and fmt.is_subnormal(fmt.smallest_subnormal)
    assert cast[3].item() == 0.0 and fmt.underflows(fmt.smallest_subnormal / 4)
    if fmt.has_inf:
        assert torch.isinf(torch.tensor(fmt.max * 4).to(fmt.dtype)).item()
    assert fmt.overflows(fmt.max * 4) and fmt.overflows(math.inf) and fmt.overflows(math.nan)


def test_the_seeds_figures() -> None:
    assert formats.FP16.max == 65504.0
    assert formats.FP16.eps > 1e-4  # the fp16 spacing at 1.0 exceeds the update: why 1 + 0.0001 == 1
    assert torch.tensor(1.0, dtype=torch.float16) + 1e-4 == 1.0
    assert formats.FP16.underflows(1e-8) and not formats.FP16.underflows(1e-8, scale=2.0**16)
    assert formats.FP8_E4M3FN.max == 448.0 and not formats.FP8_E4M3FN.has_inf
    assert formats.FP8_E5M2.max == 57344.0


def test_lookup_by_name_dtype_and_errors() -> None:
    assert formats.get("half") is formats.FP16
    assert formats.get(torch.bfloat16) is formats.BF16
    assert formats.get("e4m3") is formats.FP8_E4M3FN
    for name in ("fp8_e4m3fnuz", "e4m3fnuz", "float8_e4m3fnuz", "torch.float8_e4m3fnuz", "E4M3FNUZ"):
        assert formats.get(name) is formats.FP8_E4M3FNUZ
    for name in ("fp8_e5m2fnuz", "e5m2fnuz", "float8_e5m2fnuz"):
        assert formats.get(name) is formats.FP8_E5M2FNUZ
    assert formats.get(torch.float8_e4m3fnuz) is formats.FP8_E4M3FNUZ
    assert formats.get(torch.float8_e5m2fnuz) is formats.FP8_E5M2FNUZ
    assert (formats.FP8_E4M3FNUZ.max, formats.FP8_E5M2FNUZ.max) == (240.0, 57344.0)
    with pytest.raises(ValueError, match="did you mean 'fp16'"):
        formats.get("fp61")
    with pytest.raises(ValueError, match="no mixprec format for dtype torch.int8"):
        formats.get(torch.int8)
    with pytest.raises(TypeError):
        formats.get(3)  # type: ignore[arg-type]


@given(st.floats(min_value=1e-30, max_value=1e30), st.sampled_from(["fp16", "bf16", "e4m3", "e5m2"]))
def test_max_safe_scale_is_the_largest_safe_power_of_two(amax: float, name: str) -> None:
    fmt = formats.get(name)
    scale = formats.max_safe_scale(amax, fmt, margin=2.0)
    assert math.log2(scale).is_integer()
    assert amax * scale * 2.0 <= fmt.max
    assert amax * scale * 2 * 2.0 > fmt.max


def test_max_safe_scale_edges() -> None:
    assert formats.max_safe_scale(0.0) == math.inf
    with pytest.raises(ValueError, match="amax must be finite"):
        formats.max_safe_scale(math.inf)
    with pytest.raises(ValueError, match="margin"):
        formats.max_safe_scale(1.0, margin=0.5)
