"""Recipes: which format quantizes which operand of each of a linear layer's three GEMMs.

For ``out = x @ w.T`` with ``x`` (M, K), ``w`` (N, K), the GEMMs and the axis each operand is quantized
along (the GEMM's reduction dimension, so a block never straddles two dot products)::

    fprop   out    = x  @ w.T      x along K (axis -1),   w along K (axis -1)
    dgrad   grad_x = go @ w        go along N (axis -1),  w along N (axis 0)
    wgrad   grad_w = go.T @ x      go along M (axis 0),   x along M (axis 0)

A :class:`Recipe` is the one configuration the engine runs (:class:`~mixprec.lowbit.LowbitLinear` takes
one, and :class:`~mixprec.float8.Float8Config` builds one from torchao's fields). It names a format
(:data:`mixprec.lowbit.FORMATS`) or ``"hp"`` (left in the input's precision) for each of the six operands,
plus two switches: ``sr`` (stochastic rounding of the gradient operands ``go``, NVFP4's recipe) and
``rht`` (a 16x16 random Hadamard transform along M on both wgrad operands, which cancels in the product
since it is orthogonal, NVFP4's recipe), and how the operands are scaled:

* ``scaling=None`` (every named recipe): each GEMM quantizes its two operands along its own reduction
  axis, each block scaled by its own amax (torchao's float8 and MX recipes, Transformer Engine's
  block-scaling recipes);
* ``scaling`` a :class:`~mixprec.lowbit.history.TensorScaling` (tensorwise fp8 formats only): input,
  weight and grad_output are each cast once, with one scale per tensor, dynamic (from the tensor's own
  amax, torchao's tensorwise recipe) or delayed (from an amax history of earlier steps, Transformer
  Engine's ``DelayedScaling``), divided by ``2**margin``; the layer holds the history.

The named recipes:

================== =========================================================== ========================
name               operands (fprop x/w, dgrad go/w, wgrad go/x)                source
================== =========================================================== ========================
fp8_tensorwise     e4m3/e4m3, e5m2/e4m3, e5m2/e4m3, one fp32 scale each        torchao TENSORWISE
fp8_rowwise        e4m3 rowwise with power-of-two scales everywhere            torchao ROWWISE
fp8_rowwise_gw_hp  rowwise fprop, rowwise go / tensorwise w dgrad, hp wgrad    torchao ROWWISE_WITH_GW_HP
fp8_blockwise      1x128 x and go, 128x128 w, power-of-two fp32 scales         TE Float8BlockScaling
mxfp8              e4m3, 1x32 blocks, e8m0 scales rounded up, everywhere       TE MXFP8BlockScaling
mxfp8_floor        the same with the floor rule (a block's largest saturate)   torchao MX default
mxfp4              e2m1, 1x32 blocks, e8m0 scales, everywhere                  OCP MX v1.0
nvfp4              e2m1, 1x16 e4m3 + fp32 scales; 16x16 w; sr; rht             TE NVFP4BlockScaling
================== =========================================================== ========================

``"mxfp8"`` rounds each block's e8m0 scale up, ``2**ceil(log2(amax / 448))`` (the ``mxfp8_rceil``
format, torchao's ``ScaleCalculationMode.RCEIL``), so a block's amax maps to at most 448 and nothing
saturates. That is the conversion of Mishra, Stosic, Layton and Micikevicius, "Recipes for Pre-training
LLMs with MXFP8" (arXiv:2506.08027, 2025), who found that the OCP v1.0 rule (floor, torchao's default for
``MXTensor.to_mx``) clamps each block's largest values and can make pre-training diverge, of torchao's
MXFP8 training recipes (``MXFP8TrainingRecipe``, all RCEIL) and of Transformer Engine's
``MXFP8BlockScaling`` (``float_to_e8m0(amax * max_norm_rcp)``, rounding toward +inf). ``"mxfp8_floor"``
keeps the floor rule (the ``mxfp8_floor`` format, bit for bit ``MXTensor.to_mx``'s default). So
``"mxfp8"`` means one thing: as a recipe name and a saved-activation format it rounds up; as a quantize
format it is not accepted, the format names say their rounding (``mxfp8_rceil``, ``mxfp8_floor``).

The string form round-trips: ``str(recipe)`` is the name of a named recipe it equals, else
``"fprop=A,B dgrad=C,D wgrad=E,F sr=on|off rht=on|off"`` followed, for per-tensor scaling, by
``scaling=dynamic|delayed`` and, where they are not the defaults, ``margin=N`` and ``amax=most_recent``;
:meth:`Recipe.parse` reads all of these and a name followed by overrides (``"nvfp4 rht=off"``,
``"fp8_tensorwise scaling=delayed"``).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, fields, replace
from typing import Any

from mixprec.lowbit.formats import _RENAMED, FORMATS
from mixprec.lowbit.history import AMAX_COMPUTE_ALGOS, TensorScaling

__all__ = ["HP", "OPERANDS", "RECIPES", "Recipe", "get_recipe"]

#: The name of "not quantized" (the operand stays in the input's precision).
HP = "hp"
#: The six operands of a linear layer's three GEMMs (forward, input grad, weight grad), in order.
OPERANDS = ("fprop_x", "fprop_w", "dgrad_go", "dgrad_w", "wgrad_go", "wgrad_x")
_GEMMS = {"fprop": ("fprop_x", "fprop_w"), "dgrad": ("dgrad_go", "dgrad_w"), "wgrad": ("wgrad_go", "wgrad_x")}
_SWITCHES = {"on": True, "off": False}
_SCALINGS = {"dynamic": False, "delayed": True}
#: The keys of a recipe string that set :attr:`Recipe.scaling` (``amax`` is its ``amax_compute_algo``).
_SCALING_KEYS = ("scaling", "margin", "amax")


@dataclass(frozen=True)
class Recipe:
    """A frozen per-operand recipe (see the module doc).

    Raises:
        ValueError: for an operand format that is neither ``"hp"`` nor in ``FORMATS``, ``rht`` with
            wgrad operands that are not quantized (the transform would be pure cost), or a ``scaling``
            with an operand that is not a tensorwise fp8 format, or with ``sr`` / ``rht`` on.
        TypeError: for a non-bool switch, or a ``scaling`` that is not a ``TensorScaling`` or None.
    """

    fprop_x: str
    fprop_w: str
    dgrad_go: str
    dgrad_w: str
    wgrad_go: str
    wgrad_x: str
    sr: bool = False
    rht: bool = False
    scaling: TensorScaling | None = None

    def __post_init__(self) -> None:
        for name in OPERANDS:
            value = getattr(self, name)
            if value in _RENAMED:
                raise ValueError(f"{name}={value!r}: {_RENAMED[value]}")
            if value != HP and value not in FORMATS:
                near = difflib.get_close_matches(str(value), [*FORMATS, HP], n=2)
                hint = f" (did you mean {', '.join(near)}?)" if near else ""
                raise ValueError(
                    f"{name}={value!r} is not 'hp' or a low-bit format{hint}; known: {', '.join(FORMATS)}"
                )
        for name in ("sr", "rht"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.rht and HP in (self.wgrad_go, self.wgrad_x):
            raise ValueError("rht=on needs both wgrad operands quantized (it only helps their quantization)")
        if self.scaling is not None:
            self._check_tensor_scaling()

    def _check_tensor_scaling(self) -> None:
        if not isinstance(self.scaling, TensorScaling):
            raise TypeError(f"scaling must be a TensorScaling or None, got {type(self.scaling).__name__}")
        # Each tensor is cast once and the cast serves both its GEMMs: only one scale per tensor allows it.
        wrong = [
            f"{n}={self.operand(n)}" for n in OPERANDS if self.operand(n) == HP or not _tensorwise(self, n)
        ]
        if wrong:
            raise ValueError(
                f"scaling={self.scaling.kind} casts each tensor once with one scale: every operand must be a "
                f"tensorwise fp8 format, got {', '.join(wrong)}"
            )
        if self.sr or self.rht:
            raise ValueError(f"scaling={self.scaling.kind} takes sr=off and rht=off (block-format switches)")

    def operand(self, name: str) -> str:
        """The format name of operand ``name`` (one of :data:`OPERANDS`)."""
        if name not in OPERANDS:
            raise ValueError(f"operand must be one of {list(OPERANDS)}, got {name!r}")
        return getattr(self, name)

    @property
    def name(self) -> str | None:
        """The name of the named recipe this equals, or None."""
        return next((n for n, r in RECIPES.items() if r == self), None)

    def operands_str(self) -> str:
        """The six operands' part of :meth:`full_str`: ``"fprop=A,B dgrad=C,D wgrad=E,F"``."""
        return " ".join(f"{g}={getattr(self, a)},{getattr(self, b)}" for g, (a, b) in _GEMMS.items())

    def full_str(self) -> str:
        """Every field as :meth:`parse` reads it, the operands, the switches and a per-tensor scaling."""
        text = f"{self.operands_str()} sr={'on' if self.sr else 'off'} rht={'on' if self.rht else 'off'}"
        if self.scaling is not None:
            text += f" scaling={self.scaling.kind}"
            text += f" margin={self.scaling.margin}" if self.scaling.margin else ""
            text += (
                f" amax={self.scaling.amax_compute_algo}" if self.scaling.amax_compute_algo != "max" else ""
            )
        return text

    def __str__(self) -> str:
        return self.name or self.full_str()

    def with_(self, **changes: Any) -> Recipe:
        """A copy with fields changed (validated as the constructor does)."""
        known = {f.name for f in fields(self)}
        bad = sorted(set(changes) - known)
        if bad:
            raise ValueError(f"unknown recipe field(s) {bad}; fields: {sorted(known)}")
        return replace(self, **changes)

    @classmethod
    def parse(cls, text: str) -> Recipe:
        """The recipe a string names (see the module doc).

        Raises:
            ValueError: naming the token that is not a recipe name, a ``key=value`` pair or a known key.
            TypeError: for a non-string.
        """
        if not isinstance(text, str):
            raise TypeError(f"a recipe string must be a str, got {type(text).__name__}")
        tokens = text.split()
        if not tokens:
            raise ValueError("empty recipe string; give a name or fprop=.. dgrad=.. wgrad=..")
        # Any: each value's type is checked by __post_init__ (a str format or a bool switch), not statically.
        base: Recipe | None = None
        changes: dict[str, Any] = {}
        scaling: dict[str, str] = {}
        if "=" not in tokens[0]:
            base = get_recipe(tokens[0])
            tokens = tokens[1:]
        for token in tokens:
            key, sep, value = token.partition("=")
            if not sep:
                raise ValueError(f"recipe token {token!r} is not key=value (in {text!r})")
            if key in _SCALING_KEYS:
                scaling[key] = value
            else:
                changes.update(_parse_pair(key, value, text))
        if scaling:
            changes["scaling"] = _parse_scaling(scaling, text)
        if base is not None:
            return base.with_(**changes)
        missing = [o for o in OPERANDS if o not in changes]
        if missing:
            raise ValueError(
                f"recipe {text!r} without a name must give fprop, dgrad and wgrad (missing {missing})"
            )
        return cls(**changes)


def _parse_pair(key: str, value: str, text: str) -> dict[str, object]:
    if key in _GEMMS:
        parts = value.split(",")
        if len(parts) != 2:
            raise ValueError(f"{key}={value!r} needs two formats A,B (in {text!r})")
        return dict(zip(_GEMMS[key], parts, strict=True))
    if key in ("sr", "rht"):
        if value not in _SWITCHES:
            raise ValueError(f"{key}={value!r} must be on or off (in {text!r})")
        return {key: _SWITCHES[value]}
    if key in OPERANDS:
        return {key: value}
    raise ValueError(
        f"unknown recipe key {key!r} in {text!r}; keys: fprop, dgrad, wgrad, sr, rht, scaling, margin, amax, "
        f"{', '.join(OPERANDS)}"
    )


def _parse_scaling(pairs: dict[str, str], text: str) -> TensorScaling:
    kind = pairs.get("scaling")
    if kind not in _SCALINGS:
        given = f"scaling={kind!r}" if kind is not None else "margin= or amax= without scaling="
        raise ValueError(f"{given} in {text!r}: per-tensor scaling is scaling=dynamic or scaling=delayed")
    margin = pairs.get("margin", "0")
    if not margin.isdigit():
        raise ValueError(f"margin={margin!r} must be an int >= 0 (in {text!r})")
    algo = pairs.get("amax", "max")
    if algo not in AMAX_COMPUTE_ALGOS:
        raise ValueError(f"amax={algo!r} must be one of {', '.join(AMAX_COMPUTE_ALGOS)} (in {text!r})")
    return TensorScaling(_SCALINGS[kind], int(margin), algo)


def _tensorwise(recipe: Recipe, operand: str) -> bool:
    return FORMATS[getattr(recipe, operand)].is_tensorwise


def _same(fmt: str) -> Recipe:
    return Recipe(fmt, fmt, fmt, fmt, fmt, fmt)


#: The named recipes, a format per GEMM operand each.
RECIPES: dict[str, Recipe] = {
    "fp8_tensorwise": Recipe(
        "fp8_tensorwise",
        "fp8_tensorwise",
        "fp8_tensorwise_e5m2",
        "fp8_tensorwise",
        "fp8_tensorwise_e5m2",
        "fp8_tensorwise",
    ),
    "fp8_rowwise": _same("fp8_rowwise"),
    "fp8_rowwise_gw_hp": Recipe("fp8_rowwise", "fp8_rowwise", "fp8_rowwise", "fp8_tensorwise_pow2", HP, HP),
    "fp8_blockwise": Recipe(
        "fp8_blockwise",
        "fp8_blockwise_2d",
        "fp8_blockwise",
        "fp8_blockwise_2d",
        "fp8_blockwise",
        "fp8_blockwise",
    ),
    "mxfp8": _same("mxfp8_rceil"),
    "mxfp8_floor": _same("mxfp8_floor"),
    "mxfp4": _same("mxfp4"),
    "nvfp4": Recipe("nvfp4", "nvfp4_2d", "nvfp4", "nvfp4_2d", "nvfp4", "nvfp4", sr=True, rht=True),
}


def get_recipe(recipe: Recipe | str) -> Recipe:
    """The :class:`Recipe` for a name, a recipe string, or the value itself.

    Raises:
        ValueError: for an unknown name (with the closest names) or a malformed string.
        TypeError: for anything else.
    """
    if isinstance(recipe, Recipe):
        return recipe
    if not isinstance(recipe, str):
        raise TypeError(
            f"recipe must be a mixprec.lowbit.Recipe or a recipe string, got {type(recipe).__name__}"
        )
    if recipe in RECIPES:
        return RECIPES[recipe]
    if " " in recipe.strip() or "=" in recipe:
        return Recipe.parse(recipe)
    near = difflib.get_close_matches(recipe, RECIPES, n=3)
    hint = f" (did you mean {', '.join(near)}?)" if near else ""
    raise ValueError(f"unknown low-bit recipe {recipe!r}{hint}; named recipes: {', '.join(RECIPES)}")
