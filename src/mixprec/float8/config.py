"""`Float8Config`: how a :class:`~mixprec.float8.Float8Linear` scales its tensors to fp8.

A frozen, hashable value (``torch.compile`` treats it as a constant). Every field is validated in the
constructor, and an error names the field and what it accepts.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AMAX_COMPUTE_ALGOS", "MAX_AMAX_HISTORY_LEN", "MAX_MARGIN", "SCALINGS", "Float8Config"]

#: Accepted values of :attr:`Float8Config.scaling`.
SCALINGS = ("dynamic", "delayed")
#: Accepted values of :attr:`Float8Config.amax_compute_algo`.
AMAX_COMPUTE_ALGOS = ("max", "most_recent")
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

    Raises:
        ValueError: for a ``scaling`` or ``amax_compute_algo`` outside the accepted names, an
            ``amax_history_len`` or ``margin`` outside its range.
        TypeError: for a field of the wrong type (``amax_history_len=2.5``, ``emulate="yes"``).
    """

    scaling: str = "dynamic"
    amax_history_len: int = 16
    margin: int = 0
    amax_compute_algo: str = "max"
    emulate: bool = False

    def __post_init__(self) -> None:
        _check_choice("scaling", self.scaling, SCALINGS)
        _check_choice("amax_compute_algo", self.amax_compute_algo, AMAX_COMPUTE_ALGOS)
        _check_int("amax_history_len", self.amax_history_len, minimum=1, maximum=MAX_AMAX_HISTORY_LEN)
        _check_int("margin", self.margin, minimum=0, maximum=MAX_MARGIN)
        if not isinstance(self.emulate, bool):
            raise TypeError(f"emulate must be a bool, got {type(self.emulate).__name__}: {self.emulate!r}")

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
        return text + (",emulate" if self.emulate else "")


def _check_choice(name: str, value: object, accepted: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in accepted:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, accepted))}; got {value!r}")


def _check_int(name: str, value: object, minimum: int, maximum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}: {value!r}")
    if not minimum <= value <= maximum:
        raise ValueError(f"{name} must be an int in [{minimum}, {maximum}], got {value}")
