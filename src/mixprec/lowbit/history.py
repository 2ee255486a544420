"""Per-tensor fp8 scaling, the engine's tensorwise feature: amax, scale, saturating cast, amax history.

:class:`TensorScaling` is how a tensorwise layer (a :class:`~mixprec.float8.Float8Linear`) scales its
three tensors, dynamically or from an amax history, and :class:`~mixprec.lowbit.gemm.LowbitLinearFunction`
applies it: a :class:`~mixprec.lowbit.Recipe` whose ``scaling`` is one runs it. The block formats' scale
math is :mod:`mixprec.lowbit.block_scales`.

Conventions (torchao's and Transformer Engine's): a *scale* multiplies a high-precision tensor into the
fp8 range, ``x_fp8 = saturate(x * scale)``, and ``x ~ x_fp8 / scale``. The scale of a tensor whose
absolute maximum is ``amax`` is ``format.max / amax / 2**margin``, so the largest value lands on the
format's largest finite value (448 for e4m3fn, 57344 for e5m2, from :mod:`mixprec.formats`).

Delayed scaling (Transformer Engine, ``DelayedScaling`` recipe)::

    history: float32[L], newest first, zeros at the start
    at each use of a tensor x:
        amax   = max|x|
        past   = max(history)  (or history[0] for amax_compute_algo="most_recent")
        scale  = format.max / (past if past > 0 else amax) / 2**margin      # first use: dynamic
        x_fp8  = saturate(x * scale)            # values beyond past * 2**margin saturate this step
        if amax is finite: history = [min(amax, max(history) * 2**8), history[0], ..., history[L-2]]
        else: scale = nan (the non-finite values reach the gradients, so a GradScaler skips the step)
                and the history is left as it was
        (an empty x has no amax: the history is left as it was)

One step's influence is bounded: the amax pushed is at most :data:`AMAX_GROWTH_LIMIT` (2**8) times the
history's largest entry (no bound while the history is all zeros). Transformer Engine pushes every
finite amax (``amax_and_scale_update`` in ``common/recipe/delayed_scaling.cu``), so one outlier input of
1e30 makes the scale ``448 / 1e30`` for ``amax_history_len`` steps: every ordinary value then rounds to
zero in fp8 and the layer gets no gradient for that long. Under the bound the layer's usual values keep
landing within e4m3's normal range (which spans about 2**15), so training goes on; a genuine jump of the
amax is followed by a factor of 256 per step (the values beyond saturate meanwhile, as the jump's own
step does under delayed scaling anyway).

Everything is tensor math without host synchronisation (``torch.where``, no ``.item()``), so it runs
under ``torch.compile`` and CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mixprec import formats

__all__ = [
    "AMAX_COMPUTE_ALGOS",
    "AMAX_GROWTH_LIMIT",
    "EPS",
    "ROLES",
    "TensorScaling",
    "amax_of",
    "amax_to_scale",
    "delayed_scale",
    "push_amax",
    "to_float8",
]

#: The tensors a linear layer scales, in the order of the rows of its amax history and stats buffers.
ROLES = ("input", "weight", "grad_output")
INPUT, WEIGHT, GRAD_OUTPUT = 0, 1, 2

#: Smallest amax a scale is computed from (torchao's value), so an all-zero tensor gets a finite scale.
EPS = 1e-12
#: Most an amax pushed to a history may exceed the history's largest entry by (see the module doc).
AMAX_GROWTH_LIMIT = 2.0**8


@torch.no_grad()
def amax_of(x: torch.Tensor) -> torch.Tensor:
    """``max|x|`` as a float32 scalar tensor (nan if ``x`` has a nan, inf if it has an inf; 0 if empty).

    On CUDA in eager mode, one fused pass (:func:`mixprec.lowbit.triton_quantize.tensor_amax`, the same
    value) where the fused kernels are eligible."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    if x.device.type == "cuda" and not torch.compiler.is_compiling():  # eager CUDA: one fused pass
        from mixprec.lowbit import triton_quantize

        if triton_quantize.fused_eligible(x, "fp8_tensorwise"):
            return triton_quantize.tensor_amax(x)
    return torch.max(torch.abs(x)).to(torch.float32)


@torch.no_grad()
def amax_to_scale(amax: torch.Tensor, fmt: formats.Format, margin: int = 0) -> torch.Tensor:
    """``fmt.max / max(amax, EPS) / 2**margin`` as a float32 scalar tensor.

    Computed in float64 and rounded once to float32, as torchao does (eager and compiled agree).
    """
    scale = (fmt.max / torch.clamp(amax.to(torch.float64), min=EPS)).to(torch.float32)
    return scale / 2.0**margin if margin else scale


@torch.no_grad()
def delayed_scale(
    history: torch.Tensor, amax: torch.Tensor, fmt: formats.Format, margin: int, algo: str
) -> torch.Tensor:
    """The delayed-scaling scale for a tensor with current ``amax``, from ``history`` (see the module doc).

    Args:
        history: float32[L] amax history, newest first.
        amax: float32 scalar, ``max|x|`` of the tensor about to be cast.
        fmt: the fp8 format the tensor is cast to.
        margin: the scale is divided by ``2**margin``.
        algo: "max" (largest entry) or "most_recent" (``history[0]``).

    Returns:
        A float32 scalar: nan when ``amax`` is not finite, so the cast result is all nan.
    """
    past = history.max() if algo == "max" else history[0]
    scale = amax_to_scale(torch.where(past > 0, past, amax), fmt, margin)
    return torch.where(torch.isfinite(amax), scale, torch.full_like(scale, float("nan")))


@torch.no_grad()
def push_amax(history: torch.Tensor, amax: torch.Tensor) -> None:
    """Push ``amax`` to the front of ``history`` in place (oldest dropped); a non-finite amax is skipped,
    and one larger than :data:`AMAX_GROWTH_LIMIT` times the history's largest entry is pushed as that."""
    past = history.max()
    bounded = torch.where(past > 0, torch.minimum(amax.to(history.dtype), past * AMAX_GROWTH_LIMIT), amax)
    shifted = torch.cat([bounded.reshape(1).to(history.dtype), history[:-1]])
    history.copy_(torch.where(torch.isfinite(amax), shifted, history))


@torch.no_grad()
def to_float8(x: torch.Tensor, scale: torch.Tensor, fmt: formats.Format) -> torch.Tensor:
    """``saturate(x * scale)`` in ``fmt``: multiplied in float32, clamped to ``±fmt.max``, cast.

    Clamping first makes e5m2 (which has inf) saturate like e4m3fn; a nan stays nan.

    Raises:
        ValueError: for a format the installed torch has no dtype for.
    """
    if fmt.dtype is None:
        raise ValueError(f"torch {torch.__version__} has no dtype for {fmt.name}")
    scaled = x.to(torch.float32) * scale
    return scaled.clamp(min=-fmt.max, max=fmt.max).to(fmt.dtype)


#: The accepted ``amax_compute_algo`` values of :class:`TensorScaling`.
AMAX_COMPUTE_ALGOS = ("max", "most_recent")


@dataclass(frozen=True)
class TensorScaling:
    """How a tensorwise recipe scales its input, weight and grad_output: each once per use, by its own
    amax (``delayed=False``, torchao's dynamic scaling) or by the amax history of earlier steps
    (``delayed=True``, Transformer Engine's ``DelayedScaling``; see the module doc), divided by
    ``2**margin``, and rounded down to a power of two where its format's scales are ``pow2``.

    It is the ``scaling`` of a :class:`~mixprec.lowbit.Recipe` (None there: each operand is quantized
    per GEMM by its format). A frozen, hashable value (``torch.compile`` treats it as a constant); the
    tensors it reads and writes (the float32[3, L] history, the float32[2, 3] last amax / scale stats) are
    the layer's buffers.

    Raises:
        TypeError: for a non-bool ``delayed`` or a non-int ``margin``.
        ValueError: for a negative ``margin`` or an ``amax_compute_algo`` other than ``"max"`` /
            ``"most_recent"``.
    """

    delayed: bool = False
    margin: int = 0
    amax_compute_algo: str = "max"

    def __post_init__(self) -> None:
        if not isinstance(self.delayed, bool):
            raise TypeError(f"delayed must be a bool, got {self.delayed!r}")
        if isinstance(self.margin, bool) or not isinstance(self.margin, int):
            raise TypeError(f"margin must be an int, got {type(self.margin).__name__}: {self.margin!r}")
        if self.margin < 0:
            raise ValueError(f"margin must be an int >= 0, got {self.margin}")
        if self.amax_compute_algo not in AMAX_COMPUTE_ALGOS:
            raise ValueError(
                f"amax_compute_algo must be one of {list(AMAX_COMPUTE_ALGOS)}, got {self.amax_compute_algo!r}"
            )

    @property
    def kind(self) -> str:
        """``"delayed"`` or ``"dynamic"``."""
        return "delayed" if self.delayed else "dynamic"

    def scale(
        self,
        role: int,
        x: torch.Tensor,
        fmt: formats.Format,
        pow2: bool,
        history: torch.Tensor | None,
        stats: torch.Tensor,
        update: bool,
    ) -> torch.Tensor:
        """The scale of ``x`` for row ``role``; records amax and scale in ``stats``, pushes the history
        when ``update`` (training)."""
        amax = amax_of(x)
        if history is None:
            scale = amax_to_scale(amax, fmt, self.margin)
        else:
            scale = delayed_scale(history[role], amax, fmt, self.margin, self.amax_compute_algo)
            if update and x.numel():  # an empty tensor says nothing about the next step's range
                push_amax(history[role], amax)
        if pow2:  # torchao's round_scales_to_power_of_2: down to a power of two (nan stays nan)
            scale = torch.exp2(torch.floor(torch.log2(scale)))
        stats[0, role] = amax
        stats[1, role] = scale
        return scale
