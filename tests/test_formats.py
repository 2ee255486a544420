"""Formats derived from bit layouts agree with torch.finfo; the scale helpers answer correctly."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mixprec import formats

WITH_DTYPE = [f for f in formats.FORMATS.values() if f.dtype is not None]


@pytest.mark.parametrize("fmt", WITH_DTYPE, ids=str)
def test_matches_torch_finfo(fmt: formats.Format) -> None:
    info = torch.finfo(fmt.dtype)
    assert fmt.max == info.max
    assert fmt.smallest_normal == info.tiny
    assert fmt.eps == info.eps
    assert fmt.smallest_subnormal == info.smallest_normal * info.eps
    assert fmt.bits == info.bits


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
