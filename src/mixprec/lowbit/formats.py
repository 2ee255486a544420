"""Block-scaled low-bit formats as data: element format, scale format, block shape, scale rule.

A :class:`LowbitFormat` says everything :func:`mixprec.lowbit.quantize` needs::

    element   the number format of the stored values: e4m3 / e5m2 (fp8), e4m3fnuz / e5m2fnuz (AMD MI300's
              fp8: max 240 / 57344, no inf, no -0), e2m1 (fp4)
    scale     how a block's scale is stored:
                "fp32"  float32 multiplier into the element range, x_q = x * s (torchao float8's ``_scale``)
                "pow2"  the same, rounded down to a power of two (torchao ``round_scales_to_power_of_2``,
                        Transformer Engine's default for Float8BlockScaling)
                "e8m0"  a biased power-of-two exponent (OCP MX v1.0), a descale: x ~ x_q * 2**(e - 127)
                "e4m3"  an fp8 e4m3 descale per block (NVFP4), optionally over a float32 per-tensor scale
    block     (rows, cols) of one scale block, -1 meaning the whole dimension: (-1, -1) tensor, (1, -1) row,
              (1, 128), (128, 128), (1, 32), (1, 16), (16, 16). ``cols`` runs along the quantization axis.
    rule      a :class:`ScaleRounding`, how an e8m0 exponent is picked from a block's amax (torchao's
              ``ScaleCalculationMode``):
              FLOOR (OCP: floor(log2 amax) - emax_elem), CEIL, EVEN (round the amax's mantissa first),
              RCEIL (cuBLAS: ceil(log2(amax / elem_max))). Other scale formats use ``AMAX`` (elem_max / amax).
    two_level NVFP4's float32 per-tensor scale amax / (448 * 6) under the e4m3 block scales.

The named formats are in :data:`FORMATS`; a user format is a :class:`LowbitFormat` built from the pieces.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from enum import Enum

from mixprec import formats

__all__ = [
    "E2M1",
    "E4M3",
    "E4M3FNUZ",
    "E5M2",
    "E5M2FNUZ",
    "ELEMENTS",
    "FORMATS",
    "SCALE_FORMATS",
    "LowbitFormat",
    "ScaleRounding",
    "get_format",
]

E4M3 = formats.FP8_E4M3FN
E5M2 = formats.FP8_E5M2
E4M3FNUZ = formats.FP8_E4M3FNUZ
E5M2FNUZ = formats.FP8_E5M2FNUZ
#: fp4 e2m1 (OCP MX): values 0, 0.5, 1, 1.5, 2, 3, 4, 6; no inf or nan, so the all-ones exponent is normal.
E2M1 = formats.Format("fp4_e2m1", 2, 1, has_inf=False, max_override=6.0, torch_dtype_name="float4_e2m1fn_x2")
ELEMENTS = {"e4m3": E4M3, "e5m2": E5M2, "e4m3fnuz": E4M3FNUZ, "e5m2fnuz": E5M2FNUZ, "e2m1": E2M1}
SCALE_FORMATS = ("fp32", "pow2", "e8m0", "e4m3")


class ScaleRounding(str, Enum):
    """How a block's scale is rounded from its amax: torchao's ``ScaleCalculationMode`` (see the module doc).

    Not to be confused with :class:`mixprec.scaling.ScaleRule`, which updates a loss scale.
    """

    AMAX = "amax"
    FLOOR = "floor"
    CEIL = "ceil"
    EVEN = "even"
    RCEIL = "rceil"


@dataclass(frozen=True)
class LowbitFormat:
    """One block-scaled format (see the module doc for the fields).

    Raises:
        ValueError: for an unknown element or scale format, a bad block shape, or a rule that does not fit
            the scale format (e8m0 takes FLOOR/CEIL/EVEN/RCEIL, the others AMAX), or ``two_level`` without
            e4m3 scales.
    """

    name: str
    element: str
    scale: str
    block: tuple[int, int]
    rule: ScaleRounding = ScaleRounding.AMAX
    two_level: bool = False

    def __post_init__(self) -> None:
        if self.element not in ELEMENTS:
            raise ValueError(f"element must be one of {sorted(ELEMENTS)}, got {self.element!r}")
        if self.scale not in SCALE_FORMATS:
            raise ValueError(f"scale must be one of {list(SCALE_FORMATS)}, got {self.scale!r}")
        rows, cols = _block(self.block)
        object.__setattr__(self, "block", (rows, cols))
        object.__setattr__(self, "rule", ScaleRounding(self.rule))
        if (self.scale == "e8m0") != (self.rule is not ScaleRounding.AMAX):
            raise ValueError(f"scale {self.scale!r} does not take rule {self.rule.value!r}")
        if self.two_level and self.scale != "e4m3":
            raise ValueError(f"two_level needs e4m3 block scales, got scale {self.scale!r}")
        if self.element == "e2m1" and self.scale in ("fp32", "pow2") and rows == cols == -1:
            raise ValueError("e2m1 needs block scales (8 values cannot hold a tensor with one scale)")

    @property
    def elem(self) -> formats.Format:
        """The element format as a :class:`mixprec.formats.Format`."""
        return ELEMENTS[self.element]

    @property
    def is_tensorwise(self) -> bool:
        return self.block == (-1, -1)

    @property
    def bits_per_value(self) -> float:
        """Storage per value including the scales, for a tensor that is a multiple of the block."""
        rows, cols = self.block
        per_block = (rows if rows > 0 else 1 << 20) * (cols if cols > 0 else 1 << 20)
        scale_bits = 32 if self.scale in ("fp32", "pow2") else 8
        return self.elem.bits + scale_bits / per_block

    def __str__(self) -> str:
        return self.name


def _block(block: object) -> tuple[int, int]:
    if not (isinstance(block, tuple) and len(block) == 2):
        raise ValueError(f"block must be (rows, cols) of ints >= 1 or -1 (whole dimension), got {block!r}")
    ok = all(isinstance(b, int) and not isinstance(b, bool) and (b == -1 or b >= 1) for b in block)
    if ok and ((block[0] == -1 and block[1] != -1) or (block[0] not in (-1, 1) and block[1] == -1)):
        ok = False
    if not ok:
        raise ValueError(f"block must be (rows, cols) of ints >= 1 or -1 (whole dimension), got {block!r}")
    return block[0], block[1]


def _fmt(name: str, element: str, scale: str, block: tuple[int, int], rule: str = "amax", two: bool = False):
    return LowbitFormat(name, element, scale, block, ScaleRounding(rule), two)


#: The named formats, by the names torchao and Transformer Engine use for their recipes.
FORMATS: dict[str, LowbitFormat] = {
    f.name: f
    for f in (
        _fmt("fp8_tensorwise", "e4m3", "fp32", (-1, -1)),
        _fmt("fp8_tensorwise_e5m2", "e5m2", "fp32", (-1, -1)),
        _fmt("fp8_rowwise", "e4m3", "pow2", (1, -1)),
        _fmt("fp8_rowwise_fp32", "e4m3", "fp32", (1, -1)),
        _fmt("fp8_tensorwise_pow2", "e4m3", "pow2", (-1, -1)),
        _fmt("fp8_tensorwise_e5m2_pow2", "e5m2", "pow2", (-1, -1)),
        _fmt("fp8_rowwise_e5m2", "e5m2", "pow2", (1, -1)),
        _fmt("fp8_rowwise_e5m2_fp32", "e5m2", "fp32", (1, -1)),
        # The same for AMD MI300's fnuz fp8 ("_fnuz" for e4m3fnuz, "_e5m2fnuz"), the names following suit.
        _fmt("fp8_tensorwise_fnuz", "e4m3fnuz", "fp32", (-1, -1)),
        _fmt("fp8_tensorwise_e5m2fnuz", "e5m2fnuz", "fp32", (-1, -1)),
        _fmt("fp8_tensorwise_fnuz_pow2", "e4m3fnuz", "pow2", (-1, -1)),
        _fmt("fp8_tensorwise_e5m2fnuz_pow2", "e5m2fnuz", "pow2", (-1, -1)),
        _fmt("fp8_rowwise_fnuz", "e4m3fnuz", "pow2", (1, -1)),
        _fmt("fp8_rowwise_fnuz_fp32", "e4m3fnuz", "fp32", (1, -1)),
        _fmt("fp8_rowwise_e5m2fnuz", "e5m2fnuz", "pow2", (1, -1)),
        _fmt("fp8_rowwise_e5m2fnuz_fp32", "e5m2fnuz", "fp32", (1, -1)),
        _fmt("fp8_blockwise", "e4m3", "pow2", (1, 128)),
        _fmt("fp8_blockwise_2d", "e4m3", "pow2", (128, 128)),
        # MXFP8 names its scale rounding: the two are both in use (see mixprec.lowbit.recipes).
        _fmt("mxfp8_floor", "e4m3", "e8m0", (1, 32), "floor"),
        _fmt("mxfp8_e5m2", "e5m2", "e8m0", (1, 32), "floor"),
        _fmt("mxfp8_rceil", "e4m3", "e8m0", (1, 32), "rceil"),
        _fmt("mxfp4", "e2m1", "e8m0", (1, 32), "floor"),
        _fmt("nvfp4", "e2m1", "e4m3", (1, 16), two=True),
        _fmt("nvfp4_2d", "e2m1", "e4m3", (16, 16), two=True),
        _fmt("nvfp4_single", "e2m1", "e4m3", (1, 16)),
    )
}


# A name that meant one thing as a format and another as a recipe, kept out so it cannot mean either here.
_RENAMED = {
    "mxfp8": "'mxfp8' is a recipe (scales rounded up); as a format give the scale rounding: 'mxfp8_rceil' "
    "(the mxfp8 recipe's, torchao's MXFP8 training recipes') or 'mxfp8_floor' (OCP MX v1.0, torchao's "
    "MXTensor.to_mx default)",
}


def get_format(fmt: LowbitFormat | str) -> LowbitFormat:
    """The :class:`LowbitFormat` for a name in :data:`FORMATS` (or the value itself).

    Raises:
        ValueError: for an unknown name (with the closest known names).
        TypeError: for anything else.
    """
    if isinstance(fmt, LowbitFormat):
        return fmt
    if not isinstance(fmt, str):
        raise TypeError(f"fmt must be a LowbitFormat or a format name, got {type(fmt).__name__}")
    if fmt in _RENAMED:
        raise ValueError(_RENAMED[fmt])
    if fmt not in FORMATS:
        near = difflib.get_close_matches(fmt, FORMATS, n=3)
        hint = f" (did you mean {', '.join(near)}?)" if near else ""
        raise ValueError(f"unknown low-bit format {fmt!r}{hint}; known: {', '.join(FORMATS)}")
    return FORMATS[fmt]
