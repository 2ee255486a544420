"""torchao.float8's per-operand vocabulary: how each tensor of each GEMM is cast, and each GEMM's settings.

A linear layer casts three tensors (``input``, ``weight``, ``grad_output``), each used by two of its three
GEMMs; a :class:`CastConfig` says how one use is cast::

    scaling_type         DYNAMIC (scale from the tensor's own amax) or DISABLED (left in high precision)
    scaling_granularity  TENSORWISE (one scale) or AXISWISE (one scale per row along the GEMM's
                         reduction dim, torchao's "rowwise"); AXISWISE needs DYNAMIC
    target_dtype         torch.float8_e4m3fn, torch.float8_e5m2, or AMD MI300's torch.float8_e4m3fnuz /
                         torch.float8_e5m2fnuz; None takes the operand's default (e4m3fn for input and
                         weight, e5m2 for grad_output)

The names, values and ``short_str`` forms are torchao 0.18's (``torchao.float8.config``), and every function
here that takes a cast or GEMM config also takes torchao's own objects (read by their field names and their
enums' ``.value``), so a config written for torchao builds a mixprec one unchanged.

:class:`ScaledMMConfig` / :class:`LinearMMConfig` are the per-GEMM settings a
:class:`~mixprec.float8.Float8Linear` exposes as ``linear_mm_config`` (torchao's attribute). In mixprec
they are built once per (frozen) config and read from it, rather than carried by a tensor subclass.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

import torch

__all__ = [
    "CastConfig",
    "Float8GemmConfig",
    "Float8UsageError",
    "LinearMMConfig",
    "ScaledMMConfig",
    "ScalingGranularity",
    "ScalingType",
    "lowbit_format",
    "recipe_casts",
]

_DTYPE_NAMES = {
    torch.float8_e4m3fn: "e4m3",
    torch.float8_e5m2: "e5m2",
    torch.float8_e4m3fnuz: "e4m3fnuz",
    torch.float8_e5m2fnuz: "e5m2fnuz",
}
#: The lowbit format names' element part of each target dtype ("fp8_tensorwise" + suffix).
_FORMAT_SUFFIX = {
    torch.float8_e4m3fn: "",
    torch.float8_e5m2: "_e5m2",
    torch.float8_e4m3fnuz: "_fnuz",
    torch.float8_e5m2fnuz: "_e5m2fnuz",
}
#: The accepted target dtypes, as an error message lists them.
TARGET_DTYPES = ", ".join(map(str, _DTYPE_NAMES))


class Float8UsageError(ValueError, AssertionError):
    """Input torchao.float8 refuses with an ``AssertionError``: a ValueError, as mixprec's bad input is,
    and an AssertionError, so code (and tests) written against torchao catch it unchanged."""


class ScalingType(str, Enum):
    """How a tensor is cast: ``DYNAMIC`` (scale from its own amax) or ``DISABLED`` (high precision)."""

    DYNAMIC = "dynamic"
    DISABLED = "disabled"

    def short_str(self) -> str:
        return "dyn" if self is ScalingType.DYNAMIC else "dis"


class ScalingGranularity(str, Enum):
    """One scale per tensor (``TENSORWISE``) or per row along the reduction dim (``AXISWISE``)."""

    TENSORWISE = "tensorwise"
    AXISWISE = "axiswise"

    def short_str(self) -> str:
        return "ten" if self is ScalingGranularity.TENSORWISE else "axs"


def _enum(kind: type[Enum], field: str, value: object) -> Enum:
    raw = getattr(value, "value", value)
    try:
        return kind(raw)
    except ValueError:
        accepted = ", ".join(f"{kind.__name__}.{m.name}" for m in kind)
        raise ValueError(f"{field} must be one of {accepted}; got {value!r}") from None


@dataclass(frozen=True)
class CastConfig:
    """How one use of a tensor is cast to fp8 (see the module doc); frozen and hashable.

    Raises:
        ValueError: for a ``scaling_type`` or ``scaling_granularity`` outside the enums (their string
            values are accepted too), a ``target_dtype`` other than None, float8_e4m3fn, float8_e5m2,
            float8_e4m3fnuz or float8_e5m2fnuz.
        Float8UsageError: (a ValueError and an AssertionError, as torchao raises) for AXISWISE scaling
            that is not DYNAMIC.
    """

    scaling_type: ScalingType = ScalingType.DYNAMIC
    scaling_granularity: ScalingGranularity = ScalingGranularity.TENSORWISE
    target_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        scaling_type = _enum(ScalingType, "scaling_type", self.scaling_type)
        granularity = _enum(ScalingGranularity, "scaling_granularity", self.scaling_granularity)
        if self.target_dtype is not None and self.target_dtype not in _DTYPE_NAMES:
            got = self.target_dtype
            raise ValueError(f"target_dtype must be None or one of {TARGET_DTYPES}; got {got!r}")
        if granularity is ScalingGranularity.AXISWISE and scaling_type is not ScalingType.DYNAMIC:
            raise Float8UsageError(
                "only dynamic scaling type is supported for axiswise scaling granularity "
                f"(got scaling_type={scaling_type.name})"
            )
        object.__setattr__(self, "scaling_type", scaling_type)
        object.__setattr__(self, "scaling_granularity", granularity)

    @classmethod
    def of(cls, value: object, field: str, default_dtype: torch.dtype) -> CastConfig:
        """``value`` (a mixprec or torchao CastConfig) as a mixprec one with its target dtype resolved.

        Raises:
            TypeError: for an object without ``scaling_type``, ``scaling_granularity`` and ``target_dtype``.
        """
        # Spelled out (not all() over a tuple) so the type checker sees the three attributes afterwards.
        if not (
            hasattr(value, "scaling_type")
            and hasattr(value, "scaling_granularity")
            and hasattr(value, "target_dtype")
        ):
            raise TypeError(f"{field} must be a mixprec.float8.CastConfig, got {type(value).__name__}")
        dtype = value.target_dtype if value.target_dtype is not None else default_dtype
        return cls(value.scaling_type, value.scaling_granularity, dtype)

    @property
    def disabled(self) -> bool:
        return self.scaling_type is ScalingType.DISABLED

    def short_str(self) -> str:
        """torchao's form: ``"dyn_ten_e4m3"``, ``"dyn_axs_e4m3"``, ``"dis_ten_e5m2"``; the fnuz dtypes are
        ``"e4m3fnuz"`` / ``"e5m2fnuz"`` (torchao, where its e4m3 is fnuz on MI300, writes ``"e4m3"``)."""
        dtype = "default" if self.target_dtype is None else _DTYPE_NAMES[self.target_dtype]
        return f"{self.scaling_type.short_str()}_{self.scaling_granularity.short_str()}_{dtype}"


@dataclass(frozen=True)
class Float8GemmConfig:
    """Settings of one fp8 GEMM: ``use_fast_accum`` is ``torch._scaled_mm``'s flag (on CUDA, accumulate
    in lower precision, faster and less exact); the emulated GEMM ignores it, as torchao's does.

    Raises:
        TypeError: if ``use_fast_accum`` is not a bool.
    """

    use_fast_accum: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.use_fast_accum, bool):
            raise TypeError(f"use_fast_accum must be a bool, got {self.use_fast_accum!r}")

    @classmethod
    def of(cls, value: object, field: str) -> Float8GemmConfig:
        """``value`` (a mixprec or torchao Float8GemmConfig) as a mixprec one.

        Raises:
            TypeError: for an object without ``use_fast_accum``.
        """
        if not hasattr(value, "use_fast_accum"):
            raise TypeError(f"{field} must be a mixprec.float8.Float8GemmConfig, got {type(value).__name__}")
        return cls(value.use_fast_accum)


class ScaledMMConfig(NamedTuple):
    """One GEMM's settings as torchao's ``ScaledMMConfig`` orders them (``fp8_output`` is always False)."""

    emulate: bool = False
    use_fast_accum: bool = False
    fp8_output: bool = False
    pad_inner_dim: bool = False


class LinearMMConfig(NamedTuple):
    """The settings of a linear layer's three GEMMs: ``output``, ``grad_input``, ``grad_weight``."""

    output: ScaledMMConfig = ScaledMMConfig()
    grad_input: ScaledMMConfig = ScaledMMConfig()
    grad_weight: ScaledMMConfig = ScaledMMConfig()


def lowbit_format(cast: CastConfig, pow2: bool) -> str:
    """The :data:`mixprec.lowbit.FORMATS` name (or ``"hp"``) that casts as ``cast`` says, with scales
    rounded down to powers of two when ``pow2`` (``fp8_rowwise_fnuz`` for an AXISWISE e4m3fnuz cast)."""
    if cast.disabled:
        return "hp"
    if cast.target_dtype is None:
        raise ValueError(
            f"lowbit_format needs a cast with its target_dtype resolved (CastConfig.of), got {cast}"
        )
    suffix = _FORMAT_SUFFIX[cast.target_dtype]
    if cast.scaling_granularity is ScalingGranularity.TENSORWISE:
        return "fp8_tensorwise" + suffix + ("_pow2" if pow2 else "")
    return "fp8_rowwise" + suffix + ("" if pow2 else "_fp32")


def recipe_casts(recipe: str) -> dict[str, CastConfig]:
    """The casts torchao's ``Float8LinearConfig.from_recipe_name(recipe)`` sets (tensorwise: none)."""
    axiswise = CastConfig(scaling_granularity=ScalingGranularity.AXISWISE, target_dtype=torch.float8_e4m3fn)
    if recipe == "rowwise":
        return dict.fromkeys(("cast_config_input", "cast_config_weight", "cast_config_grad_output"), axiswise)
    if recipe == "rowwise_with_gw_hp":
        disabled = CastConfig(scaling_type=ScalingType.DISABLED, target_dtype=torch.float8_e4m3fn)
        return {
            "cast_config_input": axiswise,
            "cast_config_weight": axiswise,
            "cast_config_grad_output": axiswise,
            "cast_config_weight_for_grad_input": CastConfig(),
            "cast_config_input_for_grad_weight": disabled,
            "cast_config_grad_output_for_grad_weight": disabled,
        }
    return {}
