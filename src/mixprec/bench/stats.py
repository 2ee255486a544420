"""Step-time statistics that stay honest on a busy machine: per-round medians, paired speedups, a noise flag.

All modes of a workload train in interleaved rounds (round ``r`` of every mode runs before round ``r+1``
of any), so a change in the machine's load hits every mode alike. From each run's per-step history:

* **step time**: median and interquartile range (25th-75th percentile) of the timed steps (after the
  warm-up steps);
* **speedup**: for each round, fp32's median step time in that round over this mode's; the speedup is
  the median of these paired ratios and its interval the distribution-free ~90% confidence interval of
  that median (order statistics of the binomial; Hollander & Wolfe, *Nonparametric Statistical Methods*,
  section 3.6). Pairing by round cancels slow drift; the interval widens when the load changes faster;
* **between processes**: each run is a process of its own, and processes running the same kernels still
  differ by a few percent (memory placement, which core they land on), which round-to-round noise does
  not show. So each workload also runs fp32 a second time (``AA_LABEL``, an A/A pair): its speedup over
  fp32 should be 1, and the factor ``f >= 1`` by which its interval's far end misses 1 widens every
  other row's interval to ``[low / f, high * f]`` (:func:`process_factor`);
* **noisy**: the (widened) interval is wider than ``NOISY_WIDTH`` (15%) of the speedup, or (for fp32
  itself, or with too few rounds for an interval) the step times' IQR is over ``NOISY_IQR`` (30%) of
  their median.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

AA_LABEL = "fp32 (A/A)"
NOISY_WIDTH = 0.15
NOISY_IQR = 0.30
CONFIDENCE = 0.90
NOISY_ADVICE = (
    "the step times of these runs spread widely (another program was using the CPU/GPU?), so their "
    "speedups may not repeat; close other programs and rerun, or use --full for more rounds"
)


def quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile (numpy's default method) of a non-empty sequence; ``q`` in [0, 1]."""
    if not values:
        raise ValueError("quantile of an empty sequence")
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def median_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float] | None:
    """Distribution-free confidence interval of the median: ``(x_(k), x_(n+1-k))`` of the sorted values.

    ``k`` is the largest rank with ``P(Binomial(n, 1/2) < k) <= (1 - confidence) / 2``. Returns None when
    ``n`` is too small for any such ``k`` (fewer than 5 values at 90%).
    """
    n = len(values)
    tail = (1.0 - confidence) / 2.0
    cumulative, k = 0.0, 0
    for rank in range(n + 1):  # cumulative = P(B < rank + 1) after adding pmf(rank)
        cumulative += math.comb(n, rank) / 2.0**n
        if cumulative > tail:
            k = rank  # P(B < rank) <= tail, P(B <= rank) > tail
            break
    if k < 1:
        return None
    ordered = sorted(values)
    return ordered[k - 1], ordered[n - k]


def round_medians(history: Sequence[dict[str, Any]], warmup: int) -> dict[int, float]:
    """Median step time (ms) of each round's timed steps, keyed by round index."""
    rounds: dict[int, list[float]] = {}
    for entry in history[warmup:]:
        rounds.setdefault(entry.get("round", 0), []).append(entry["step_time_ms"])
    return {index: statistics.median(times) for index, times in rounds.items()}


@dataclass(frozen=True)
class Timing:
    """Step-time summary of one run and its speedup over the fp32 run of the same workload (ms, ratios)."""

    median_ms: float
    q25_ms: float
    q75_ms: float
    rounds: int
    speedup: float | None = None
    speedup_low: float | None = None
    speedup_high: float | None = None
    noisy: bool = False

    @property
    def relative_iqr(self) -> float:
        return (self.q75_ms - self.q25_ms) / self.median_ms if self.median_ms > 0 else math.inf


def _spread(result: Any) -> tuple[float, float, float]:
    times = [h["step_time_ms"] for h in result.history[result.warmup :]]
    if not times:
        return math.nan, math.nan, math.nan
    return statistics.median(times), quantile(times, 0.25), quantile(times, 0.75)


def timing(result: Any, reference: Any | None) -> Timing:
    """The :class:`Timing` of ``result`` (a RunResult), paired round by round with ``reference`` (fp32)."""
    median, q25, q75 = _spread(result)
    mine = round_medians(result.history, result.warmup)
    alone = Timing(median, q25, q75, rounds=len(mine))
    alone = Timing(median, q25, q75, len(mine), noisy=alone.relative_iqr > NOISY_IQR)
    if reference is None:
        return alone
    if reference is result:
        return Timing(median, q25, q75, len(mine), speedup=1.0, noisy=alone.noisy)
    theirs = round_medians(reference.history, reference.warmup)
    ratios = [theirs[r] / mine[r] for r in mine if r in theirs and mine[r] > 0]
    if not ratios:
        return alone
    speedup = statistics.median(ratios)
    interval = median_interval(ratios)
    if interval is None:
        return Timing(median, q25, q75, len(mine), speedup, noisy=alone.noisy)
    low, high = interval
    return Timing(median, q25, q75, len(mine), speedup, low, high, (high - low) / speedup > NOISY_WIDTH)


def process_factor(aa: Timing | None) -> float:
    """How far the A/A run's speedup interval (or, without one, its speedup) reaches from 1, as a factor."""
    if aa is None or aa.speedup is None:
        return 1.0
    ends = [aa.speedup] + ([aa.speedup_low, aa.speedup_high] if aa.speedup_low is not None else [])
    return max(max(e, 1.0 / e) for e in ends if e and e > 0)  # type: ignore[operator]


def widen(t: Timing, factor: float) -> Timing:
    """``t`` with its speedup interval widened to ``[low / factor, high * factor]`` and NOISY re-judged."""
    if t.speedup_low is None or t.speedup is None or factor <= 1.0:
        return t
    low, high = t.speedup_low / factor, t.speedup_high * factor  # type: ignore[operator]
    noisy = (high - low) / t.speedup > NOISY_WIDTH
    return Timing(t.median_ms, t.q25_ms, t.q75_ms, t.rounds, t.speedup, low, high, noisy)


def timings(results: Sequence[Any]) -> list[Timing]:
    """``timing`` for each result, paired with the fp32 run of its workload when there is one, its
    interval widened by the ``process_factor`` of the workload's A/A run (``AA_LABEL``) if any."""
    fp32 = {r.workload: r for r in results if r.mode == "fp32"}
    raw = [timing(r, fp32.get(r.workload)) for r in results]
    aa = {r.workload: t for r, t in zip(results, raw, strict=True) if r.mode == AA_LABEL}
    return [
        t if r.mode in ("fp32", AA_LABEL) else widen(t, process_factor(aa.get(r.workload)))
        for r, t in zip(results, raw, strict=True)
    ]
