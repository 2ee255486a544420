"""The closing "what to use" line of each workload in the bench's report, derived from its records alone.

The rule, per workload (records as :func:`mixprec.bench.report.make_records` builds them):

1. **quality**: a mode keeps fp32's quality when its held-out metric is not worse than fp32's by more than
   the tolerance: the larger of :data:`QUALITY_TOLERANCE` (0.5%) of fp32's metric and the difference
   between fp32 and its second process (the A/A run), which shows how far two fp32 runs differ;
2. **speed**: a mode is faster when the lower end of its speedup's 90% interval is above 1 (a speedup
   without an interval, from too few rounds, is not enough);
3. of the modes that are both, the fastest; the others whose intervals overlap its interval are tied
   with it, and of the tied ones the one with the least peak memory is named (then the first in the
   table). When no mode is both, the line says fp32, and why (the faster ones lost quality, or none was
   faster).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from mixprec.bench.stats import AA_LABEL
from mixprec.bench.workloads import WORKLOADS

__all__ = ["QUALITY_TOLERANCE", "recommend"]

#: How much worse than fp32's held-out metric (relative) still counts as the same quality.
QUALITY_TOLERANCE = 0.005


def _metric(record: Mapping[str, Any]) -> float | None:
    value = record.get("final_metric")
    return value if isinstance(value, (int, float)) and math.isfinite(value) else None


def _format_metric(workload: str, value: float) -> str:
    return f"{value:.2%}" if WORKLOADS[workload].metric == "accuracy" else f"{value:.3f}"


def _interval(record: Mapping[str, Any]) -> str:
    low, high = record.get("speedup_low"), record.get("speedup_high")
    speed = f"{record['speedup_vs_fp32']:.2f}x"
    return speed if low is None or high is None else f"{speed} [{low:.2f}-{high:.2f}]"


def _worse(workload: str, value: float | None, reference: float, tolerance: float) -> bool:
    """Whether ``value`` is worse than ``reference`` by more than ``tolerance`` (None: a diverged run)."""
    if value is None:
        return True
    higher_better = WORKLOADS[workload].metric_higher_is_better
    loss = reference - value if higher_better else value - reference
    return loss > tolerance


def recommend(records: Sequence[Mapping[str, Any]], workload: str) -> str | None:
    """The "what to use" sentence for ``workload`` from its ``records``, or None without an fp32 record.

    See the module docstring for the rule; the sentence names the numbers it rests on.
    """
    rows = [r for r in records if r.get("workload") == workload]
    reference = next((r for r in rows if r.get("mode") == "fp32"), None)
    if reference is None or _metric(reference) is None:
        return None
    ref_metric = _metric(reference)
    assert ref_metric is not None
    aa = next((r for r in rows if r.get("mode") == AA_LABEL), None)
    spread = abs(_metric(aa) - ref_metric) if aa is not None and _metric(aa) is not None else 0.0  # type: ignore[operator]
    tolerance = max(QUALITY_TOLERANCE * abs(ref_metric), spread)
    metric_name = WORKLOADS[workload].metric
    ref_text = f"fp32's {metric_name} {_format_metric(workload, ref_metric)}"
    modes = [
        r for r in rows if r.get("mode") not in ("fp32", AA_LABEL) and r.get("speedup_vs_fp32") is not None
    ]
    faster = [r for r in modes if r.get("speedup_low") is not None and r["speedup_low"] > 1.0]
    lost = [r for r in faster if _worse(workload, _metric(r), ref_metric, tolerance)]
    good = [r for r in faster if r not in lost]

    def quality(r: Mapping[str, Any]) -> str:
        value = _metric(r)
        return f"{r['mode']} ({metric_name} {'nan' if value is None else _format_metric(workload, value)})"

    lost_text = (
        f"; faster but worse than {ref_text} by more than {tolerance / abs(ref_metric):.1%}: "
        + ", ".join(quality(r) for r in lost)
        if lost and ref_metric
        else ""
    )
    if not good:
        if lost:
            return f"what to use on {workload}: fp32: the modes that were faster lost quality{lost_text}"
        best = max(modes, key=lambda r: r["speedup_vs_fp32"], default=None)
        best_text = f" (best: {best['mode']} at {_interval(best)})" if best is not None else ""
        return (
            f"what to use on {workload}: fp32: no mixed mode was faster with its 90% interval above 1x"
            f"{best_text}"
        )
    top = max(good, key=lambda r: r["speedup_vs_fp32"])
    tied = [
        r for r in good if r["speedup_low"] <= top["speedup_high"] and r["speedup_high"] >= top["speedup_low"]
    ]
    memory = [r for r in tied if isinstance(r.get("peak_memory_mb"), (int, float))]
    chosen = min(memory, key=lambda r: r["peak_memory_mb"]) if memory else tied[0]
    text = (
        f"what to use on {workload}: {chosen['mode']}: {_interval(chosen)} fp32's speed, "
        f"{quality(chosen).split(' (', 1)[1].rstrip(')')} against {ref_text}"
    )
    others = [r["mode"] for r in tied if r is not chosen]
    if others:
        why = "least peak memory" if memory else "first in the table"
        text += f"; tied (intervals overlap) with {', '.join(others)}: chosen for the {why}"
        if chosen.get("peak_memory_mb") is not None:
            text += f" ({chosen['peak_memory_mb']:.1f} MiB)"
    if chosen.get("noisy"):
        text += "; NOISY: rerun on a quieter machine to confirm"
    return text + lost_text
