"""`Float8Config`: how a :class:`~mixprec.float8.Float8Linear` scales its tensors to fp8.

A frozen, hashable value (``torch.compile`` treats it as a constant). Every field is validated in the
constructor, and an error names the field and what it accepts.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "AMAX_COMPUTE_ALGOS",
    "MAX_AMAX_HISTORY_LEN",
    "MAX_MARGIN",
    "RECIPE_NAMES",
    "SCALINGS",
    "Float8Config",
]

#: Accepted values of :attr:`Float8Config.scaling`.
SCALINGS = ("dynamic", "delayed")
#: Accepted values of :attr:`Float8Config.amax_compute_algo`.
AMAX_COMPUTE_ALGOS = ("max", "most_recent")
#: torchao's ``Float8LinearRecipeName`` values, accepted by :attr:`Float8Config.recipe`.
RECIPE_NAMES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
#: Largest ``margin``: at 2**14 a tensor's amax still lands on a normal e4m3 value (448 / 2**14 > 2**-6);
#: beyond it every value is subnormal or zero in fp8 (at 200 the scale itself is 0 and outputs nan).
MAX_MARGIN = 14
#: Largest ``amax_history_len`` (64 times Transformer Engine's default of 1024): three float32 rows of it
#: per layer, 768 KiB.
MAX_AMAX_HISTORY_LEN = 2**16


@dataclass(frozen=True)
class Float8Config:
    """Scaling recipe of fp8 training: e4m3 for the input and weight, e5m2 for the output gradient.

    Args:
        scaling: ``"dynamic"``: each tensor's scale is ``format max / amax`` of the tensor itself (the
            torchao recipe). ``"delayed"``: Transformer Engine's recipe, the scale comes from an amax
            history of earlier steps (``amax_history_len`` entries kept in buffers, so in ``state_dict``);
            the tensor's own amax is pushed to the history after it is used.
        amax_history_len: length of each amax history (delayed scaling only); an int in
            [1, :data:`MAX_AMAX_HISTORY_LEN`].
        margin: the scale is divided by ``2**margin`` (headroom against growth between steps, as in
            Transformer Engine); an int in [0, :data:`MAX_MARGIN`]. 0 keeps the dynamic recipe equal to
            torchao's.
        amax_compute_algo: how the history gives the amax a delayed scale is computed from: ``"max"``
            (the largest entry, Transformer Engine's default) or ``"most_recent"`` (the last step's).
        emulate: True computes the matmuls as float32 matmuls of the dequantized fp8 values (torchao's
            ``emulate=True``) instead of ``torch._scaled_mm``; the values are the same up to the order
            of accumulation. False uses ``torch._scaled_mm`` (CPU in torch >= 2.13, Hopper-class GPUs) and
            falls back to emulation for shapes it rejects (on CUDA: dimensions not multiples of 16).
        recipe: torchao's recipe names: ``"tensorwise"`` (one scale per tensor, the scalings above),
            ``"rowwise"`` (one scale per row along each GEMM's reduction dim, e4m3 everywhere) or
            ``"rowwise_with_gw_hp"`` (rowwise forward, weight-gradient GEMM in high precision); the rowwise
            recipes are :mod:`mixprec.lowbit`'s ``fp8_rowwise`` / ``fp8_rowwise_gw_hp`` and dynamic only.
        round_scales_to_power_of_2: round every scale down to a power of two (torchao's flag; its rowwise
            recipes set it, and ``from_recipe_name`` does too).
        enable_fsdp_float8_all_gather: FSDP2 (``fully_shard``) all-gathers the weights in e4m3 with the
            whole weight's scale, half the bytes of a bf16 all-gather (torchao's flag;
            :mod:`mixprec.float8.fsdp`); tensorwise dynamic scaling only.

    Raises:
        ValueError: for a ``scaling`` or ``amax_compute_algo`` outside the accepted names, an
            ``amax_history_len`` or ``margin`` outside its range, ``enable_fsdp_float8_all_gather``
            with a delayed or rowwise recipe.
        TypeError: for a field of the wrong type (``amax_history_len=2.5``, ``emulate="yes"``).
    """

    scaling: str = "dynamic"
    amax_history_len: int = 16
    margin: int = 0
    amax_compute_algo: str = "max"
    emulate: bool = False
    recipe: str = "tensorwise"
    round_scales_to_power_of_2: bool = False
    enable_fsdp_float8_all_gather: bool = False

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
        if self.recipe != "tensorwise" and self.delayed:
            raise ValueError(
                f"recipe {self.recipe!r} scales dynamically; scaling='delayed' needs 'tensorwise'"
            )
        self._check_fsdp_float8_all_gather()

    def _check_fsdp_float8_all_gather(self) -> None:
        # The fp8 all-gather casts each shard with the whole weight's current amax: tensorwise, dynamic.
        flag = self.enable_fsdp_float8_all_gather
        if not isinstance(flag, bool):
            raise TypeError(f"enable_fsdp_float8_all_gather must be a bool, got {flag!r}")
        if flag and (self.delayed or self.recipe != "tensorwise"):
            raise ValueError(
                "enable_fsdp_float8_all_gather=True needs recipe='tensorwise' and scaling='dynamic', "
                f"got recipe={self.recipe!r}, scaling={self.scaling!r}"
            )

    @classmethod
    def from_recipe_name(cls, recipe_name: str, **overrides: object) -> Float8Config:
        """torchao's ``Float8LinearConfig.from_recipe_name``: the config of a named recipe.

        ``"tensorwise"`` is the default config; the rowwise recipes set ``round_scales_to_power_of_2``.

        Raises:
            ValueError: for a name outside :data:`RECIPE_NAMES`.
        """
        _check_choice("recipe_name", getattr(recipe_name, "value", recipe_name), RECIPE_NAMES)
        name = getattr(recipe_name, "value", recipe_name)
        fields = {"recipe": name, "round_scales_to_power_of_2": name != "tensorwise"}
        return cls(**{**fields, **overrides})

    @property
    def lowbit_recipe(self) -> str | None:
        """The :mod:`mixprec.lowbit` recipe a rowwise config runs, or None for tensorwise."""
        if self.recipe == "tensorwise":
            return None
        pow2 = self.round_scales_to_power_of_2
        row = "fp8_rowwise" if pow2 else "fp8_rowwise_fp32"
        if self.recipe == "rowwise":
            return f"fprop={row},{row} dgrad={row},{row} wgrad={row},{row}"
        w_gi = "fp8_tensorwise_pow2" if pow2 else "fp8_tensorwise"
        return f"fprop={row},{row} dgrad={row},{w_gi} wgrad=hp,hp"

    @property
    def delayed(self) -> bool:
        """Whether this is the delayed (amax history) recipe."""
        return self.scaling == "delayed"

    def short_str(self) -> str:
        """A one-line summary for a module's repr: ``"dynamic"``, ``"delayed(len=16,max,margin=0)"``."""
        if not self.delayed:
            text = "dynamic" if self.margin == 0 else f"dynamic(margin={self.margin})"
        else:
            text = f"delayed(len={self.amax_history_len},{self.amax_compute_algo},margin={self.margin})"
        if self.recipe != "tensorwise":
            text = self.recipe
        text += ",pow2" if self.round_scales_to_power_of_2 else ""
        text += ",fsdp_fp8_all_gather" if self.enable_fsdp_float8_all_gather else ""
        return text + (",emulate" if self.emulate else "")


def _check_choice(name: str, value: object, accepted: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in accepted:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, accepted))}; got {value!r}")


def _check_int(name: str, value: object, minimum: int, maximum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}: {value!r}")
    if not minimum <= value <= maximum:
        raise ValueError(f"{name} must be an int in [{minimum}, {maximum}], got {value}")
