"""`UnderflowReport`: the result of :func:`mixprec.inspect.underflow_report`, with the scale it suggests."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from mixprec import formats
from mixprec.inspect._modules import display_name
from mixprec.inspect.summaries import GradStats, Log2Histogram

__all__ = ["UnderflowReport", "format_scale"]

_KINDS = ("all", "activation", "parameter")


def format_scale(scale: float) -> str:
    """``2^16`` for a power of two, else the number."""
    if scale > 0 and math.isfinite(scale):
        exponent = math.log2(scale)
        if exponent == int(exponent):
            return f"2^{int(exponent)}"
    return f"{scale:g}"


@dataclass(frozen=True)
class UnderflowReport:
    """Gradient underflow per module at one loss scale, and the scale that would avoid it.

    Attributes:
        format: the low-precision format judged against.
        scale: the loss scale the per-module figures are for.
        activations: leaf module name -> stats of the gradients of its outputs.
        parameters: module name -> stats of the gradients of its own parameters.
        activation_histogram: ``floor(log2|g|)`` counts of all activation gradients (unscaled).
        parameter_histogram: the same for parameter gradients.
        target: underflow fraction the recommended scale must stay under.
        margin: headroom below the format's max that the recommended scale keeps.
    """

    format: formats.Format
    scale: float
    activations: dict[str, GradStats]
    parameters: dict[str, GradStats]
    activation_histogram: Log2Histogram
    parameter_histogram: Log2Histogram
    target: float = 1e-3
    margin: float = 2.0

    @property
    def overall_activations(self) -> GradStats:
        """All activation gradients together."""
        return sum(self.activations.values(), GradStats())

    @property
    def overall_parameters(self) -> GradStats:
        """All parameter gradients together."""
        return sum(self.parameters.values(), GradStats())

    @property
    def overall(self) -> GradStats:
        """Activation and parameter gradients together."""
        return self.overall_activations + self.overall_parameters

    def _histogram(self, kind: str) -> Log2Histogram:
        if kind not in _KINDS:
            raise ValueError(f"kind must be one of {_KINDS}, got {kind!r}")
        if kind == "activation":
            return self.activation_histogram
        if kind == "parameter":
            return self.parameter_histogram
        return self.activation_histogram.merged(self.parameter_histogram)

    def underflow_at(self, scale: float, kind: str = "all") -> float:
        """Fraction of ``kind`` gradients zero or subnormal at ``scale`` (exact for powers of 2)."""
        histogram = self._histogram(kind)
        below = histogram.count_below(math.log2(self.format.smallest_normal) - math.log2(scale))
        return below / histogram.total if histogram.total else 0.0

    def flushed_at(self, scale: float, kind: str = "all") -> float:
        """Fraction of ``kind`` gradients that would become zero at ``scale`` (exact for powers of 2)."""
        histogram = self._histogram(kind)
        below = histogram.count_below(math.log2(self.format.smallest_subnormal / 2) - math.log2(scale))
        return below / histogram.total if histogram.total else 0.0

    @property
    def max_safe_scale(self) -> float:
        """Largest power of two keeping ``max|g| * scale * margin`` within the format (inf: no grads)."""
        return formats.max_safe_scale(self.overall.amax, self.format, self.margin)

    @functools.cached_property
    def recommended_scale(self) -> float | None:
        """Smallest power of two >= 1 with underflow <= target and no overflow, or None when none exists."""
        limit = self.max_safe_scale
        for exponent in range(0, 128):
            scale = 2.0**exponent
            if scale > limit:
                return None
            if self.underflow_at(scale) <= self.target:
                return scale
        return None

    def __str__(self) -> str:
        act, par, fmt = self.overall_activations, self.overall_parameters, self.format.name
        head = (
            f"At loss scale {format_scale(self.scale)}, {act.underflow:.1%} of activation gradients and "
            f"{par.underflow:.1%} of parameter gradients would be zero or subnormal in {fmt} "
            f"({act.flushed_fraction:.1%} and {par.flushed_fraction:.1%} flushed to zero; "
            f"{act.already_zero_fraction:.1%} of activation gradients were already zero in float32)"
        )
        recommended = self.recommended_scale
        if recommended is not None:
            peak = self.overall.amax * recommended
            gap = f"{self.format.max / peak:.3g}x below" if peak > 0 else "far below"
            return (
                f"{head}; scale {format_scale(recommended)} keeps underflow at "
                f"{self.underflow_at(recommended):.2%} (target {self.target:.2%}) with max |grad| x scale = "
                f"{peak:.4g}, {gap} {fmt}'s largest value {self.format.max:g} (margin required: "
                f"{self.margin:g}x)."
            )
        limit = self.max_safe_scale
        return (
            f"{head}; no power-of-two scale gets underflow under {self.target:.2%} without overflow: "
            f"above {format_scale(limit)} max |grad| = {self.overall.amax:.3g} overflows, and at that scale "
            f"{self.underflow_at(limit):.1%} still underflows; use a wider format (bf16) for this model."
        )

    def table(self) -> str:
        """A fixed-width table: per module, activation and parameter gradient counts and underflow."""
        header = (
            f"{'module':<24} {'act grads':>9} {'underflow':>9} {'flushed':>8} {'was 0':>6}   "
            f"{'param grads':>11} {'underflow':>9} {'flushed':>8}"
        )
        lines = [f"{self.format.name} at loss scale {format_scale(self.scale)}", header, "-" * len(header)]
        names = list(dict.fromkeys([*self.activations, *self.parameters]))
        rows = [(display_name(n), self.activations.get(n), self.parameters.get(n)) for n in names]
        rows.append(("overall", self.overall_activations, self.overall_parameters))
        for label, act, par in rows:
            lines.append(f"{label[:24]:<24} {_cells(act, zero=True)}   {_cells(par, zero=False)}")
        return "\n".join(lines)


def _cells(stats: GradStats | None, *, zero: bool) -> str:
    width = 9 if zero else 11
    if stats is None or stats.count == 0:
        blank = f"{'-':>{width}} {'':>9} {'':>8}"
        return blank + (f" {'':>6}" if zero else "")
    cells = f"{stats.count:>{width}} {stats.underflow:>9.1%} {stats.flushed_fraction:>8.1%}"
    return cells + (f" {stats.already_zero_fraction:>6.1%}" if zero else "")
