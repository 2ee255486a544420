"""The scaling math of block-scaled formats: block amax, then one scale per block.

All functions take float32 block amaxes and return float32 (or uint8 exponent) tensors of the same shape;
there is no host synchronisation. The algorithms:

* fp32 / pow2 (torchao ``float8_utils.amax_to_scale``): ``s = elem_max / max(amax, 1e-12)`` computed in
  float64 and rounded once to float32; pow2 rounds ``s`` down to a power of two, ``exp2(floor(log2 s))``.
  Stored values are ``saturate(x * s)``.
* e8m0 (OCP MX v1.0 section 6.3, torchao ``mx_tensor.to_mx``): with ``E = floor(log2 amax)`` read from the
  float32 exponent bits, the biased exponent is ``clamp(E - emax_elem, -127, 128) + 127`` (FLOOR), one
  more when the amax's mantissa is non-zero (CEIL), or ``E`` of the amax rounded to the element's mantissa
  width first (EVEN); RCEIL is cuBLAS's ``ceil(log2(amax / elem_max))``. A nan amax gives 255 (nan).
  Stored values are ``saturate(x / 2**(e - 127))`` (FLOOR/CEIL/EVEN; the divisor is at least 2**-126)
  or ``saturate(x * 2**(127 - e))`` (RCEIL).
* e4m3 (NVFP4, NVIDIA's recipe, torchao ``nvfp4_quantize``): the block descale ``amax / 6`` is stored in
  e4m3, clamped to [2**-6, 448]; with ``two_level`` a float32 per-tensor scale ``t = amax_tensor / (448*6)``
  is divided out first, so the e4m3 descale is ``amax / 6 / t``. Stored values are
  ``saturate(x * ((1 / t) / d))`` with ``d`` the e4m3 descale as float32 (``t = 1`` for one level).
* under stochastic rounding (:func:`coarser_scale`): a block whose amax the scale above puts beyond the
  element max takes the next coarser scale, so nothing saturates; NVFP4's ``t`` gets ``TENSOR_HEADROOM``.
"""

from __future__ import annotations

import math

import torch

from mixprec import formats
from mixprec.lowbit.formats import ScaleRounding

__all__ = [
    "EPS",
    "block_amax",
    "coarser_scale",
    "e4m3_descale",
    "e8m0_exponent",
    "e8m0_quantize_factor",
    "e8m0_to_float",
    "fp32_scale",
    "nvfp4_tensor_scale",
]

#: Smallest amax an fp32 scale is computed from (torchao's value), so an all-zero block gets a finite scale.
EPS = 1e-12
E8M0_BIAS = 127
E8M0_NAN = 255
F32_MIN_NORMAL = 2.0**-126
F4_MAX = 6.0
F8E4M3_MAX = 448.0
E4M3_MAX_BITS = 0x7E  # the code of 448; 0x7F is nan
#: NVFP4's per-tensor scale margin under stochastic rounding: 16 float32 ulps, beyond the four roundings
#: (amax / 2688, amax / 6 / t, 1 / t, (1 / t) / d) between a block's amax and its scaled value.
TENSOR_HEADROOM = 1.0 + 2.0**-20


def block_amax(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``max|x|`` per (rows, cols) block of a 2-D (M, K) tensor whose sizes are multiples of the block.

    Returns float32 (M // rows, K // cols); nan where a block has a nan.
    """
    m, k = x.shape
    blocks = x.reshape(m // rows, rows, k // cols, cols)
    return torch.amax(torch.abs(blocks), dim=(1, 3)).to(torch.float32)


def fp32_scale(amax: torch.Tensor, elem: formats.Format, pow2: bool) -> torch.Tensor:
    """The float32 multiplier ``elem.max / max(amax, EPS)`` (rounded down to a power of two if ``pow2``)."""
    scale = (elem.max / torch.clamp(amax.to(torch.float64), min=EPS)).to(torch.float32)
    return torch.exp2(torch.floor(torch.log2(scale))) if pow2 else scale


def e8m0_exponent(amax: torch.Tensor, elem: formats.Format, rule: ScaleRounding) -> torch.Tensor:
    """The biased e8m0 exponent (uint8) of each block (see the module doc for the rules)."""
    if rule is ScaleRounding.RCEIL:
        descale = amax / elem.max
        normal = torch.clamp(torch.ceil(torch.log2(descale)), min=-E8M0_BIAS, max=E8M0_BIAS) + E8M0_BIAS
        exp = torch.where(torch.isinf(descale), 254, normal.to(torch.uint8))
        return torch.where(torch.isnan(descale), E8M0_NAN, exp).to(torch.uint8)
    # emax of the element format: the exponent of its largest power of two (8 for e4m3, 15 e5m2, 2 e2m1).
    elem_emax = math.floor(math.log2(elem.max))
    bits = amax.view(torch.int32)
    if rule is ScaleRounding.EVEN:
        bits = (bits + (1 << (23 - elem.mantissa_bits - 1))) & (0x1FF << 23)
    exp = (torch.bitwise_right_shift(bits, 23) & 0xFF) - E8M0_BIAS
    if rule is ScaleRounding.CEIL:
        exp = exp + ((bits & 0x7FFFFF) > 0).to(exp.dtype)
    unbiased = torch.clamp(exp - elem_emax, min=-E8M0_BIAS, max=E8M0_BIAS + 1)
    biased = (unbiased + E8M0_BIAS).to(torch.uint8)
    return torch.where(torch.isnan(amax), E8M0_NAN, biased).to(torch.uint8)


def e8m0_to_float(exp: torch.Tensor) -> torch.Tensor:
    """``2**(exp - 127)`` as float32, nan where ``exp`` is 255 (the dequantization factor)."""
    value = torch.exp2(exp.to(torch.float32) - E8M0_BIAS)
    return torch.where(exp != E8M0_NAN, value, float("nan"))


def e8m0_quantize_factor(exp: torch.Tensor, rule: ScaleRounding) -> tuple[torch.Tensor, bool]:
    """``(factor, divide)``: stored values are ``x / factor`` if ``divide`` else ``x * factor``."""
    if rule is ScaleRounding.RCEIL:
        rcp = torch.where(exp == 0, 1.0, torch.exp2(E8M0_BIAS - exp.to(torch.float32)))
        rcp = torch.where(exp == 254, 2.0**-127, rcp)
        return torch.where(exp == E8M0_NAN, float("nan"), rcp), False
    as_float = torch.bitwise_left_shift(exp.to(torch.int32), 23).view(torch.float32)
    return torch.clamp(as_float, min=F32_MIN_NORMAL), True


def e4m3_descale(amax: torch.Tensor, tensor_scale: torch.Tensor | None) -> torch.Tensor:
    """NVFP4's e4m3 block descale ``amax / 6`` (over ``tensor_scale`` if given), as float8_e4m3fn."""
    block = amax / F4_MAX
    if tensor_scale is not None:
        block = block.to(torch.float32) / tensor_scale
    tiny = torch.finfo(torch.float8_e4m3fn).tiny
    return torch.clamp(block, min=tiny, max=F8E4M3_MAX).to(torch.float8_e4m3fn)


def nvfp4_tensor_scale(amax: torch.Tensor, headroom: bool = False) -> torch.Tensor:
    """NVFP4's float32 per-tensor scale ``amax / (448 * 6)``, so block descales use e4m3's whole range.

    With ``headroom`` (stochastic rounding) it is ``TENSOR_HEADROOM`` larger, so the block holding the
    tensor's amax maps to at most 6 under the largest descale, 448, despite float32 rounding on the way.
    """
    scale = amax.to(torch.float32) / (F8E4M3_MAX * F4_MAX)
    return scale * TENSOR_HEADROOM if headroom else scale


def coarser_scale(scale: torch.Tensor, kind: str, where: torch.Tensor) -> torch.Tensor:
    """``scale`` (as stored for scale format ``kind``) one step coarser where ``where`` is set.

    The step is the smallest that scales a block's values down: the next float32 toward zero (fp32), half
    the multiplier (pow2), the next biased exponent (e8m0, up to 254) or the next e4m3 descale (up to 448).
    On a floor-rule e8m0 exponent this gives ``ceil(log2(amax / elem_max))``, the RCEIL rule, exactly.
    """
    if kind == "fp32":
        return torch.where(where, torch.nextafter(scale, torch.zeros_like(scale)), scale)
    if kind == "pow2":
        return torch.where(where, scale * 0.5, scale)
    if kind == "e8m0":
        return torch.where(where & (scale < E8M0_NAN - 1), scale + 1, scale)
    bits = scale.view(torch.uint8)
    step = torch.where(where & (bits < E4M3_MAX_BITS), bits + 1, bits)  # positive e4m3: codes ordered
    return step.to(torch.uint8).view(torch.float8_e4m3fn)
