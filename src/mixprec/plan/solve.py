"""The planner's two choices over measured per-layer divergences, one format per layer.

* :func:`knapsack`: the *cheapest* assignment whose summed loss divergence fits a budget (and optionally a
  root-sum-square weight-gradient bound): a multiple-choice knapsack (Sinha and Zoltners, Operations
  Research 27(3), 1979; Kellerer, Pferschy and Pisinger, "Knapsack Problems", Springer 2004, ch. 11),
  solved exactly by dynamic programming over the budget with each item's use rounded up.
* :func:`most_accurate`: the assignments of *least* summed squared weight-gradient divergence (ties: summed
  loss divergence) whose cost fits ``max_cost`` and whose FLOPs left in high precision fit
  ``max_high_flops`` (the dual problem, the same knapsack with cost and divergence exchanged). The
  weight gradient decides here because a layer's loss change on a few batches is a signed scalar that
  rounding can cancel, so two formats of very different error can change it alike (docs/guide/planner.md shows
  one). The solver: every assignment is enumerated (vectorized, pruned as it goes) while
  there are at most ``2**20``; beyond that, dynamic programming over the two bounds with uses rounded up,
  which keeps every answer within the bounds but can miss one that lies within a rounding step of them.

``layers`` is the planner's ``{fqn: LayerMeasure}``; a format whose loss is None (ruled out unmeasured)
or not finite, or that flushes more than ``max_flushed`` (``fprop_flushed``), is never chosen.
:func:`reason` and :func:`reason_at_cost` say in words why a layer got its format.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence

import torch

from mixprec.plan.measure import HIGH_PRECISION, Divergence, LayerMeasure, PlanLimits

#: One format's terms for the dual solver: cost, FLOPs left in high precision, squared weight-gradient
#: divergence, loss divergence.
Row = tuple[float, float, float, float]

_STEPS = 1000
_STEPS_2D = 100
_ENUMERATE = 2**20
_DUAL_STEPS = (400, 100)


def knapsack(
    layers: Mapping[str, LayerMeasure],
    budget: float,
    grad_limit: float = math.inf,
    max_flushed: float = 1.0,
) -> dict[str, str]:
    """The cheapest one-format-per-layer choice whose summed (rounded-up) loss divergence is <= ``budget``
    and, for a finite ``grad_limit``, whose root-sum-square weight-gradient divergence is <= it (the
    layers' gradient errors taken as independent). Among choices of equal cost, the one with the smaller
    summed weight-gradient divergence; formats over ``max_flushed`` (``fprop_flushed``) are left out.
    ``{}`` when nothing fits.

    Dynamic programming over the used resources (the loss in 1000 steps of the budget; with a gradient
    bound, 100 steps each of the budget and of ``grad_limit ** 2``), each item's use rounded up.
    """
    two = math.isfinite(grad_limit)
    steps = (_STEPS_2D, _STEPS_2D) if two else (_STEPS, 0)
    best: dict[tuple[int, int], tuple[float, float]] = {(0, 0): (0.0, 0.0)}  # used -> least (cost, wgrad)
    backs: list[dict[tuple[int, int], tuple[str, tuple[int, int]]]] = []
    for info in layers.values():
        items = []
        for fmt, loss, wgrad in _admissible(info, max_flushed):
            if wgrad > grad_limit:
                continue  # over the gradient limit alone
            du = use(loss, budget, steps[0])
            dv = use(wgrad**2, grad_limit**2, steps[1]) if two else 0
            items.append((fmt, du, dv, info.cost[fmt], wgrad))
        new: dict[tuple[int, int], tuple[float, float]] = {}
        back: dict[tuple[int, int], tuple[str, tuple[int, int]]] = {}
        for (u, v), (c0, w0) in best.items():
            for fmt, du, dv, c, w in items:
                key = (u + du, v + dv)
                if (
                    key[0] <= steps[0]
                    and key[1] <= steps[1]
                    and (key not in new or (c0 + c, w0 + w) < new[key])
                ):
                    new[key], back[key] = (c0 + c, w0 + w), (fmt, (u, v))
        best = new
        backs.append(back)
    if not best:
        return {}
    return _trace(list(layers), backs, min(best, key=best.__getitem__))


def use(value: float, limit: float, steps: int) -> int:
    """``value`` in steps of ``limit / steps``, rounded up (so a sum of uses never undercounts)."""
    return math.ceil(value / limit * steps - 1e-9) if value > 0 else 0


def most_accurate(
    layers: Mapping[str, LayerMeasure],
    max_cost: float,
    max_high_flops: float = math.inf,
    max_flushed: float = 1.0,
    top: int = 3,
) -> list[dict[str, str]]:
    """Up to ``top`` distinct assignments of least summed squared weight-gradient divergence (the square
    of the root-sum-square the gradient bound uses; ties: summed loss divergence), best first, each with
    summed cost <= ``max_cost`` and summed FLOPs of its layers in ``"bf16"``/``"fp32"`` <=
    ``max_high_flops`` (both in the units of ``layers``); ``[]`` if none fits."""
    names = list(layers)
    options = [list(_admissible(layers[f], max_flushed)) for f in names]
    if any(not o for o in options):
        return []
    rows = [
        [
            (layers[f].cost[fmt], float(layers[f].flops * (fmt in HIGH_PRECISION)), wgrad**2, loss)
            for fmt, loss, wgrad in opts
        ]
        for f, opts in zip(names, options, strict=True)
    ]
    limits = (max_cost * (1 + 1e-9), max_high_flops * (1 + 1e-9))
    if math.prod(len(o) for o in options) <= _ENUMERATE:
        picks = _enumerate(rows, limits, top)
    else:
        picks = _dual_dp(rows, limits, top)
    return [{f: options[i][j][0] for i, (f, j) in enumerate(zip(names, pick, strict=True))} for pick in picks]


def _admissible(info: LayerMeasure, max_flushed: float) -> Iterator[tuple[str, float, float]]:
    """``(format, loss, weight_grad)`` of every measured format that may be chosen for this layer."""
    for fmt, d in info.divergence.items():
        loss = d.loss
        if loss is not None and math.isfinite(loss) and d.fprop_flushed <= max_flushed:
            yield fmt, loss, 0.0 if d.weight_grad is None else d.weight_grad


def _enumerate(rows: list[list[Row]], limits: tuple[float, float], top: int) -> list[tuple[int, ...]]:
    """Every assignment, pruned as soon as a partial sum passes a bound (all terms are >= 0)."""
    dtype = torch.float64
    picks = torch.zeros(1, 0, dtype=torch.int64)
    sums = torch.zeros(1, 4, dtype=dtype)  # cost, high flops, squared weight grad, loss
    for row in rows:
        values = torch.tensor(row, dtype=dtype)  # (F, 4)
        sums = (sums[:, None, :] + values[None, :, :]).reshape(-1, 4)
        index = torch.arange(len(row)).repeat(picks.shape[0])
        picks = torch.cat([picks.repeat_interleave(len(row), 0), index[:, None]], 1)
        keep = (sums[:, 0] <= limits[0]) & (sums[:, 1] <= limits[1])
        sums, picks = sums[keep], picks[keep]
        if not len(sums):
            return []
    order = torch.argsort(sums[:, 3], stable=True)  # ties: the loss
    order = order[torch.argsort(sums[order, 2], stable=True)][:top]  # first: the squared weight grad
    return [tuple(picks[i].tolist()) for i in order]


def _dual_dp(rows: list[list[Row]], limits: tuple[float, float], top: int) -> list[tuple[int, ...]]:
    """Least (squared weight grad, loss) per used (cost, high-flops) step pair, uses rounded up."""
    steps = _DUAL_STEPS
    two = math.isfinite(limits[1])
    best: dict[tuple[int, int], tuple[float, float]] = {(0, 0): (0.0, 0.0)}
    backs: list[dict[tuple[int, int], tuple[int, tuple[int, int]]]] = []
    for row in rows:
        new: dict[tuple[int, int], tuple[float, float]] = {}
        back: dict[tuple[int, int], tuple[int, tuple[int, int]]] = {}
        for (u, v), (s0, w0) in best.items():
            for j, (cost, high, wgrad2, loss) in enumerate(row):
                key = (u + use(cost, limits[0], steps[0]), v + (use(high, limits[1], steps[1]) if two else 0))
                value = (s0 + wgrad2, w0 + loss)
                if key[0] <= steps[0] and key[1] <= steps[1] and (key not in new or value < new[key]):
                    new[key], back[key] = value, (j, (u, v))
        best = new
        backs.append(back)
    ends = sorted(best, key=best.__getitem__)
    found = [tuple(_trace(list(range(len(rows))), backs, key).values()) for key in ends]
    return list(dict.fromkeys(found))[:top]


def _trace(names: Sequence, backs: list[dict], key: tuple[int, int]) -> dict:
    """Walk the back pointers from the end state ``key``: name -> the choice made for it."""
    out = {}
    for name, back in zip(reversed(names), reversed(backs), strict=True):
        out[name], key = back[key]
    return dict(reversed(list(out.items())))


def reason(
    fqn: str,
    chosen: Mapping[str, str],
    layers: Mapping[str, LayerMeasure],
    limits: PlanLimits,
    rounds: list[dict[str, float]],
) -> str:
    """Why ``fqn`` got its format in a plan within a loss budget: every other measured format's cost
    relative to bf16 at the priced shape, and for each cheaper one the limit it broke."""
    budget, grad_budget = limits.budget, limits.grad_budget
    assert budget is not None  # a plan within a loss budget has one
    fmt = chosen[fqn]
    info = layers[fqn]
    if rounds and rounds[-1].get("solver_budget") == 0.0:
        return "no mix of the given formats fit the budget when measured; kept in the model's precision"
    cheaper = [f for f, c in info.cost.items() if c < info.cost[fmt] and f in info.divergence]
    own = info.divergence[fmt].loss
    assert own is not None  # a chosen format was measured
    if not cheaper:
        own_cost = "" if fmt == "bf16" else f"{_relative(info, fmt)}, "
        return (
            f"{own_cost}cheapest at {_at(info)}"
            + _dearer(info, fmt)
            + f"; loss divergence {own:.2e} ({own / budget:.0%} of the budget)"
        )
    cheaper.sort(key=lambda g: info.cost[g])
    d = info.divergence[cheaper[0]]
    shares = {"flushed": d.flushed, "saturated": d.saturated, "outlier_blocks": d.outlier_blocks}
    details = [f"{key} {share:.1%}" for key, share in shares.items() if share >= 0.01]
    scores = [_why_not(g, info.divergence[g], grad_budget, limits.max_flushed, info) for g in cheaper]
    tightened = " after tightening" if len(rounds) > 1 else ""
    return (
        f"{_relative(info, fmt)} at {_at(info)}; "
        + ", ".join(scores)
        + (f" ({cheaper[0]}: " + ", ".join(details) + ")" if details else "")
        + f"; budget {budget:.2e}"
        + ("" if grad_budget is None else f", grad_budget {grad_budget:.2e}")
        + tightened
    )


def reason_at_cost(
    fqn: str, chosen: Mapping[str, str], layers: Mapping[str, LayerMeasure], limits: PlanLimits
) -> str:
    """Why ``fqn`` got its format in the most accurate plan within ``limits.max_cost``."""
    fmt = chosen[fqn]
    info = layers[fqn]
    own = info.divergence[fmt].loss
    others = sorted((g for g in info.divergence if g != fmt), key=lambda g: info.cost[g])
    cheaper = [
        _why_not(g, info.divergence[g], None, limits.max_flushed, info)
        for g in others
        if info.cost[g] < info.cost[fmt]
    ]
    text = (
        f"{_relative(info, fmt)} at {_at(info)}, loss divergence {own:.2e}; "
        f"the most accurate measured mix within {limits.max_cost:g}x bf16's cost"
    )
    return text + ("" if not cheaper else "; cheaper: " + ", ".join(cheaper))


def _relative(info: LayerMeasure, fmt: str) -> str:
    """``"nvfp4 0.31x bf16"``: a format's cost over bf16's for this layer in the plan's cost model."""
    return f"{fmt} {info.cost[fmt] / info.cost['bf16']:.2f}x bf16"


def _at(info: LayerMeasure) -> str:
    """The shape the layer was priced at: ``"M=4096"`` (rows of its GEMMs)."""
    return f"M={info.priced_rows}"


def _dearer(info: LayerMeasure, fmt: str) -> str:
    """The formats that cost more than ``fmt`` here, each relative to bf16: why they lost without a
    measurement (fp32, which the cost always holds, only when it was a candidate and measured)."""
    dearer = [
        g
        for g, c in info.cost.items()
        if c > info.cost[fmt] and g != "bf16" and (g != "fp32" or g in info.divergence)
    ]
    dearer.sort(key=lambda g: info.cost[g])
    # "no gain" only where they cost more than bf16 too; below bf16 they gain, just less than fmt
    label = "no gain" if info.cost[fmt] >= info.cost["bf16"] else "dearer"
    return "" if not dearer else f" ({label}: " + ", ".join(_relative(info, g) for g in dearer) + ")"


def _why_not(
    fmt: str, d: Divergence, grad_budget: float | None, max_flushed: float, info: LayerMeasure
) -> str:
    priced = _relative(info, fmt)
    if d.fprop_flushed > max_flushed:
        flushed = d.fprop_flushed
        return f"{priced} flushes {flushed:.0%} of its forward input or weight (over {max_flushed:.0%})"
    if grad_budget is not None and d.weight_grad is not None and d.weight_grad > grad_budget:
        return f"{priced} would change the weight gradients {d.weight_grad:.2e} (over {grad_budget:.2e})"
    return f"{priced} would change the loss {d.loss:.2e}"
