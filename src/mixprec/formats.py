"""Numeric formats as data: range, precision and the questions loss scaling asks of them.

Every format mixprec reasons about (fp32, fp16, bf16, float8 e4m3fn / e5m2 and AMD MI300's
e4m3fnuz / e5m2fnuz) is a frozen :class:`Format` record. The figures are derived from the bit layout, so
they hold for float8 even where the installed torch has no dtype for it, and tests check them against
``torch.finfo`` and the values torch decodes from every code.

Typical use::

    from mixprec import formats
    formats.FP16.max                       # 65504.0
    formats.get(torch.bfloat16).eps        # 0.0078125
    formats.FP16.underflows(1e-8, scale=2.0**16)   # False: 1e-8 * 65536 is representable
"""

from __future__ import annotations

import difflib
import math
import numbers
from dataclasses import dataclass

import torch

__all__ = [
    "BF16",
    "FORMATS",
    "FP8_E4M3FN",
    "FP8_E4M3FNUZ",
    "FP8_E5M2",
    "FP8_E5M2FNUZ",
    "FP16",
    "FP32",
    "Format",
    "as_dtype",
    "get",
    "max_safe_scale",
]


@dataclass(frozen=True)
class Format:
    """A binary floating-point format described by its bit layout.

    Args:
        name: canonical short name ("fp16").
        exponent_bits: width of the exponent field.
        mantissa_bits: width of the stored fraction field.
        has_inf: whether the all-ones exponent encodes inf (False for e4m3fn, which saturates to nan).
        max_override: the largest finite value when the layout alone does not give it (e4m3fn uses
            the all-ones exponent for normal numbers, so its max is 448, not 240).
        torch_dtype_name: attribute of ``torch`` for the matching dtype, if torch has one.
        fnuz: the "finite, no negative zero" layout of AMD's MI300 float8 (``float8_e4m3fnuz``,
            ``float8_e5m2fnuz``): the exponent bias is one more than IEEE's (``2**(exponent_bits - 1)``),
            every exponent including the all-ones one encodes normal numbers, and the single nan is the
            code of -0.0 (0x80 for 8 bits), so there is no inf and no negative zero (``has_inf=False``).

    Raises:
        TypeError: for a ``name``, ``has_inf``, ``fnuz`` or ``torch_dtype_name`` of the wrong type.
        ValueError: for bit widths outside [2, 30] / [0, 30], a ``max_override`` that is not finite and
            > 0, or ``fnuz=True`` with ``has_inf=True`` (an fnuz format has no inf).
    """

    name: str
    exponent_bits: int
    mantissa_bits: int
    has_inf: bool = True
    max_override: float | None = None
    torch_dtype_name: str | None = None
    fnuz: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"name must be a non-empty str, got {self.name!r}")
        for field_name, low in (("exponent_bits", 2), ("mantissa_bits", 0)):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= 30:
                raise ValueError(f"{field_name} must be an int in [{low}, 30], got {value!r}")
        if not isinstance(self.has_inf, bool):
            raise TypeError(f"has_inf must be a bool, got {self.has_inf!r}")
        if not isinstance(self.fnuz, bool):
            raise TypeError(f"fnuz must be a bool, got {self.fnuz!r}")
        if self.fnuz and self.has_inf:
            raise ValueError(f"an fnuz format has no inf: {self.name!r} needs has_inf=False with fnuz=True")
        if self.max_override is not None:
            _number("max_override", self.max_override, positive=True)
        if self.torch_dtype_name is not None and not isinstance(self.torch_dtype_name, str):
            raise TypeError(f"torch_dtype_name must be a str or None, got {self.torch_dtype_name!r}")

    @property
    def bias(self) -> int:
        """The exponent bias: ``2**(exponent_bits - 1) - 1`` (IEEE), one more for an fnuz format."""
        return 2 ** (self.exponent_bits - 1) - (0 if self.fnuz else 1)

    @property
    def max(self) -> float:
        """Largest finite value (an fnuz format's all-ones exponent is a normal binade)."""
        if self.max_override is not None:
            return self.max_override
        max_exp = 2**self.exponent_bits - (1 if self.fnuz else 2) - self.bias
        return (2.0 - 2.0 ** (-self.mantissa_bits)) * 2.0**max_exp

    @property
    def has_negative_zero(self) -> bool:
        """Whether -0.0 is a value of its own (not in an fnuz format: torch casts -0.0 to +0.0 there)."""
        return not self.fnuz

    @property
    def smallest_normal(self) -> float:
        """Smallest positive normal value (``torch.finfo(...).tiny``)."""
        return 2.0 ** (1 - self.bias)

    @property
    def smallest_subnormal(self) -> float:
        """Smallest positive value at all; anything below half of it rounds to zero."""
        return 2.0 ** (1 - self.bias - self.mantissa_bits)

    @property
    def eps(self) -> float:
        """Gap between 1.0 and the next representable value: why ``1 + 1e-4 == 1`` in fp16."""
        return 2.0 ** (-self.mantissa_bits)

    @property
    def bits(self) -> int:
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def dtype(self) -> torch.dtype | None:
        """The torch dtype for this format, or None when the installed torch lacks it."""
        if self.torch_dtype_name is None:
            return None
        return getattr(torch, self.torch_dtype_name, None)

    def overflows(self, value: float, scale: float = 1.0) -> bool:
        """Whether ``|value| * scale`` is beyond the largest finite value (or not finite at all).

        Raises:
            TypeError: for a ``value`` or ``scale`` that is not a real number.
            ValueError: for a ``scale`` that is not finite and > 0.
        """
        scaled = _scaled(value, scale)
        return not math.isfinite(scaled) or scaled > self.max

    def underflows(self, value: float, scale: float = 1.0) -> bool:
        """Whether a non-zero ``value * scale`` would be flushed to zero in this format (errors: as
        :meth:`overflows`)."""
        scaled = _scaled(value, scale)
        return 0.0 < scaled < self.smallest_subnormal / 2

    def is_subnormal(self, value: float, scale: float = 1.0) -> bool:
        """Whether ``value * scale`` lands in the subnormal range (representable, with lost precision;
        errors: as :meth:`overflows`)."""
        scaled = _scaled(value, scale)
        return self.smallest_subnormal / 2 <= scaled < self.smallest_normal

    def __str__(self) -> str:
        return self.name


def _number(name: str, value: object, positive: bool = False) -> float:
    """``float(value)`` for a real number (a 0-dim tensor too); with ``positive``, finite and > 0."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}: {value!r:.60}")
    value = float(value)
    if positive and not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return value


def _scaled(value: object, scale: object) -> float:
    return abs(_number("value", value)) * _number("scale", scale, positive=True)


#: IEEE binary32.
FP32 = Format("fp32", 8, 23, torch_dtype_name="float32")
#: IEEE binary16.
FP16 = Format("fp16", 5, 10, torch_dtype_name="float16")
#: bfloat16 (fp32's exponent, 7 mantissa bits).
BF16 = Format("bf16", 8, 7, torch_dtype_name="bfloat16")
#: OCP float8 e4m3 (max 448; no inf, nan is S.1111.111).
FP8_E4M3FN = Format("fp8_e4m3fn", 4, 3, has_inf=False, max_override=448.0, torch_dtype_name="float8_e4m3fn")
#: OCP float8 e5m2 (max 57344; IEEE-style inf and nan).
FP8_E5M2 = Format("fp8_e5m2", 5, 2, torch_dtype_name="float8_e5m2")
#: AMD MI300's float8 (max 240, bias 8; nan is 0x80, no inf, no -0).
FP8_E4M3FNUZ = Format("fp8_e4m3fnuz", 4, 3, has_inf=False, torch_dtype_name="float8_e4m3fnuz", fnuz=True)
#: AMD MI300's float8 (max 57344, bias 16; nan is 0x80, no inf, no -0).
FP8_E5M2FNUZ = Format("fp8_e5m2fnuz", 5, 2, has_inf=False, torch_dtype_name="float8_e5m2fnuz", fnuz=True)

#: Every format above, by name.
FORMATS: dict[str, Format] = {
    f.name: f for f in (FP32, FP16, BF16, FP8_E4M3FN, FP8_E5M2, FP8_E4M3FNUZ, FP8_E5M2FNUZ)
}

_ALIASES: dict[str, str] = {
    "float32": "fp32",
    "f32": "fp32",
    "float": "fp32",
    "single": "fp32",
    "float16": "fp16",
    "f16": "fp16",
    "half": "fp16",
    "bfloat16": "bf16",
    "float8_e4m3fn": "fp8_e4m3fn",
    "e4m3": "fp8_e4m3fn",
    "e4m3fn": "fp8_e4m3fn",
    "float8_e5m2": "fp8_e5m2",
    "e5m2": "fp8_e5m2",
    "float8_e4m3fnuz": "fp8_e4m3fnuz",
    "e4m3fnuz": "fp8_e4m3fnuz",
    "float8_e5m2fnuz": "fp8_e5m2fnuz",
    "e5m2fnuz": "fp8_e5m2fnuz",
}


#: The dtype names every dtype argument accepts (``Policy.parse``'s vocabulary), read by :func:`as_dtype`.
_DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "f32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "f16": torch.float16,
    "half": torch.float16,
}


def _close(name: str, candidates: object) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=3, cutoff=0.6)  # type: ignore[call-overload]
    return f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""


def as_dtype(value: torch.dtype | str, what: str = "dtype") -> torch.dtype:
    """``value`` as a torch dtype: a dtype comes back as it is, a name ("bf16", "fp16", "half",
    "float32", "torch.bfloat16"; case and blanks ignored) becomes the dtype :meth:`mixprec.Policy.parse`
    gives it. Every public argument that takes a dtype reads it through here, so they accept one vocabulary.

    Args:
        value: a ``torch.dtype`` or one of the names above.
        what: the argument's name, for the error message.

    Raises:
        ValueError: for an unknown name, with the close names and the accepted ones.
        TypeError: for a value that is neither a dtype nor a str.
    """
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        key = value.strip().lower().removeprefix("torch.")
        if key in _DTYPE_NAMES:
            return _DTYPE_NAMES[key]
        raise ValueError(
            f"unknown dtype {value!r} for {what}{_close(key, _DTYPE_NAMES)}; accepted: a torch.dtype or "
            f"one of {sorted(_DTYPE_NAMES)}"
        )
    raise TypeError(
        f"{what} must be a torch.dtype or a dtype name such as 'bf16', got {type(value).__name__}: {value!r}"
    )


def get(spec: Format | torch.dtype | str) -> Format:
    """Look a format up by :class:`Format`, torch dtype or name ("fp16", "float16", "half", "e4m3",
    "e4m3fnuz", "float8_e5m2fnuz").

    Raises:
        ValueError: for a name or dtype mixprec has no format for; the message lists the accepted names.
        TypeError: for a ``spec`` of another type.
    """
    if isinstance(spec, Format):
        return spec
    if isinstance(spec, torch.dtype):
        for fmt in FORMATS.values():
            if fmt.dtype == spec:
                return fmt
        raise ValueError(f"no mixprec format for dtype {spec}; accepted: {sorted(FORMATS)}")
    if isinstance(spec, str):
        key = spec.strip().lower().removeprefix("torch.")
        key = _ALIASES.get(key, key)
        if key in FORMATS:
            return FORMATS[key]
        names = sorted(set(FORMATS) | set(_ALIASES))
        close = difflib.get_close_matches(key, names, n=3)
        hint = f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""
        raise ValueError(f"unknown format {spec!r}{hint}; accepted: {names}")
    raise TypeError(f"spec must be a Format, torch.dtype or str, got {type(spec).__name__}: {spec!r}")


def max_safe_scale(amax: float, fmt: Format | torch.dtype | str = FP16, margin: float = 2.0) -> float:
    """Largest power-of-two scale that keeps ``amax * scale * margin`` finite in ``fmt``.

    Returns ``inf`` for ``amax == 0`` (any scale is safe).

    Raises:
        TypeError: for an ``amax`` or ``margin`` that is not a real number, or a bad ``fmt`` (see get).
        ValueError: for a negative or non-finite ``amax``, a ``margin`` that is not finite and >= 1, or an
            unknown ``fmt``.
    """
    fmt = get(fmt)
    amax = _number("amax", amax)
    if not math.isfinite(amax) or amax < 0:
        raise ValueError(f"amax must be finite and >= 0, got {amax}")
    margin = _number("margin", margin)
    if not (math.isfinite(margin) and margin >= 1):
        raise ValueError(f"margin must be a finite number >= 1, got {margin}")
    if amax == 0:
        return math.inf
    return 2.0 ** math.floor(math.log2(fmt.max / (amax * margin)))
