"""`plan_precision`: which linear layer can run in which low-bit format, decided by measurement.

The method (after SNIP, "Adaptive mixed precision for sub-byte LLM training", ASPLOS 2026: per-layer
forward loss divergence and backward weight divergence, then an integer program over the layers):

1. **Reference**: one forward/backward of ``loss_fn(model, batch)`` over the planning batches with every
   linear layer at the model's own (high) precision: losses, every linear's weight gradient, every
   layer's input gradient, and (first batch) each layer's input, weight and output gradient.
2. **Per layer and format**, that layer alone swapped to the format, one forward/backward over the
   batches: the forward divergence ``sum_b |L_b - L_ref_b| / sum_b |L_ref_b|``, the backward divergences
   ``||G - G_ref|| / ||G_ref||`` of all linears' weight gradients and of the layer's input gradient, and
   the quantization statistics of its six GEMM operands (:func:`mixprec.inspect.lowbit_report`'s error,
   flushed, saturated and outlier-set-block shares). The layer's **score** in that format is
   ``loss + backward_weight * weight_grad``.
3. **Choose** the cheapest assignment, one format per layer, whose summed score fits the budget: a
   multiple-choice knapsack (Sinha and Zoltners, Operations Research 27(3), 1979; Kellerer, Pferschy and
   Pisinger, "Knapsack Problems", Springer 2004, ch. 11), solved exactly by dynamic programming over
   the budget in 1000 steps with each score rounded up, so the sum never undercounts.
4. **Measure the plan as a whole** (all its layers swapped at once, one forward/backward over the
   batches). Effects of layers do not simply add, so while the measured score is over the budget, the
   solver's budget is cut by ``0.8 * budget / measured`` and the plan re-solved and re-measured
   (at most ``max_rounds`` solves); the returned plan's measured score fits the budget, and if no mix of
   the given formats does, every layer stays in the model's precision (``"fp32"``, divergence 0).

The cost of a format for a layer is the roofline time of its three training GEMMs on a named GPU
(:mod:`mixprec.inspect.plan_cost`), or a user's ``cost(format, m, n, k)``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from mixprec.inspect._modules import check_model
from mixprec.inspect._plan_measure import HIGH_PRECISION, PassResult, Slots, divergences, run_pass
from mixprec.inspect._restore import preserved
from mixprec.inspect.lowbit import _layer
from mixprec.inspect.plan_cost import CostFn, resolve_cost
from mixprec.inspect.plan_value import PrecisionPlan
from mixprec.lowbit import RECIPES, get_recipe

__all__ = ["plan_precision"]

_STEPS = 1000
#: The divergences of a layer left in the model's precision: the reference itself.
_EXACT = {"loss": 0.0, "weight_grad": 0.0, "input_grad": 0.0, "score": 0.0}
_EXACT.update(error=0.0, flushed=0.0, saturated=0.0, outlier_blocks=0.0)


def plan_precision(
    model: nn.Module,
    batches: Iterable[Any],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    *,
    formats: Sequence[str] = ("nvfp4", "mxfp8", "bf16"),
    budget: float = 0.01,
    cost: str | CostFn | None = None,
    backward_weight: float = 0.1,
    max_rounds: int = 6,
    seed: int = 0,
) -> PrecisionPlan:
    """Plan a format per ``nn.Linear`` of ``model`` so that the whole plan's measured divergence fits.

    See the module doc for the method. The model is handed back exactly as it was (parameters, buffers,
    ``.grad``, modes, RNG state; layers already converted by :mod:`mixprec.lowbit` are measured and
    reported as plain layers).

    Args:
        model: the model; its linear layers (exact ``nn.Linear`` or ``LowbitLinear``) are planned.
        batches: the planning batches (a few; each is passed to ``loss_fn`` as is).
        loss_fn: ``loss_fn(model, batch) -> scalar tensor``.
        formats: candidate formats: :mod:`mixprec.lowbit` recipe names, ``"bf16"``, ``"fp32"``.
        budget: the bound on the plan's measured score, a relative loss change (0.01 = 1 %), > 0.
        cost: a target name (``"b200"`` default, ``"h100"``) or ``cost(format, m, n, k) -> float``.
        backward_weight: the weight (>= 0) of the weight-gradient divergence in a layer's score.
        max_rounds: solves at most (>= 1) before falling back to the model's precision.
        seed: seeds dropout (the same masks in every pass) and stochastic rounding.

    Returns:
        A :class:`~mixprec.inspect.PrecisionPlan`.

    Raises:
        TypeError: for a non-module ``model``, a non-callable ``loss_fn`` or ``cost``.
        ValueError: for a budget that is not a finite number > 0, an empty ``batches``, an unknown
            format or cost target, a model without linear layers (or that is one), or a ``loss_fn`` that
            returns a non-scalar loss, or a non-finite one at high precision. Nothing is changed then.
    """
    start = time.process_time()
    check_model(model)
    formats, budget, batches = _check(formats, budget, batches, loss_fn, backward_weight, max_rounds)
    target, cost_fn = resolve_cost(cost)
    fqns = [f for f, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not fqns:
        raise ValueError("model has no nn.Linear layer to plan")
    if fqns[0] == "":
        raise ValueError("model itself is an nn.Linear: wrap it (nn.Sequential(model)) so it can be swapped")
    generator = torch.Generator().manual_seed(seed)
    with preserved(model):
        slots = Slots(model, fqns)
        try:
            slots.set(dict.fromkeys(fqns, "fp32"), generator)
            tick = time.process_time()
            ref = run_pass(slots, batches, loss_fn, seed, capture=True)
            step = (time.process_time() - tick) / len(batches)
            if not all(math.isfinite(loss) for loss in ref.losses):
                raise ValueError(f"loss_fn returned a non-finite loss at high precision: {ref.losses}")
            layers = _measure(
                slots, ref, formats, batches, loss_fn, seed, generator, cost_fn, backward_weight
            )
            chosen, measured, rounds = _solve_and_tighten(
                slots, ref, layers, budget, batches, loss_fn, seed, generator, backward_weight, max_rounds
            )
        finally:
            slots.restore()
    reasons = {f: _reason(f, chosen, layers, budget, rounds) for f in fqns}
    seconds = time.process_time() - start
    return PrecisionPlan(
        chosen, layers, reasons, budget, measured, rounds, target, backward_weight, seconds, step
    )


def _check(formats: Any, budget: Any, batches: Any, loss_fn: Any, backward_weight: Any, max_rounds: Any):
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not math.isfinite(budget):
        raise ValueError(f"budget must be a finite number > 0 (a relative loss change), got {budget!r}")
    if budget <= 0:
        raise ValueError(f"budget must be > 0 (a relative loss change, e.g. 0.01), got {budget!r}")
    if isinstance(formats, str) or not isinstance(formats, Sequence) or not formats:
        raise ValueError(f"formats must be a non-empty sequence of format names, got {formats!r}")
    known = [*RECIPES, *HIGH_PRECISION]
    for fmt in formats:
        if fmt not in HIGH_PRECISION:
            if not isinstance(fmt, str):
                raise ValueError(f"unknown format {fmt!r}; known: {', '.join(known)}")
            try:
                get_recipe(fmt)
            except (ValueError, TypeError):
                raise ValueError(f"unknown format {fmt!r}; known: {', '.join(known)}") from None
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable loss_fn(model, batch) -> loss, got {loss_fn!r}")
    bad_weight = isinstance(backward_weight, bool) or not isinstance(backward_weight, (int, float))
    if bad_weight or not 0 <= backward_weight < math.inf:
        raise ValueError(f"backward_weight must be a finite number >= 0, got {backward_weight!r}")
    if isinstance(max_rounds, bool) or not isinstance(max_rounds, int) or max_rounds < 1:
        raise ValueError(f"max_rounds must be an int >= 1, got {max_rounds!r}")
    batches = list(batches)
    if not batches:
        raise ValueError("batches is empty: the planner needs at least one batch to measure on")
    return list(dict.fromkeys(formats)), float(budget), batches


def _measure(slots, ref, formats, batches, loss_fn, seed, generator, cost_fn, backward_weight):
    layers: dict[str, dict[str, Any]] = {}
    for fqn in slots.originals:
        captured = ref.captured.get(fqn)
        if captured is None:
            continue  # never called on these batches: nothing to measure, left as it is
        m, k = captured["x"].shape
        n = captured["w"].shape[0]
        info: dict[str, Any] = {"shape": [m, n, k], "flops": 6 * m * n * k, "cost": {}, "divergence": {}}
        for fmt in formats:
            info["cost"][fmt] = float(cost_fn(fmt, m, n, k))
            info["divergence"][fmt] = _one(slots, ref, fqn, fmt, captured, batches, loss_fn, seed, generator)
            d = info["divergence"][fmt]
            d["score"] = d["loss"] + backward_weight * d["weight_grad"]
        for fmt in ("bf16", "fp32"):  # the baseline of relative_cost, and the fallback
            info["cost"].setdefault(fmt, float(cost_fn(fmt, m, n, k)))
        layers[fqn] = info
    return layers


def _one(slots, ref, fqn, fmt, captured, batches, loss_fn, seed, generator) -> dict[str, Any]:
    stats = {"error": 0.0, "flushed": 0.0, "saturated": 0.0, "outlier_blocks": 0.0}
    if fmt == "fp32":
        return {key: value for key, value in _EXACT.items() if key != "score"}
    slots.set({fqn: fmt}, generator)
    try:
        run = run_pass(slots, batches, loss_fn, seed)
    finally:
        slots.set({fqn: "fp32"}, generator)
    if fmt not in HIGH_PRECISION:
        per_operand = _layer(captured, get_recipe(fmt), 8.0).values()
        stats = {key: max((getattr(s, key) for s in per_operand), default=0.0) for key in stats}
    return {**divergences(ref, run, fqn), **stats}


def _knapsack(layers: dict[str, dict[str, Any]], budget: float) -> dict[str, str]:
    """The cheapest one-format-per-layer choice whose summed (rounded-up) score is <= ``budget``."""
    inf = float("inf")
    best = [0.0] * (_STEPS + 1)  # best[u]: least cost of the layers so far using at most u budget steps
    choices: list[list[tuple[str, int] | None]] = []
    for info in layers.values():
        items = []
        for fmt, d in info["divergence"].items():
            if math.isfinite(d["score"]):
                steps = math.ceil(d["score"] / budget * _STEPS - 1e-9) if d["score"] > 0 else 0
                items.append((fmt, steps, info["cost"][fmt] + 1e-15 * d["score"]))
        new, pick = [inf] * (_STEPS + 1), [None] * (_STEPS + 1)
        for u in range(_STEPS + 1):
            for fmt, steps, c in items:
                if steps <= u and best[u - steps] + c < new[u]:
                    new[u], pick[u] = best[u - steps] + c, (fmt, steps)
        best = new
        choices.append(pick)
    if best[_STEPS] == inf:
        return {}
    out, u = {}, _STEPS
    for fqn, pick in zip(reversed(list(layers)), reversed(choices), strict=True):
        fmt, steps = pick[u]
        out[fqn], u = fmt, u - steps
    return dict(reversed(list(out.items())))


def _solve_and_tighten(slots, ref, layers, budget, batches, loss_fn, seed, generator, bw, max_rounds):
    rounds: list[dict[str, float]] = []
    solver_budget = budget
    for _ in range(max_rounds):
        chosen = _knapsack(layers, solver_budget)
        if not chosen:
            break
        measured = _measure_plan(slots, ref, chosen, batches, loss_fn, seed, generator, bw)
        rounds.append({"solver_budget": solver_budget, "measured": measured["score"]})
        if measured["score"] <= budget:
            return chosen, measured, rounds
        solver_budget *= 0.8 * budget / measured["score"]
    fallback = dict.fromkeys(layers, "fp32")
    for info in layers.values():
        info["divergence"].setdefault("fp32", dict(_EXACT))
    rounds.append({"solver_budget": 0.0, "measured": 0.0})
    return fallback, {"loss": 0.0, "weight_grad": 0.0, "score": 0.0}, rounds


def _measure_plan(slots, ref, chosen, batches, loss_fn, seed, generator, bw) -> dict[str, float]:
    slots.set(chosen, generator)
    try:
        run: PassResult = run_pass(slots, batches, loss_fn, seed)
    finally:
        slots.set(dict.fromkeys(chosen, "fp32"), generator)
    d = divergences(ref, run, None)
    return {"loss": d["loss"], "weight_grad": d["weight_grad"], "score": d["loss"] + bw * d["weight_grad"]}


def _reason(fqn: str, chosen: dict, layers: dict, budget: float, rounds: list) -> str:
    fmt = chosen[fqn]
    info = layers[fqn]
    if rounds and rounds[-1]["solver_budget"] == 0.0:
        return "no mix of the given formats fit the budget when measured; kept in the model's precision"
    cheaper = [f for f, c in info["cost"].items() if c < info["cost"][fmt] and f in info["divergence"]]
    own = info["divergence"][fmt]["score"]
    if not cheaper:
        return f"cheapest format; score {own:.2e} ({own / budget:.0%} of the budget)"
    cheaper.sort(key=lambda g: info["cost"][g])
    d = info["divergence"][cheaper[0]]
    details = [f"{key} {d[key]:.1%}" for key in ("flushed", "saturated", "outlier_blocks") if d[key] >= 0.01]
    scores = [f"{g} would score {info['divergence'][g]['score']:.2e}" for g in cheaper]
    tightened = " after tightening" if len(rounds) > 1 else ""
    return (
        ", ".join(scores)
        + (f" ({cheaper[0]}: " + ", ".join(details) + ")" if details else "")
        + f"; budget {budget:.2e}{tightened}"
    )
