"""The fused quantizers' float32 scale division (``F32_DIV``) gives the float64 division's bits.

``_triton_kernels._scale_of`` computes ``ELEM_MAX / max(amax, EPS)`` as one float32 division where that
holds fewer registers. The premise (double rounding through float64 is innocuous for division) is checked
on its own with numpy's correctly rounded float32 division, then both kernel variants are run under
Triton's interpreter on amaxes at the edges (zero, around EPS, subnormal, near float32's max, inf, nan)
and on random bit patterns; ``cast=False`` keeps the interpreter's fp8 conversion out of the comparison.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from fake_cuda.bits import same_bits

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),  # numpy's, in the interpreter: log2(0), inf * 0
]

EPS = 1e-12
ELEM_MAXES = [448.0, 57344.0, 6.0, 240.0]


def _random_amaxes(n: int, seed: int) -> np.ndarray:
    """Positive finite float32 values, their exponents spread over float32's whole range (subnormals too)."""
    rng = np.random.default_rng(seed)
    return rng.integers(1, 0x7F800000, size=n, dtype=np.int64).astype(np.uint32).view(np.float32)


@pytest.mark.parametrize("elem_max", ELEM_MAXES)
def test_float32_division_equals_float64_division_rounded_once(elem_max: float) -> None:
    a = _random_amaxes(1 << 20, seed=int(elem_max))
    a = a[a >= np.float32(1.0000001044244144e-12)]  # the kernel takes EPS's quotient below that
    wide = (elem_max / a.astype(np.float64)).astype(np.float32)
    narrow = np.float32(elem_max) / a
    assert np.array_equal(wide.view(np.uint32), narrow.view(np.uint32))


def test_the_eps_threshold_is_the_smallest_float32_at_or_above_eps(interpret) -> None:
    from mixprec.lowbit import _triton_kernels as kern

    up = np.float32(kern.EPS_F32_UP.value)
    assert float(up) >= EPS > float(np.nextafter(up, np.float32(0)))


def _edge_rows(width: int) -> torch.Tensor:
    """One row per amax: the value once, the rest of the row at most half of it (so it is the amax)."""
    up = np.float32(1.0000001044244144e-12)
    edges = [
        0.0,
        1e-45,  # the smallest subnormal
        1e-13,
        float(np.nextafter(up, np.float32(0))),
        float(up),
        float(np.nextafter(up, np.float32(1))),
        1.5e-12,
        1.0,
        448.0,
        3.0e38,
        float(np.finfo(np.float32).max),
        float("inf"),
        float("nan"),
    ]
    amax = torch.tensor(np.concatenate([np.float32(edges), _random_amaxes(51, seed=7)]), dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    rows = torch.rand(amax.numel(), width, generator=g) * 0.5 * amax[:, None].nan_to_num(0.0, 0.0, 0.0)
    rows[:, 5] = amax
    signs = torch.where(torch.rand(rows.shape, generator=g) < 0.5, -1.0, 1.0)
    return rows * signs


def _both(kernels, x: torch.Tensor, fmt: str):
    saved = dict(kernels.F32_DIV)
    out = []
    for f32 in (True, False):
        kernels.F32_DIV.update(dict.fromkeys(saved, f32))
        try:
            out.append(kernels.quantize(x, fmt, transpose=True, cast=False))
        finally:
            kernels.F32_DIV.update(saved)
    return out


@pytest.mark.parametrize(
    "fmt", ["fp8_rowwise", "fp8_rowwise_e5m2", "fp8_rowwise_fp32", "fp8_blockwise", "fp8_blockwise_2d"]
)
def test_per_row_and_block_scales_same_bits_either_division(interpret, fmt: str) -> None:
    x = _edge_rows(256)
    (q32, t32), (q64, t64) = _both(interpret, x, fmt)
    for a, b in ((q32, q64), (t32, t64)):
        assert same_bits(a.scale, b.scale)
        assert same_bits(a.data, b.data)
    assert torch.isnan(q32.scale).any()  # the nan row kept its nan scale in both


@pytest.mark.parametrize("fmt", ["fp8_tensorwise", "fp8_tensorwise_e5m2", "fp8_tensorwise_pow2"])
@pytest.mark.parametrize("amax", [0.0, 1e-13, 1.0000001044244144e-12, 2.5, 3.0e38, float("inf")])
def test_tensor_scale_same_bits_either_division(interpret, fmt: str, amax: float) -> None:
    x = torch.full((3, 40), amax / 4)
    x[1, 7] = -amax
    (q32, t32), (q64, t64) = _both(interpret, x, fmt)
    assert same_bits(q32.scale, q64.scale) and same_bits(q32.data, q64.data)
    assert same_bits(t32.data, t64.data)
