"""`plan_precision`: which linear layer can run in which low-bit format, decided by measurement.

The method (after SNIP, "Adaptive mixed precision for sub-byte LLM training", ASPLOS 2026: per-layer
forward loss divergence and backward weight divergence, then an integer program over the layers):

1. **Reference**: one forward/backward of ``loss_fn(model, batch)`` over the planning batches with every
   linear layer at the model's own (high) precision: losses, every linear's weight gradient, every
   layer's input gradient, and (first batch) each layer's input, weight and output gradient.
2. **Per layer and format**, that layer alone swapped to the format, one forward/backward over the
   batches: the forward divergence ``sum_b |L_b - L_ref_b| / sum_b |L_ref_b|`` (the relative loss
   change, an upper bound of the relative increase of the mean loss), the backward divergences
   ``||G - G_ref|| / ||G_ref||`` of all linears' weight gradients and of the layer's input gradient, and
   the quantization statistics of its six GEMM operands (:func:`mixprec.inspect.lowbit_report`'s error,
   flushed, saturated and outlier-set-block shares, from the reference's captured operands, no pass).
   Measured on demand, each (layer, format) at most once: first each layer's cheapest admissible
   format; if that assignment fits the budget no other is cheaper, so the other formats are measured
   only when it does not (``exhaustive=True`` measures all of them up front, for the table and plot).
3. **Choose** the cheapest assignment, one format per layer, whose summed loss divergence fits the
   budget (ties: the smaller summed weight-gradient divergence): a multiple-choice knapsack (Sinha and
   Zoltners, Operations Research 27(3), 1979; Kellerer, Pferschy and Pisinger, "Knapsack Problems",
   Springer 2004, ch. 11), solved exactly by dynamic programming over the budget in 1000 steps with each
   divergence rounded up, so the sum never undercounts. A format that flushes more than ``max_flushed``
   of the nonzero values of the layer's forward input or weight to zero (``fprop_flushed``) is not a
   candidate for that layer: the signal it drops is one the model may not use yet, so a loss measured
   at one point of training cannot see what it costs later (the README shows a layer whose small
   measured loss change hid a large held-out loss after training).
   With ``grad_budget``, the root-sum-square of the chosen formats' weight-gradient divergences must fit
   it too (a second knapsack constraint, the layers' gradient errors taken as independent).
4. **Measure the plan as a whole** (all its layers swapped at once, one forward/backward over the
   batches, and over ``check_batches`` when given: batches the layers were not measured on, so the
   choice cannot have picked their noise). Effects of layers do not simply add, so while the measured
   loss divergence (the larger of the two sets) is over the budget, the solver's budget is cut by
   ``0.8 * budget / measured`` and the plan re-solved and re-measured (and likewise the weight-gradient
   limit against ``grad_budget``), at most ``max_rounds`` solves; the returned plan's measured loss
   divergence fits the budget, and if no mix of the given formats does, every layer stays in the model's
   precision (``"fp32"``, divergence 0).

The dual question, the most accurate plan a cost allows (``max_cost``, optionally ``min_low_share``:
e.g. a hand rule's own cost and share, to compare with it), measures every layer in every format, takes
the (up to 3) assignments of least summed squared weight-gradient divergence within the bounds, measures
each as a whole and returns the one whose weight gradients changed least.

The cost of a format for a layer is the roofline time of its three training GEMMs on a named GPU
(:mod:`mixprec.lowbit.cost`, the model :func:`mixprec.lowbit.auto_filter` uses too), timed on the
model's device, or a user's ``cost(format, m, n, k)``, at ``M = tokens_per_step`` rows (the run's step;
the calibration batch's rows, with a warning, when it is not given) while the errors are measured on the
calibration batches.
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from mixprec.inspect._modules import LossInputError, check_model, describe
from mixprec.inspect._restore import preserved
from mixprec.lowbit.cost import TARGETS, quantize_path
from mixprec.plan.config import PlanConfig
from mixprec.plan.cost import resolve_cost
from mixprec.plan.local import LocalMeasurer
from mixprec.plan.measure import (
    EXACT,
    Divergence,
    LayerMeasure,
    LossFn,
    Measurer,
    PassResult,
    PassRunner,
    PlanLimits,
    Slots,
    divergences,
)
from mixprec.plan.memory import MemoryModel, fit_memory
from mixprec.plan.result import PrecisionPlan
from mixprec.plan.solve import knapsack, most_accurate, reason, reason_at_cost

__all__ = ["plan_precision"]


def plan_precision(
    model: nn.Module,
    batches: Iterable[Any],
    loss_fn: LossFn,
    config: PlanConfig | None = None,
    *,
    check_batches: Iterable[Any] | None = None,
    **options: Any,
) -> PrecisionPlan:
    """Plan a format per ``nn.Linear`` of ``model`` so that the whole plan's measured loss change fits.

    See the module doc for the method. The model is handed back exactly as it was (parameters, buffers,
    ``.grad``, modes, RNG state; layers already converted by :mod:`mixprec.lowbit` are measured and
    reported as plain layers). The settings are one :class:`~mixprec.plan.PlanConfig`, given as
    ``config`` or built from the keyword options below (its fields, with its defaults).

    Args:
        model: the model; its linear layers (exact ``nn.Linear`` or ``LowbitLinear``) are planned.
        batches: the planning batches (a few; each is passed to ``loss_fn`` as is).
        loss_fn: ``loss_fn(model, batch) -> scalar tensor``.
        config: the settings as one :class:`~mixprec.plan.PlanConfig`; or none, and the settings below as
            keyword arguments (``**options``, which build the config; not both).
        check_batches: optional batches on which the whole plan must fit the budget too (not used to
            measure single layers).

    Keyword Args:
        formats: candidate formats: :mod:`mixprec.lowbit` recipe names, ``"bf16"``, ``"fp32"``.
        budget: the bound (> 0) on the whole plan's measured relative loss change against the
            high-precision run on these batches (0.01 = 1 %): the plan is the cheapest that fits it.
            None together with ``max_cost``.
        cost: a target name (``"b200"``, ``"h100"``), ``"measured"`` (timed on the model's device) or
            ``cost(format, m, n, k) -> float``; None: ``"measured"`` on a CUDA model, else ``"b200"``.
        tokens_per_step: the rows M of every linear layer's GEMMs in one training step of the run
            (batch x sequence length per rank): each format is priced at ``(tokens_per_step, N, K)``
            while its errors are measured on ``batches``. None: priced at the calibration batch's own
            rows, with a warning naming them (a small calibration batch makes every low-bit GEMM
            look memory-bound, so the plan would be for the calibration batch, not the run).
        grad_budget: an optional second bound (> 0) on the whole plan's measured relative change of the
            weight gradients (all linears, ``||G - G_ref|| / ||G_ref||``); None: gradients only break ties.
        max_flushed: the largest share (in (0, 1]) of the nonzero values of a layer's forward input or
            weight that a candidate format may flush to zero (1: no limit).
        max_cost: instead of a loss budget, a bound on the plan's GEMM cost relative to every planned
            layer in bf16 (0.5 = half of bf16's time in the cost model): the plan is then the *most
            accurate* within it: of the (up to 3) assignments of least summed squared weight-gradient
            divergence whose cost fits, the one whose whole-plan weight-gradient change measures least
            (then loss change; see ``mixprec.plan.solve`` for why the gradient decides).
            Needs ``budget=None``; no ``grad_budget``.
        min_low_share: with ``max_cost``, the least share in [0, 1] of the planned layers' GEMM FLOPs that
            must run below bf16 (to compare with a hand rule at its share; None: no bound).
        exhaustive: measure every layer in every format (for the table and plot) instead of only what
            the choice needs; the plan is the same up to stochastic-rounding draws.
        max_rounds: solves at most (>= 1) before falling back to the model's precision.
        seed: seeds dropout (the same masks in every pass) and stochastic rounding.
        measure: ``"exact"`` (one forward/backward per layer and format) or ``"local"`` (every layer and
            format estimated from the reference pass alone, ``mixprec.plan.local``).
        max_memory: a bound on the training step's memory (bytes as an int, or ``"2GiB"``, ``"512MB"``):
            weights, gradients, optimizer state and the planned linears' saved inputs at
            ``tokens_per_step`` rows (``mixprec.plan.memory``). The plan then also picks one optimizer
            state format and one saved-activation format for the whole model: of the pairs that fit, the
            one that keeps the most bytes (quantizes the least). It does not change the GEMM formats
            (they do not change memory). None: the first-listed formats, memory reported only.
        state_formats: candidate ``state_format=`` values of the optimizer, preferred first (None: fp32
            moments).
        activation_formats: candidate :func:`mixprec.lowbit.save_activations` formats, preferred first
            (None: saved as they are).
        weight_update: how the model is stepped, for the memory model: ``"kahan"`` or ``"stochastic"``
            (:class:`mixprec.CompensatedOptimizer`, Kahan keeps one buffer per low-precision weight) or
            ``"masters"`` (:class:`mixprec.MixedPrecisionOptimizer`, fp32 masters of low-precision weights).
        compiled: price each format on the path a ``torch.compile``-d run takes: with ``cost="measured"``
            (the default on CUDA) the layer is timed under ``torch.compile``, and the plan's ``target``
            ends in ``":compiled"``; a roofline target prices the quantization fused (``quantize``'s
            ``"fused"`` path); a callable has one figure for both paths, so it prices the compiled run
            at that figure, with a warning saying so. False: the eager path.
        quantize: the path a roofline target prices each operand's quantization on: ``"fused"``,
            ``"triton"`` (CUDA eager) or ``"unfused"`` (pure torch); None: the path the run takes
            (``"fused"`` if ``compiled``, else ``"unfused"`` under ``MIXPREC_FUSED_QUANTIZE=0``, else
            ``"triton"``; :func:`mixprec.lowbit.cost.quantize_path`).

    Returns:
        A :class:`~mixprec.plan.PrecisionPlan`.

    Raises:
        TypeError: for a non-module ``model``, a non-callable ``loss_fn`` or ``cost``, an unknown keyword
            option, or a ``config`` together with keyword options (or one that is not a PlanConfig);
            ``batches`` that is one batch (a tensor, a dict) or not iterable; a ``loss_fn`` that raises on
            the reference pass (the message states ``loss_fn(model, batch) -> scalar tensor`` and what
            was passed; the original error is chained).
        ValueError: for a budget or grad_budget that is not a finite number > 0, a max_flushed
            outside (0, 1], a measure other than "exact" or "local", an empty ``batches``
            (or ``check_batches`` given empty), an unknown format or cost target, a model without linear
            layers (or that is one), a model with parameters or buffers on the meta device, or a
            ``loss_fn`` that returns a non-scalar loss, or a non-finite one at high precision; a
            ``max_memory`` that is not a size, or below the least memory the candidate state and
            activation formats reach (the message names that least memory); unknown state or activation
            formats or ``weight_update``. Nothing is changed then.

    Warns:
        UserWarning: naming the ``nn.Linear`` layers ``loss_fn`` never called (left out of the plan,
            listed in its ``not_run``, they stay as they are); and, without ``tokens_per_step``, naming
            the calibration rows every GEMM was priced at; with ``compiled=True`` and a callable cost
            (one figure per format), that it prices the compiled run at it.
    """
    start = time.process_time()
    if config is None:
        config = PlanConfig.from_options(options)
    elif options:
        raise TypeError(
            f"plan_precision takes a config or keyword options, not both: got config and {sorted(options)}"
        )
    elif not isinstance(config, PlanConfig):
        raise TypeError(f"config must be a mixprec.plan.PlanConfig, got {type(config).__name__}")
    check_model(model)
    on_meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if on_meta:  # nothing to measure: torch would fail deep inside with "META device type not an accelerator"
        raise ValueError(
            f"plan_precision needs a model with real weights; {len(on_meta)} tensor(s) are on the meta "
            f"device (first: {on_meta[0]!r}): materialize it (model.to_empty(device=...), then initialize)"
        )
    batches, checks = _check_batches(batches, check_batches, loss_fn)
    formats, budget, tokens_per_step = list(config.formats), config.budget, config.tokens_per_step
    max_cost, measure, weight_update = config.max_cost, config.measure, config.weight_update
    bound = config.max_memory_bytes
    states, acts = list(config.state_formats), list(config.activation_formats)
    if bound is not None:  # the parameters' part alone is a lower bound: refuse before any pass
        params_only = MemoryModel.of(model, {}, weight_update)
        fit_memory(params_only, bound, states, acts, "weights, gradients and optimizer state alone")
    target, cost_fn = resolve_cost(
        config.cost, model, formats, compiled=config.compiled, quantize=config.quantize
    )
    if config.compiled and callable(config.cost) and not target.endswith(":compiled"):
        warnings.warn(
            f"plan_precision: compiled=True, but the cost {target!r} has one figure per format: the "
            f"compiled run is priced at it; cost='measured' times the compiled layers on the model's "
            f"device, a target name prices the fused quantization",
            UserWarning,
            stacklevel=2,
        )
    fqns = [f for f, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not fqns:
        raise ValueError("model has no nn.Linear layer to plan")
    if fqns[0] == "":
        raise ValueError("model itself is an nn.Linear: wrap it (nn.Sequential(model)) so it can be swapped")
    # stochastic rounding draws on each layer's device (a CPU generator cannot feed CUDA tensors): one
    # generator per device the layers are on, each seeded with the seed
    with preserved(model):
        slots = Slots(model, fqns)
        devices = {linear.weight.device for linear in slots.originals.values()}
        generator = {device: torch.Generator(device=device).manual_seed(config.seed) for device in devices}
        runner = PassRunner(slots, loss_fn, config.seed, generator)
        try:
            slots.set(dict.fromkeys(fqns, "fp32"), generator)
            tick = time.process_time()
            ref = runner.run(batches, capture=True, keep=measure == "local", first=True)
            step = (time.process_time() - tick) / len(batches)
            sets = [(batches, ref)]
            if checks:
                sets.append((checks, runner.run(checks, first=True)))
            losses = [loss for _, r in sets for loss in r.losses]
            if not all(math.isfinite(loss) for loss in losses):
                raise ValueError(f"loss_fn returned a non-finite loss at high precision: {losses}")
            limits = PlanLimits(
                budget=budget,
                grad_budget=config.grad_budget,
                max_cost=max_cost,
                min_low_share=config.min_low_share,
                max_flushed=config.max_flushed,
                exhaustive=config.exhaustive,
            )
            measurer = (LocalMeasurer if measure == "local" else Measurer)(
                runner,
                ref,
                batches=batches,
                cost_fn=cost_fn,
                formats=formats,
                limits=limits,
                rows=tokens_per_step,
            )
            if max_cost is None:
                chosen, measured, rounds = _solve_and_tighten(runner, sets, measurer, config.max_rounds)
            else:
                chosen, measured, rounds = _solve_at_cost(runner, sets, measurer)
        finally:
            slots.restore()
    layers = measurer.layers
    never_ran = [f for f in fqns if f not in layers or f not in chosen]
    if never_ran:  # nothing was measured for them: they stay as they are, out of the plan
        warnings.warn(
            f"plan_precision: loss_fn never called {never_ran}; not in the plan, they stay as they are",
            UserWarning,
            stacklevel=2,
        )
    if tokens_per_step is None:
        _warn_calibration_rows(layers)
    ran = [f for f in fqns if f not in never_ran]
    rows = {f: tokens_per_step or layers[f].shape[0] for f in ran}
    memory = MemoryModel.of(model, rows, weight_update)
    state_format, activation_format, pairs = fit_memory(memory, bound, states, acts)
    if max_cost is None:
        reasons = {f: reason(f, chosen, layers, limits, rounds) for f in ran}
    else:
        reasons = {f: reason_at_cost(f, chosen, layers, limits) for f in ran}
    seconds = time.process_time() - start
    return PrecisionPlan(
        formats=chosen,
        layers={fqn: info.as_dict() for fqn, info in layers.items()},
        reasons=reasons,
        budget=budget,
        measured=measured,
        rounds=rounds,
        target=target,
        grad_budget=config.grad_budget,
        seconds=seconds,
        step_seconds=step,
        passes=slots.passes,
        measure=measure + ("+exact" if any("switched_to_exact" in r for r in rounds) else ""),
        max_cost=max_cost,
        min_low_share=config.min_low_share,
        tokens_per_step=tokens_per_step,
        not_run=never_ran,
        state_format=state_format,
        activation_format=activation_format,
        memory={
            "max_memory": bound,
            "weight_update": weight_update,
            "components": memory.components(state_format, activation_format),
            "options": pairs,
        },
        # a "-peak" target prices compute only: no quantization path entered its cost
        quantize=(
            quantize_path(config.quantize, compiled=config.compiled)
            if target in TARGETS and TARGETS[target].roofline
            else None
        ),
    )


def _warn_calibration_rows(layers: dict[str, LayerMeasure]) -> None:
    """Say that the plan was priced at the calibration batch's rows, and how to price the run."""
    rows = sorted({info.shape[0] for info in layers.values()})
    shown = str(rows[0]) if len(rows) == 1 else f"{rows[0]}-{rows[-1]}"
    warnings.warn(
        f"plan_precision: tokens_per_step not given, so every GEMM is priced at the calibration batch's "
        f"{shown} rows; pass tokens_per_step=N (the rows of each layer's GEMMs in one training step) "
        f"to plan for the run's shape",
        UserWarning,
        stacklevel=3,
    )


def _check_batches(
    batches: Iterable[Any], check_batches: Iterable[Any] | None, loss_fn: LossFn
) -> tuple[list[Any], list[Any] | None]:
    """The batches as lists (a generator is read once), checked non-empty; ``loss_fn`` callable."""
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable loss_fn(model, batch) -> loss, got {loss_fn!r}")
    batches = _batch_list(batches, "batches")
    if not batches:
        raise ValueError("batches is empty: the planner needs at least one batch to measure on")
    checks = None if check_batches is None else _batch_list(check_batches, "check_batches")
    if checks is not None and not checks:
        raise ValueError("check_batches is empty: pass None to check the plan on the planning batches only")
    return batches, checks


#: The batch sets a whole plan is measured on: the planning batches and (optional) check batches, each
#: with its reference pass.
BatchSets = list[tuple[list[Any], PassResult]]
#: A solve's outcome: the formats, the whole plan's measured divergences, one record per solve.
Solved = tuple[dict[str, str], dict[str, float], list[dict[str, float]]]


def _solve_and_tighten(runner: PassRunner, sets: BatchSets, measurer: Measurer, max_rounds: int) -> Solved:
    """Solve, measure the whole plan, tighten; the first solve sees only each layer's cheapest admissible
    formats (enough when they fit: no assignment is cheaper), the rest are measured when it does not."""
    limits = measurer.limits
    budget, grad_budget = limits.budget, limits.grad_budget
    assert budget is not None  # checked by plan_precision: this mode has a loss budget
    layers = measurer.layers
    rounds: list[dict[str, float]] = []
    solver_budget, grad_limit = budget, math.inf if grad_budget is None else grad_budget
    if limits.exhaustive:
        measurer.complete()
    else:
        measurer.cheapest(grad_limit)
    while len(rounds) < max_rounds:
        chosen = knapsack(layers, solver_budget, grad_limit, limits.max_flushed)
        if not chosen and measurer.complete():
            continue  # the cheapest formats did not fit: solve again with every format measured
        if not chosen:
            break
        measured = _measure_plan(runner, sets, chosen)
        rounds.append({"solver_budget": solver_budget, "measured": measured["loss"]})
        loss_ok = measured["loss"] <= budget
        grad_ok = grad_budget is None or measured["weight_grad"] <= grad_budget
        if loss_ok and grad_ok:
            return chosen, measured, rounds
        if grad_budget is not None and not grad_ok and measurer.switch_to_exact():
            # estimates undercount the gradient change: measure the layers and solve afresh
            rounds[-1]["switched_to_exact"] = 1.0
            solver_budget, grad_limit = budget, grad_budget
            continue
        measurer.complete()
        if not loss_ok:
            solver_budget *= 0.8 * budget / measured["loss"]
        if grad_budget is not None and not grad_ok:
            grad_limit *= 0.8 * grad_budget / measured["weight_grad"]
    fallback = dict.fromkeys(layers, "fp32")
    for info in layers.values():
        info.divergence.setdefault("fp32", EXACT)
    rounds.append({"solver_budget": 0.0, "measured": 0.0})
    return fallback, {"loss": 0.0, "weight_grad": 0.0}, rounds


def _solve_at_cost(runner: PassRunner, sets: BatchSets, measurer: Measurer) -> Solved:
    """Every layer in every format measured, the (up to 3) assignments of least summed squared
    weight-gradient divergence within the bounds, each measured as a whole; the one of least measured
    weight-gradient change (then loss change) is the plan."""
    limits = measurer.limits
    max_cost, min_low_share = limits.max_cost, limits.min_low_share
    assert max_cost is not None  # checked by plan_precision: this mode has a cost bound
    layers = measurer.layers
    bf16 = sum(info.cost["bf16"] for info in layers.values())
    cheapest = sum(min(info.cost[f] for f in measurer.formats) for info in layers.values()) / bf16
    if cheapest > max_cost * (1 + 1e-9):
        raise ValueError(
            f"max_cost={max_cost!r} is below the cheapest mix of these formats ({cheapest:.4f}x bf16)"
        )
    measurer.complete()
    flops = sum(info.flops for info in layers.values())
    high = math.inf if min_low_share is None else (1 - min_low_share) * flops
    picks = most_accurate(layers, max_cost * bf16, high, limits.max_flushed)
    if not picks:
        bounds = f"max_cost={max_cost!r}" + (
            "" if min_low_share is None else f" and min_low_share={min_low_share!r}"
        )
        # the bounds alone, every format admissible: is it the flushing, or the cost and share together?
        free = Divergence(0.0, 0.0, 0.0)
        relaxed = {
            f: dataclasses.replace(info, divergence=dict.fromkeys(measurer.formats, free))
            for f, info in layers.items()
        }
        if not most_accurate(relaxed, max_cost * bf16, high, 1.0, top=1):
            raise ValueError(
                f"no mix of the formats {measurer.formats} meets {bounds} together, whatever each format "
                "flushes: raise max_cost, lower min_low_share, or add a low-bit format cheaper than bf16 at "
                "this shape"
            )
        raise ValueError(
            f"no mix of the formats {measurer.formats} within {bounds} has every layer's format flushing at "
            f"most max_flushed={limits.max_flushed!r} of its forward input"
        )
    found = []
    for chosen in picks:
        measured = _measure_plan(runner, sets, chosen)
        found.append((measured["loss"], measured["weight_grad"], chosen, measured))
    rounds = [{"max_cost": max_cost, "measured": loss, "weight_grad": w} for loss, w, *_ in found]
    _, _, chosen, measured = min(found, key=lambda item: (item[1], item[0]))
    return chosen, measured, rounds


def _measure_plan(runner: PassRunner, sets: BatchSets, chosen: dict[str, str]) -> dict[str, float]:
    """The whole plan's divergences: the larger over the planning batches and the check batches."""
    runs = runner.run_with(chosen, [batches for batches, _ in sets])
    found = [divergences(ref, run, None) for (_, ref), run in zip(sets, runs, strict=True)]
    out = {
        "loss": max(d.loss for d in found if d.loss is not None),
        "weight_grad": max(d.weight_grad for d in found if d.weight_grad is not None),
    }
    if len(found) > 1:
        check = found[1]
        assert check.loss is not None and check.weight_grad is not None  # a measured pass has both
        out["check_loss"], out["check_weight_grad"] = check.loss, check.weight_grad
    return out


def _batch_list(batches: Any, name: str) -> list[Any]:
    """``batches`` as a list, after checking it is an iterable of batches and not one batch: a tensor or a
    dict would be split into rows or keys, each then passed to ``loss_fn`` as a batch."""
    if isinstance(batches, (torch.Tensor, dict, str, bytes)) or not isinstance(batches, Iterable):
        raise LossInputError(
            f"{name} must be an iterable of batches (a list or a DataLoader), each passed to "
            f"loss_fn(model, batch) as is; got one {describe(batches)}: for a single batch pass [batch]"
        )
    return list(batches)
