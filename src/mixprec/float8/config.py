"""`Float8Config`: how a :class:`~mixprec.float8.Float8Linear` scales its tensors to fp8, and torchao.float8's
per-operand vocabulary it is written in (how each tensor of each GEMM is cast, and each GEMM's settings).

A frozen, hashable value (``torch.compile`` treats it as a constant). Every field is validated in the
constructor, and an error names the field and what it accepts.

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

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, ClassVar, NamedTuple

import torch

from mixprec import formats
from mixprec.lowbit.gemm import GemmOptions
from mixprec.lowbit.history import TensorScaling
from mixprec.lowbit.recipes import Recipe

__all__ = [
    "AMAX_COMPUTE_ALGOS",
    "MAX_AMAX_HISTORY_LEN",
    "MAX_MARGIN",
    "RECIPE_NAMES",
    "SCALINGS",
    "CastConfig",
    "Float8Config",
    "Float8GemmConfig",
    "Float8LinearConfig",
    "Float8UsageError",
    "LinearMMConfig",
    "ScaledMMConfig",
    "ScalingGranularity",
    "ScalingType",
    "lowbit_format",
    "recipe_casts",
]

# ---------------------------------------------------------------- torchao's per-operand vocabulary

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


def _fp8_dtype(value: object) -> torch.dtype | None:
    """``target_dtype`` resolved: None, one of the fp8 dtypes, or a name of one (``formats.get``'s)."""
    dtype = value
    if isinstance(value, str):
        try:
            dtype = formats.get(value).dtype
        except ValueError:
            dtype = None
        if dtype not in _DTYPE_NAMES:
            names = ", ".join(repr(n) for n in _DTYPE_NAMES.values())
            raise ValueError(
                f"target_dtype must be None, one of {TARGET_DTYPES} or a name of one ({names}); got {value!r}"
            )
    if dtype is not None and dtype not in _DTYPE_NAMES:
        raise ValueError(f"target_dtype must be None or one of {TARGET_DTYPES}; got {value!r}")
    return dtype  # type: ignore[return-value]


@dataclass(frozen=True)
class CastConfig:
    """How one use of a tensor is cast to fp8 (see the module doc); frozen and hashable.

    Raises:
        ValueError: for a ``scaling_type`` or ``scaling_granularity`` outside the enums (their string
            values are accepted too), a ``target_dtype`` other than None, float8_e4m3fn, float8_e5m2,
            float8_e4m3fnuz or float8_e5m2fnuz (or their names: "e4m3", "float8_e5m2", ...).
        Float8UsageError: (a ValueError and an AssertionError, as torchao raises) for AXISWISE scaling
            that is not DYNAMIC.
    """

    scaling_type: ScalingType = ScalingType.DYNAMIC
    scaling_granularity: ScalingGranularity = ScalingGranularity.TENSORWISE
    target_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        scaling_type = _enum(ScalingType, "scaling_type", self.scaling_type)
        granularity = _enum(ScalingGranularity, "scaling_granularity", self.scaling_granularity)
        dtype = _fp8_dtype(self.target_dtype)
        if granularity is ScalingGranularity.AXISWISE and scaling_type is not ScalingType.DYNAMIC:
            raise Float8UsageError(
                "only dynamic scaling type is supported for axiswise scaling granularity "
                f"(got scaling_type={scaling_type.name})"
            )
        object.__setattr__(self, "scaling_type", scaling_type)
        object.__setattr__(self, "scaling_granularity", granularity)
        object.__setattr__(self, "target_dtype", dtype)

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


# ---------------------------------------------------------------- the config
#: Accepted values of :class:`Float8Config`'s ``scaling``.
SCALINGS = ("dynamic", "delayed")
#: Accepted values of :class:`Float8Config`'s ``amax_compute_algo``.
AMAX_COMPUTE_ALGOS = ("max", "most_recent")
#: torchao's ``Float8LinearRecipeName`` values, accepted by :class:`Float8Config`'s ``recipe``.
RECIPE_NAMES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
#: Largest ``margin``: at 2**14 a tensor's amax still lands on a normal e4m3 value (448 / 2**14 > 2**-6);
#: beyond it every value is subnormal or zero in fp8 (at 200 the scale itself is 0 and outputs nan).
MAX_MARGIN = 14
#: Largest ``amax_history_len`` (64 times Transformer Engine's default of 1024): three float32 rows of it
#: per layer, 768 KiB.
MAX_AMAX_HISTORY_LEN = 2**16
# torchao's GEMM defaults: fast accumulation for the forward GEMM only.
_FAST_ACCUM = Float8GemmConfig(use_fast_accum=True)
_ACCURATE = Float8GemmConfig()


@dataclass(frozen=True)
class Float8Config:
    """Scaling recipe of fp8 training: e4m3 for the input and weight, e5m2 for the output gradient.

    Args:
        scaling: ``"dynamic"``: each tensor's scale is ``format max / amax`` of the tensor itself (the
            torchao recipe). ``"delayed"``: Transformer Engine's recipe, the scale comes from an amax
            history of earlier steps (``amax_history_len`` entries kept in buffers, so in ``state_dict``);
            the tensor's own amax is pushed to the history after it is used.
        amax_history_len: length of each amax history (delayed scaling only); an int in
            [1, :data:`~mixprec.float8.config.MAX_AMAX_HISTORY_LEN`].
        margin: the scale is divided by ``2**margin`` (headroom against growth between steps, as in
            Transformer Engine); an int in [0, :data:`~mixprec.float8.config.MAX_MARGIN`]. 0 keeps the
            dynamic recipe equal to torchao's.
        amax_compute_algo: how the history gives the amax a delayed scale is computed from: ``"max"``
            (the largest entry, Transformer Engine's default) or ``"most_recent"`` (the last step's).
        emulate: True computes the matmuls as float32 matmuls of the dequantized fp8 values (torchao's
            ``emulate=True``) instead of ``torch._scaled_mm``; the values are the same up to the order
            of accumulation. False uses ``torch._scaled_mm`` (CPU in torch >= 2.13, Hopper-class GPUs) and
            falls back to emulation for shapes it rejects (on CUDA: a reduction dimension or output
            width not a multiple of 16).
        recipe: torchao's recipe names: ``"tensorwise"`` (one scale per tensor, the scalings above),
            ``"rowwise"`` (one scale per row along each GEMM's reduction dim, e4m3 everywhere) or
            ``"rowwise_with_gw_hp"`` (rowwise forward, weight-gradient GEMM in high precision); the rowwise
            recipes are :mod:`mixprec.lowbit`'s ``fp8_rowwise`` / ``fp8_rowwise_gw_hp`` and dynamic only.
        round_scales_to_power_of_2: round every scale down to a power of two (torchao's flag; its rowwise
            recipes set it, and ``from_recipe_name`` does too).
        enable_fsdp_float8_all_gather: FSDP2 (``fully_shard``) all-gathers the weights in e4m3 with the
            whole weight's scale, half the bytes of a bf16 all-gather (torchao's flag;
            ``mixprec.float8.fsdp``); tensorwise dynamic scaling only.

    torchao's per-operand fields (``torchao.float8.Float8LinearConfig``'s names and defaults; torchao's own
    :class:`CastConfig` / :class:`Float8GemmConfig` objects are accepted too):

    Args:
        cast_config_input, cast_config_weight, cast_config_grad_output: how each tensor is cast for its
            first GEMM (output, output, grad_input); None takes ``recipe``'s (``"tensorwise"``: dynamic
            tensorwise, e4m3 / e4m3 / e5m2). ``ScalingType.DISABLED`` leaves the operand in high precision.
        cast_config_input_for_grad_weight: the input's second use (the grad_weight GEMM); None takes
            ``recipe``'s, else the first use's, as torchao. After construction all six are resolved
            :class:`CastConfig` values with a ``target_dtype``, so ``dataclasses.replace(config,
            recipe=...)`` keeps them: use :meth:`from_recipe_name`.
        cast_config_weight_for_grad_input: the weight's second use (the grad_input GEMM), likewise.
        cast_config_grad_output_for_grad_weight: the output gradient's second use (the grad_weight GEMM),
            likewise.
        gemm_config_output, gemm_config_grad_input, gemm_config_grad_weight: each GEMM's
            :class:`Float8GemmConfig`; ``use_fast_accum`` (default True for output, as torchao) is passed to
            ``torch._scaled_mm`` and has no effect on the emulated GEMMs (the CPU emulation included).
        pad_inner_dim: zero-pad each fp8 GEMM's reduction dimension to a multiple of 16 (after the cast,
            so the scales are the unpadded tensor's), which CUDA's ``torch._scaled_mm`` needs; the result is
            the same up to the order of accumulation.

    A config is a torchao-compatible way to write a :class:`~mixprec.lowbit.Recipe`, the one
    configuration the :mod:`mixprec.lowbit` engine runs, built once, field by field (no recipe text), as
    :attr:`resolved_lowbit_recipe`: a config that is dynamic tensorwise in all six casts at their default
    dtypes gives a recipe whose ``scaling`` is a :class:`~mixprec.lowbit.history.TensorScaling` (each
    tensor cast once; ``scaling``, ``margin`` and ``amax_compute_algo`` are its data), any other a
    per-operand recipe (per-row scales, high-precision operands). The CPU runs torch's tensorwise fp8
    kernel and emulates the rest (``mixprec.lowbit.kernels.CPU_RULE``).

    Raises:
        ValueError: for a ``scaling`` or ``amax_compute_algo`` outside the accepted names, an
            ``amax_history_len`` or ``margin`` outside its range, ``scaling="delayed"`` or a ``margin``
            with casts that are not all dynamic tensorwise at their default dtypes, or
            ``enable_fsdp_float8_all_gather`` with such casts or delayed scaling.
        Float8UsageError: (a ValueError, and the AssertionError torchao raises for the same configs) when
            one operand of a GEMM is DISABLED and the other is not ("incompatible operand precision for
            output"), or one tensor is cast to two fp8 dtypes in its two GEMMs.
        TypeError: for a field of the wrong type (``amax_history_len=2.5``, ``emulate="yes"``,
            ``cast_config_input="dynamic"``).
    """

    scaling: str = "dynamic"
    amax_history_len: int = 16
    margin: int = 0
    amax_compute_algo: str = "max"
    emulate: bool = False
    recipe: str = "tensorwise"
    round_scales_to_power_of_2: bool = False
    # torchao's per-operand cast configs, per-GEMM configs and padding (resolved in __post_init__).
    cast_config_input: CastConfig | None = None
    cast_config_input_for_grad_weight: CastConfig | None = None
    cast_config_weight: CastConfig | None = None
    cast_config_weight_for_grad_input: CastConfig | None = None
    cast_config_grad_output: CastConfig | None = None
    cast_config_grad_output_for_grad_weight: CastConfig | None = None
    gemm_config_output: Float8GemmConfig = _FAST_ACCUM
    gemm_config_grad_input: Float8GemmConfig = _ACCURATE
    gemm_config_grad_weight: Float8GemmConfig = _ACCURATE
    pad_inner_dim: bool = False
    enable_fsdp_float8_all_gather: bool = False
    # Set per instance by __post_init__; ClassVar keeps it out of the fields (eq, hash, repr, replace).
    _engine: ClassVar[_Engine]

    def __post_init__(self) -> None:
        _check_choice("scaling", self.scaling, SCALINGS)
        _check_choice("amax_compute_algo", self.amax_compute_algo, AMAX_COMPUTE_ALGOS)
        _check_int("amax_history_len", self.amax_history_len, minimum=1, maximum=MAX_AMAX_HISTORY_LEN)
        _check_int("margin", self.margin, minimum=0, maximum=MAX_MARGIN)
        if not isinstance(self.emulate, bool):
            raise TypeError(f"emulate must be a bool, got {type(self.emulate).__name__}: {self.emulate!r}")
        _check_choice("recipe", self.recipe, RECIPE_NAMES)
        if not isinstance(self.round_scales_to_power_of_2, bool):
            raise TypeError(
                f"round_scales_to_power_of_2 must be a bool, got {self.round_scales_to_power_of_2!r}"
            )
        resolved = _resolve_operands(self)  # validates all before any field is written
        if self.delayed and not _all_tensorwise(resolved):
            raise ValueError(
                f"recipe {self.recipe!r} with these cast configs scales dynamically; scaling='delayed' needs "
                "'tensorwise' and every cast dynamic tensorwise at its default dtype"
            )
        _check_fsdp_float8_all_gather(self, resolved)
        for name, value in resolved.items():
            object.__setattr__(self, name, value)
        # What the engine reads at every forward, resolved here, once, from the frozen fields: a compiled
        # forward then reads plain attributes (a lazy cached_property is traced by torch.compile, and its
        # RLock, on Python < 3.12, breaks the graph).
        object.__setattr__(self, "_engine", _resolve_engine(self))

    @classmethod
    def from_recipe_name(cls, recipe_name: str, **overrides: Any) -> Float8Config:
        """torchao's ``Float8LinearConfig.from_recipe_name``: the config of a named recipe.

        ``"tensorwise"`` is the default config; the rowwise recipes set ``round_scales_to_power_of_2``.

        Raises:
            Float8UsageError: (a ValueError and an AssertionError, as torchao raises) for a name outside
                :data:`~mixprec.float8.config.RECIPE_NAMES`.
        """
        name = getattr(recipe_name, "value", recipe_name)
        if not isinstance(name, str) or name not in RECIPE_NAMES:
            raise Float8UsageError(
                f"recipe_name must be one of {', '.join(map(repr, RECIPE_NAMES))}; got {recipe_name!r}"
            )
        # Any: the fields and overrides are checked by __post_init__, not by their static types.
        fields: dict[str, Any] = {"recipe": name, "round_scales_to_power_of_2": name != "tensorwise"}
        return cls(**{**fields, **overrides})

    @property
    def lowbit_recipe(self) -> str | None:
        """The operands of the per-operand :mod:`mixprec.lowbit` recipe this config runs, as text
        (``fprop=input,weight dgrad=grad_output,weight_for_grad_input
        wgrad=grad_output_for_grad_weight,input_for_grad_weight``: :meth:`Recipe.operands_str
        <mixprec.lowbit.Recipe.operands_str>` of :attr:`resolved_lowbit_recipe`), or None when every cast
        is dynamic tensorwise at its default dtype (a per-tensor recipe, :attr:`tensor_scaling`)."""
        recipe = self._engine.recipe
        return None if recipe.scaling is not None else recipe.operands_str()

    @property
    def resolved_lowbit_recipe(self) -> Recipe:
        """The :class:`~mixprec.lowbit.Recipe` the engine runs, built from the fields once, when the
        config is built (the config is frozen): its ``scaling`` is :attr:`tensor_scaling`."""
        return self._engine.recipe

    @property
    def tensor_scaling(self) -> TensorScaling | None:
        """The engine's per-tensor scaling (delayed or dynamic, with the margin) for a config whose six
        casts are dynamic tensorwise at their default dtypes; None for per-operand recipes."""
        return self._engine.recipe.scaling

    @property
    def gemm_options(self) -> tuple[GemmOptions, GemmOptions, GemmOptions]:
        """The engine's fprop, dgrad, wgrad :class:`~mixprec.lowbit.gemm.GemmOptions`: torchao's
        ``emulate`` (False: torch's kernel wherever it has one, the CPU's included), fast accumulation
        and padding."""
        return self._engine.gemm_options

    @property
    def linear_mm_config(self) -> LinearMMConfig:
        """The GEMMs' settings in torchao's ``LinearMMConfig`` form (output, grad_input, grad_weight),
        built once per config (frozen) rather than at every GEMM."""
        return self._engine.linear_mm_config

    def cast_configs_str(self) -> str:
        """torchao's repr of the casts: ``"i:dyn_ten_e4m3,w:dyn_ten_e4m3,go:dyn_ten_e5m2"``, with
        ``i_gw`` / ``w_gi`` / ``go_gw`` parts where a second use differs from the first."""
        parts = [f"{short}:{getattr(self, name).short_str()}" for short, name in _SHORT.items()]
        for short, name, first in _SECOND_USE:
            if getattr(self, name) != getattr(self, first):
                parts.append(f"{short}:{getattr(self, name).short_str()}")
        return ",".join(parts)

    @property
    def delayed(self) -> bool:
        """Whether this is the delayed (amax history) recipe."""
        return self.scaling == "delayed"

    def short_str(self) -> str:
        """A one-line summary for a module's repr: ``"dynamic"``, ``"delayed(len=16,max,margin=0)"``,
        ``"rowwise"``, or ``"casts"`` for per-operand casts that are not a named recipe's."""
        if not self.delayed:
            text = "dynamic" if self.margin == 0 else f"dynamic(margin={self.margin})"
        else:
            text = f"delayed(len={self.amax_history_len},{self.amax_compute_algo},margin={self.margin})"
        if self.lowbit_recipe is not None:
            preset = Float8Config(recipe=self.recipe)
            text = self.recipe if all(getattr(self, n) == getattr(preset, n) for n in _OPERANDS) else "casts"
        text += ",pow2" if self.round_scales_to_power_of_2 else ""
        text += ",fsdp_fp8_all_gather" if self.enable_fsdp_float8_all_gather else ""
        return text + (",emulate" if self.emulate else "")


#: torchao's class name for the config.
Float8LinearConfig = Float8Config

_E4M3, _E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
#: The six cast-config fields with their default dtypes, first uses first.
_DEFAULT_DTYPES = {
    "cast_config_input": _E4M3,
    "cast_config_weight": _E4M3,
    "cast_config_grad_output": _E5M2,
    "cast_config_input_for_grad_weight": _E4M3,
    "cast_config_weight_for_grad_input": _E4M3,
    "cast_config_grad_output_for_grad_weight": _E5M2,
}
_OPERANDS = tuple(_DEFAULT_DTYPES)
_SHORT = {"i": "cast_config_input", "w": "cast_config_weight", "go": "cast_config_grad_output"}
_SECOND_USE = (
    ("i_gw", "cast_config_input_for_grad_weight", "cast_config_input"),
    ("w_gi", "cast_config_weight_for_grad_input", "cast_config_weight"),
    ("go_gw", "cast_config_grad_output_for_grad_weight", "cast_config_grad_output"),
)
#: The two operands of each GEMM, named as torchao names the GEMM.
_GEMM_OPERANDS = (
    ("output", "cast_config_input", "cast_config_weight"),
    ("grad_input", "cast_config_grad_output", "cast_config_weight_for_grad_input"),
    ("grad_weight", "cast_config_input_for_grad_weight", "cast_config_grad_output_for_grad_weight"),
)
_GEMM_FIELDS = ("gemm_config_output", "gemm_config_grad_input", "gemm_config_grad_weight")


def _gemm_options(mm: ScaledMMConfig) -> GemmOptions:
    return GemmOptions(mm.emulate, mm.use_fast_accum, mm.pad_inner_dim)


class _Engine(NamedTuple):
    """A config's values as the engine reads them (immutable and hashable, as the config is)."""

    recipe: Recipe
    gemm_options: tuple[GemmOptions, GemmOptions, GemmOptions]
    linear_mm_config: LinearMMConfig


def _resolve_engine(config: Float8Config) -> _Engine:
    gemms = (config.gemm_config_output, config.gemm_config_grad_input, config.gemm_config_grad_weight)
    mm = LinearMMConfig(
        *(ScaledMMConfig(config.emulate, g.use_fast_accum, False, config.pad_inner_dim) for g in gemms)
    )
    options = (_gemm_options(mm.output), _gemm_options(mm.grad_input), _gemm_options(mm.grad_weight))
    return _Engine(_recipe(config), options, mm)


def _recipe(config: Float8Config) -> Recipe:
    """The :class:`~mixprec.lowbit.Recipe` of ``config``'s resolved casts, operand by operand."""
    casts = {n: getattr(config, n) for n in _OPERANDS}
    scaling = None
    if _all_tensorwise(casts):  # one scale per tensor: cast once, dynamic or delayed
        scaling = TensorScaling(config.delayed, config.margin, config.amax_compute_algo)
    fmt = {n: lowbit_format(cast, config.round_scales_to_power_of_2) for n, cast in casts.items()}
    return Recipe(
        fprop_x=fmt["cast_config_input"],
        fprop_w=fmt["cast_config_weight"],
        dgrad_go=fmt["cast_config_grad_output"],
        dgrad_w=fmt["cast_config_weight_for_grad_input"],
        wgrad_go=fmt["cast_config_grad_output_for_grad_weight"],
        wgrad_x=fmt["cast_config_input_for_grad_weight"],
        scaling=scaling,
    )


def _resolve_operands(config: Float8Config) -> dict[str, CastConfig | Float8GemmConfig]:
    """The resolved cast and GEMM config fields of ``config``, validated as torchao validates them."""
    preset = recipe_casts(config.recipe)
    casts: dict[str, CastConfig] = {}
    for name in _SHORT.values():
        value = getattr(config, name)
        casts[name] = CastConfig.of(
            preset.get(name, CastConfig()) if value is None else value, name, _DEFAULT_DTYPES[name]
        )
    for _, name, first in _SECOND_USE:
        value = getattr(config, name)
        value = preset.get(name, casts[first]) if value is None else value
        casts[name] = CastConfig.of(value, name, _DEFAULT_DTYPES[name])
    for gemm, a, b in _GEMM_OPERANDS:
        if casts[a].disabled != casts[b].disabled:
            raise Float8UsageError(
                f"incompatible operand precision for {gemm}: {a} is {casts[a].scaling_type.name} and {b} is "
                f"{casts[b].scaling_type.name}; a GEMM's two operands are both fp8 or both DISABLED"
            )
    for _, second, first in _SECOND_USE:
        if casts[first].target_dtype != casts[second].target_dtype:
            raise Float8UsageError(
                f"{first.removeprefix('cast_config_')} must be cast to the same dtype in both matmuls it's "
                f"used in: {first} has {casts[first].target_dtype}, {second} {casts[second].target_dtype}"
            )
    out: dict[str, CastConfig | Float8GemmConfig] = dict(casts)
    for name in _GEMM_FIELDS:
        out[name] = Float8GemmConfig.of(getattr(config, name), name)
    if not isinstance(config.pad_inner_dim, bool):
        raise TypeError(f"pad_inner_dim must be a bool, got {config.pad_inner_dim!r}")
    if config.margin and not _all_tensorwise(out):
        raise ValueError(f"margin={config.margin} applies to the tensorwise casts only; these are not")
    return out


def _check_fsdp_float8_all_gather(config: Float8Config, resolved: Mapping[str, object]) -> None:
    # The fp8 all-gather casts each weight shard to e4m3 with the whole weight's current amax: it needs
    # mixprec.float8's own dynamic tensorwise casts.
    flag = config.enable_fsdp_float8_all_gather
    if not isinstance(flag, bool):
        raise TypeError(f"enable_fsdp_float8_all_gather must be a bool, got {flag!r}")
    if flag and (config.delayed or not _all_tensorwise(resolved)):
        raise ValueError(
            "enable_fsdp_float8_all_gather=True needs scaling='dynamic' and every cast dynamic tensorwise "
            f"at its default dtype (recipe 'tensorwise'), got recipe={config.recipe!r}, "
            f"scaling={config.scaling!r}"
        )


def _all_tensorwise(resolved: Mapping[str, object]) -> bool:
    """Whether all six casts are dynamic tensorwise at their default dtypes."""
    return all(resolved[name] == CastConfig(target_dtype=dtype) for name, dtype in _DEFAULT_DTYPES.items())


def _check_choice(name: str, value: object, accepted: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in accepted:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, accepted))}; got {value!r}")


def _check_int(name: str, value: object, minimum: int, maximum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}: {value!r}")
    if not minimum <= value <= maximum:
        raise ValueError(f"{name} must be an int in [{minimum}, {maximum}], got {value}")
