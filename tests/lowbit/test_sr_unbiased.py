"""Stochastic rounding is unbiased on every element, each block's largest value included (issue 33 item 1).

Statistical: the signed mean error over N seeded draws, on block maxima and elsewhere, in units of the
block amax, lies within ``K`` standard errors (estimated from the same draws) of 0 for every format, on the
issue's two tensors. Before the fix a nearest-rounded block scale let a block's largest value land above
the element max, where it was clamped: -1.2% of the block amax for nvfp4, -4% to -6% for mxfp4, -1.1% for
mxfp8, many standard errors out. Exact: the SR block scales are torchao's RCEIL scales for MX, the e4m3
descale rounded up for NVFP4, and an fp32 / pow2 scale one step down where the nearest one saturates.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from mixprec.lowbit import FORMATS, block_scales, quantize
from mixprec.lowbit.formats import get_format

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode

DRAWS = 160
K = 5.0  # standard errors; seeded, so a pass is reproducible, and the old bias sat 20-200 SE out
FLOAT32 = 2.0**-22  # relative float32 rounding of the scaling, which no number of draws averages away
# Block rows must divide the tensors' rows, so the N draws can be one quantize of N stacked copies.
SR_FORMATS = [name for name, f in FORMATS.items() if f.block[0] in (-1, 1, 16)]


def _outliers() -> torch.Tensor:
    """The issue's 64x256 tensor: an outlier column x300 and a row x1e-3."""
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    x[:, 7] *= 300
    x[5] *= 1e-3
    return x


def _binades() -> torch.Tensor:
    """The issue's 96x512 tensor whose rows span 8 binades."""
    x = torch.randn(96, 512, generator=torch.Generator().manual_seed(1))
    return x * torch.exp2(torch.linspace(-4, 4, 96))[:, None]


TENSORS = {"outliers": _outliers, "binades": _binades}


def _draws(x: torch.Tensor, name: str) -> torch.Tensor:
    """(DRAWS, M, K) dequantized SR draws: one quantize of DRAWS stacked copies (no block straddles two)."""
    g = torch.Generator().manual_seed(2)
    q = quantize(x.repeat(DRAWS, 1), name, stochastic=True, generator=g)
    return q.dequantize().reshape(DRAWS, *x.shape)


def _block_amax(x: torch.Tensor, name: str) -> torch.Tensor:
    """Each element's block amax, shaped as ``x``."""
    rows, cols = get_format(name).block
    rows, cols = (x.shape[0] if rows == -1 else rows), (x.shape[1] if cols == -1 else cols)
    amax = block_scales.block_amax(x, rows, cols)
    return amax.repeat_interleave(rows, 0).repeat_interleave(cols, 1)


def _z_scores(x: torch.Tensor, draws: torch.Tensor, amax: torch.Tensor) -> dict[str, tuple[float, float]]:
    """``{group: (signed mean error / amax, its standard error)}`` for block maxima and the others."""
    err = (draws.double() - x.double()) * x.sign().double() / amax.double()  # > 0: away from zero
    mean, var = err.mean(0), err.var(0)
    top = x.abs() == amax
    out = {}
    for group, mask in (("maxima", top), ("elsewhere", ~top & (x != 0))):
        m = mean[mask].mean()
        se = (var[mask].sum() / DRAWS).sqrt() / mask.sum()
        out[group] = (m.item(), se.item())
    return out


@pytest.mark.parametrize("tensor", TENSORS)
@pytest.mark.parametrize("name", SR_FORMATS)
def test_sr_signed_error_is_zero_within_k_standard_errors(name, tensor) -> None:
    x = TENSORS[tensor]()
    draws = _draws(x, name)
    assert draws.unique(dim=0).shape[0] == DRAWS  # every draw differs: the noise is really drawn
    stats = _z_scores(x, draws, _block_amax(x, name))
    for group, (mean, se) in stats.items():
        # FLOAT32: an amax an fp32 scale maps onto 448 (or one ulp below) has no spread, only rounding.
        ok = abs(mean) < K * se + FLOAT32
        assert ok, f"{name} on {tensor}: {group} bias {mean:+.4%} of the block amax, {mean / se:+.1f} SE"


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4", "mxfp8_floor"])
def test_nearest_rounding_keeps_its_balanced_clamp(name) -> None:
    """The tensors do make nearest scales saturate block maxima (else the test above would prove nothing)."""
    x = _outliers()
    q = quantize(x, name)
    rows, cols = q.fmt.block
    top = block_scales.block_amax(x, rows, cols) / q.block_descale()
    assert (top > q.fmt.elem.max).float().mean() > 0.1


@pytest.mark.parametrize("tensor", TENSORS)
@pytest.mark.parametrize(
    ("name", "elem"),
    [
        ("mxfp8_floor", torch.float8_e4m3fn),
        ("mxfp8_e5m2", torch.float8_e5m2),
        ("mxfp4", torch.float4_e2m1fn_x2),
    ],
)
def test_sr_mx_scales_are_torchao_rceil(name, elem, tensor) -> None:
    x = TENSORS[tensor]()
    scale, _ = mx.to_mx(x, elem, 32, ScaleCalculationMode.RCEIL)
    ours = quantize(x, name, stochastic=True, generator=torch.Generator().manual_seed(0))
    assert torch.equal(ours.scale.view(torch.uint8), scale.view(torch.uint8).reshape(ours.scale.shape))
    assert not torch.equal(ours.scale.view(torch.uint8), quantize(x, name).scale.view(torch.uint8))


@pytest.mark.parametrize("tensor", TENSORS)
@pytest.mark.parametrize("name", ["nvfp4", "nvfp4_2d", "nvfp4_single"])
def test_sr_nvfp4_descale_is_the_e4m3_ceiling(name, tensor) -> None:
    x = TENSORS[tensor]()
    q = quantize(x, name, stochastic=True, generator=torch.Generator().manual_seed(0))
    near = quantize(x, name)
    rows, cols = q.fmt.block
    amax = block_scales.block_amax(x, rows, cols).double()
    if q.fmt.two_level:
        assert q.tensor_scale.item() == pytest.approx(near.tensor_scale.item() * (1 + 2**-20), rel=1e-7)
        target = amax / 6 / q.tensor_scale.double()
    else:
        target = amax / 6
    target = target.clamp(2.0**-6, 448.0)  # e4m3's normal range, as torchao clamps the nearest descale
    grid = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).double()  # +0 .. 448
    ceil = grid[torch.searchsorted(grid, target * (1 - 2**-22))]  # float32's roundings on the way
    assert torch.equal(q.scale.double(), ceil)
    assert ((amax / q.block_descale().double()) <= 6 * (1 + 2**-21)).all()


@pytest.mark.parametrize(
    ("name", "amax"), [("fp8_rowwise_fp32", 0.018081652000546455), ("fp8_rowwise", 5.340579082258046e-05)]
)
def test_sr_fp32_and_pow2_scales_step_down_where_nearest_saturates(name, amax) -> None:
    """fp32 scales put ~9% of amaxes one float32 ulp above 448 (pow2 far fewer); SR steps those down."""
    x = torch.full((1, 64), amax / 2)
    x[0, 5] = amax
    near = quantize(x, name)
    sr = quantize(x, name, stochastic=True, generator=torch.Generator().manual_seed(0))
    amax32 = x[0, 5:6]
    assert (amax32 * near.scale[0]).item() > 448.0  # the float32 product quantize computes
    assert (amax32 * sr.scale[0]).item() <= 448.0
    expected = near.scale * 0.5 if name == "fp8_rowwise" else torch.nextafter(near.scale, torch.zeros(1))
    assert torch.equal(sr.scale, expected)
