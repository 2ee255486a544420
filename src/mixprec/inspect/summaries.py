"""Summaries of gradient values against a low-precision format: exact counts and a log2 histogram.

:class:`GradStats` counts, at one loss scale, how many values of a gradient would be flushed to zero,
land in the subnormal range, or overflow once multiplied by the scale and cast to the format.
:class:`Log2Histogram` keeps ``floor(log2|g|)`` counts instead, which answer the same questions for
every power-of-two scale at once (each format's thresholds are powers of two) and draw the histogram.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import torch

from mixprec.formats import Format

__all__ = ["GradStats", "Log2Histogram"]

# floor(log2|x|) of a finite non-zero float32 lies in [-149, 127].
_LOW_EXPONENT = -149
_BINS = 127 - _LOW_EXPONENT + 1


@dataclass(frozen=True)
class GradStats:
    """Counts of gradient values by what ``value * scale`` becomes in a format.

    Attributes:
        count: values looked at.
        already_zero: values that were exactly zero before any cast (not underflow).
        flushed: non-zero values that become zero (``|g * scale| < smallest_subnormal / 2``).
        subnormal: values that land in the subnormal range (below ``smallest_normal``, precision lost).
        overflow: values beyond the format's max after scaling, or not finite to begin with.
        amax: the largest finite ``|g|`` (unscaled).
    """

    count: int = 0
    already_zero: int = 0
    flushed: int = 0
    subnormal: int = 0
    overflow: int = 0
    amax: float = 0.0

    @classmethod
    def measure(cls, grad: torch.Tensor, fmt: Format, scale: float) -> GradStats:
        """Count the values of ``grad`` (unscaled) as they would be at loss ``scale`` in ``fmt``."""
        magnitude = grad.detach().abs().reshape(-1).float()
        if magnitude.numel() == 0:
            return cls()
        finite = torch.isfinite(magnitude)
        flush_below = fmt.smallest_subnormal / 2 / scale
        normal_below = fmt.smallest_normal / scale
        counts = torch.stack(
            [
                (magnitude == 0).sum(),
                ((magnitude > 0) & (magnitude < flush_below)).sum(),
                ((magnitude >= flush_below) & (magnitude < normal_below)).sum(),
                (~finite | (magnitude > fmt.max / scale)).sum(),
            ]
        ).tolist()
        amax = float(torch.where(finite, magnitude, 0.0).max())
        zero, flushed, subnormal, overflow = counts
        return cls(magnitude.numel(), zero, flushed, subnormal, overflow, amax=amax)

    def __add__(self, other: GradStats) -> GradStats:
        if not isinstance(other, GradStats):
            return NotImplemented
        summed: dict[str, Any] = {
            f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)
        }
        summed["amax"] = max(self.amax, other.amax)
        return GradStats(**summed)

    def _fraction(self, part: int) -> float:
        return part / self.count if self.count else 0.0

    @property
    def underflow(self) -> float:
        """Fraction of values flushed to zero or subnormal."""
        return self._fraction(self.flushed + self.subnormal)

    @property
    def flushed_fraction(self) -> float:
        """Fraction of values flushed to zero."""
        return self._fraction(self.flushed)

    @property
    def subnormal_fraction(self) -> float:
        """Fraction of values landing in the subnormal range."""
        return self._fraction(self.subnormal)

    @property
    def already_zero_fraction(self) -> float:
        """Fraction of values that were exactly zero before the cast."""
        return self._fraction(self.already_zero)

    @property
    def overflow_fraction(self) -> float:
        """Fraction of values overflowing (or not finite)."""
        return self._fraction(self.overflow)


class Log2Histogram:
    """Counts of ``floor(log2|g|)`` over non-zero finite values, plus counts of zeros and non-finite ones."""

    def __init__(self) -> None:
        self.counts = torch.zeros(_BINS, dtype=torch.int64)
        self.zeros = 0
        self.nonfinite = 0

    def add(self, values: torch.Tensor) -> None:
        """Add every value of a tensor (any floating dtype; float64 beyond float32's range saturates)."""
        flat = values.detach().reshape(-1).float().cpu()
        finite = torch.isfinite(flat)
        nonzero = flat[finite & (flat != 0)]
        self.nonfinite += int((~finite).sum())
        self.zeros += int((flat == 0).sum())
        _, exponent = torch.frexp(nonzero)  # |g| = m * 2**e with m in [0.5, 1): floor(log2|g|) = e - 1
        self.counts += torch.bincount(exponent.long() - 1 - _LOW_EXPONENT, minlength=_BINS)

    @property
    def total(self) -> int:
        """All values added: non-zero finite, zero and non-finite."""
        return int(self.counts.sum()) + self.zeros + self.nonfinite

    def count_below(self, log2_bound: float) -> int:
        """Non-zero finite values with ``|g| < 2**log2_bound`` (exact for an integer bound)."""
        stop = min(max(math.ceil(log2_bound) - _LOW_EXPONENT, 0), _BINS)
        return int(self.counts[:stop].sum())

    def count_at_or_above(self, log2_bound: float) -> int:
        """Non-zero finite values with ``|g| >= 2**log2_bound`` (exact for an integer bound)."""
        return int(self.counts.sum()) - self.count_below(log2_bound)

    def bins(self) -> tuple[list[int], list[int]]:
        """(exponents, counts): ``counts[i]`` values have floor(log2|g|) ``exponents[i]``."""
        nonzero = torch.nonzero(self.counts).flatten()
        if nonzero.numel() == 0:
            return [], []
        first, last = int(nonzero[0]), int(nonzero[-1])
        exponents = list(range(first + _LOW_EXPONENT, last + _LOW_EXPONENT + 1))
        return exponents, self.counts[first : last + 1].tolist()

    def merged(self, other: Log2Histogram) -> Log2Histogram:
        """A new histogram holding the values of both."""
        result = Log2Histogram()
        result.counts = self.counts + other.counts
        result.zeros = self.zeros + other.zeros
        result.nonfinite = self.nonfinite + other.nonfinite
        return result

    def to_dict(self) -> dict[str, Any]:
        """A compact JSON-able form: ``{"low": exponent, "counts": [...], "zeros": n, "nonfinite": n}``."""
        exponents, counts = self.bins()
        return {
            "low": exponents[0] if exponents else 0,
            "counts": counts,
            "zeros": self.zeros,
            "nonfinite": self.nonfinite,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Log2Histogram:
        """Inverse of :meth:`to_dict`.

        Raises:
            ValueError: when the exponents fall outside float32's range or a field is missing.
        """
        try:
            low, counts = int(data["low"]), [int(c) for c in data["counts"]]
            zeros, nonfinite = int(data.get("zeros", 0)), int(data.get("nonfinite", 0))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a log2 histogram record: {data!r}") from exc
        start = low - _LOW_EXPONENT
        if counts and (start < 0 or start + len(counts) > _BINS):
            raise ValueError(f"histogram exponents {low}..{low + len(counts) - 1} outside float32's range")
        histogram = cls()
        histogram.counts[start : start + len(counts)] = torch.tensor(counts, dtype=torch.int64)
        histogram.zeros, histogram.nonfinite = zeros, nonfinite
        return histogram
