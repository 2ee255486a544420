"""The planner's measurements: one forward/backward over the planning batches with some layers swapped.

Layers are swapped in place for the length of one pass (a :class:`Slots` puts the originals back) and
share their parameters with the originals, so nothing the user holds changes; gradients come from
``torch.autograd.grad`` and never touch ``.grad``. Each batch of every pass starts from the same seed, so
dropout draws the same masks in the reference and in the quantized runs and only the format differs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mixprec.inspect._modules import call_loss, check_loss
from mixprec.inspect.lowbit import operand_stats
from mixprec.lowbit import LowbitLinear, get_recipe

#: The formats that are not a :mod:`mixprec.lowbit` recipe: a layer left in a float dtype.
HIGH_PRECISION = {"fp32": torch.float32, "bf16": torch.bfloat16}

#: ``loss_fn(model, batch) -> scalar tensor``, the planner's one loss contract.
LossFn = Callable[[nn.Module, Any], torch.Tensor]
#: Stochastic rounding's generator: one, or the planner's one per device the layers are on.
Generators = torch.Generator | dict[torch.device, torch.Generator] | None


@dataclass(frozen=True)
class PlanLimits:
    """The bounds a plan is chosen within, and how much the measurer measures before it is asked.

    ``budget``/``grad_budget``: the whole plan's loss and weight-gradient change (the cheapest plan);
    ``max_cost``/``min_low_share``: its cost and least share below bf16 (the most accurate plan);
    ``max_flushed``: the largest share of a layer's forward input or weight a candidate may flush;
    ``exhaustive``: measure every (layer, format) up front instead of on demand.
    """

    budget: float | None = None
    grad_budget: float | None = None
    max_cost: float | None = None
    min_low_share: float | None = None
    max_flushed: float = 1.0
    exhaustive: bool = False


@dataclass(frozen=True)
class Divergence:
    """One (layer, format)'s measurement: relative changes against the reference and quantization shares.

    ``loss``, ``weight_grad`` (all linears), ``input_grad`` (this layer's) are relative changes, None when
    the format was ruled out without a pass (``fprop_flushed`` over the limit) or, for ``input_grad``,
    when the layer's input needs no gradient; the shares are the worst GEMM operand's (``fprop_flushed``:
    of the forward input and weight only). ``loss_first_order``/``loss_second_order``: the local
    estimates' two loss terms (None for an exact measurement).
    """

    loss: float | None
    weight_grad: float | None
    input_grad: float | None
    error: float = 0.0
    flushed: float = 0.0
    saturated: float = 0.0
    outlier_blocks: float = 0.0
    fprop_flushed: float = 0.0
    loss_first_order: float | None = None
    loss_second_order: float | None = None

    def as_dict(self) -> dict[str, float | None]:
        """The record as :class:`~mixprec.plan.PrecisionPlan` keeps it (the local terms only when set)."""
        out = dataclasses.asdict(self)
        for key in ("loss_first_order", "loss_second_order"):
            if out[key] is None:
                del out[key]
        return out


#: The divergences of a layer left in the model's precision: the reference itself.
EXACT = Divergence(0.0, 0.0, 0.0)
#: A pass whose loss was not finite.
NONFINITE = Divergence(math.inf, math.inf, math.inf)


@dataclass(frozen=True)
class LayerMeasure:
    """One linear layer: its measured shape, its cost per format and its divergences per format.

    ``shape``: ``(M, N, K)`` of the first planning batch; ``priced_rows``: the rows M the cost is computed
    at; ``flops``: the three training GEMMs at those rows. ``divergence`` fills in as formats are measured.
    """

    shape: tuple[int, int, int]
    priced_rows: int
    flops: int
    cost: dict[str, float]
    divergence: dict[str, Divergence] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """The record as :class:`~mixprec.plan.PrecisionPlan` keeps it (plain JSON types)."""
        return {
            "shape": list(self.shape),
            "priced_rows": self.priced_rows,
            "flops": self.flops,
            "cost": dict(self.cost),
            "divergence": {fmt: d.as_dict() for fmt, d in self.divergence.items()},
        }


class CastLinear(nn.Linear):
    """An ``nn.Linear`` whose GEMM runs in ``dtype`` (the planner's stand-in for a bf16 layer)."""

    dtype: torch.dtype = torch.float32

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(self.dtype)
        return F.linear(input.to(self.dtype), self.weight.to(self.dtype), bias).to(input.dtype)


def swapped_in(linear: nn.Linear, fmt: str, generator: Generators) -> nn.Linear:
    """A module computing ``linear`` in ``fmt``, sharing its parameters; ``generator`` (stochastic rounding)
    is one generator or the planner's one per device, of which the one on ``linear``'s device is taken."""
    if fmt not in HIGH_PRECISION:
        if isinstance(generator, dict):
            generator = generator[linear.weight.device]
        return LowbitLinear.from_linear(linear, fmt, generator)
    if fmt == "fp32" and type(linear) is nn.Linear:
        return linear
    cls = nn.Linear if fmt == "fp32" else CastLinear
    with torch.device("meta"):
        new = cls(linear.in_features, linear.out_features, bias=False)
    if isinstance(new, CastLinear):
        new.dtype = HIGH_PRECISION[fmt]
    new.weight, new.bias = linear.weight, linear.bias
    new.train(linear.training)
    return new


class Slots:
    """The model's linear layers by qualified name, swappable for one pass and restored after."""

    def __init__(self, model: nn.Module, fqns: Sequence[str]) -> None:
        self.model = model
        self.originals: dict[str, nn.Linear] = {}
        for fqn in fqns:
            module = model.get_submodule(fqn)
            if not isinstance(module, nn.Linear):
                raise TypeError(f"{fqn!r} is a {type(module).__name__}, not an nn.Linear")
            self.originals[fqn] = module
        self.passes = 0  # forward/backward passes over a set of batches, for the plan's record

    def set(self, formats: dict[str, str], generator: Generators) -> None:
        for fqn, fmt in formats.items():
            self._put(fqn, swapped_in(self.originals[fqn], fmt, generator))

    def restore(self) -> None:
        for fqn, module in self.originals.items():
            self._put(fqn, module)

    def _put(self, fqn: str, module: nn.Module) -> None:
        parent, _, child = fqn.rpartition(".")
        setattr(self.model.get_submodule(parent), child, module)


@dataclass(frozen=True)
class Kept:
    """One layer's operands of one batch, kept for the one-pass estimates (:mod:`mixprec.plan.local`)."""

    x: torch.Tensor
    y: torch.Tensor
    grad_y: torch.Tensor
    x_requires_grad: bool


@dataclass
class PassResult:
    """One pass: per-batch losses, weight gradients summed over batches, per-batch layer input gradients."""

    losses: list[float]
    weight_grads: list[torch.Tensor]
    input_grads: list[dict[str, torch.Tensor]]
    #: with ``capture``: per layer, the first batch's ``{"x", "w", "go"}`` (float32, 2-D)
    captured: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    #: with ``keep``: per batch, per layer
    kept: list[dict[str, Kept]] = field(default_factory=list)


@dataclass(frozen=True)
class PassRunner:
    """What every pass shares: the swappable layers, the loss, the seed and the rounding generators."""

    slots: Slots
    loss_fn: LossFn
    seed: int
    generator: Generators

    def run(
        self, batches: Sequence[Any], *, capture: bool = False, keep: bool = False, first: bool = False
    ) -> PassResult:
        """Forward and backward of ``loss_fn(model, batch)`` for each batch with the layers as they are now.

        With ``capture``, the first batch's layer inputs, weights and output gradients are kept (float32,
        flattened to 2-D) for the quantization statistics. With ``keep``, every batch's layer inputs,
        outputs and output gradients are kept as they are (detached; memory: about ``2 x (in + 2 x out)``
        values per row per layer, for the one-pass estimates of :mod:`mixprec.plan.local`). With ``first``
        (the reference pass), a ``loss_fn`` that fails is reported with the signature it must have
        (:func:`~mixprec.inspect._modules.call_loss`).
        """
        slots = self.slots
        slots.passes += 1
        fqns = list(slots.originals)
        weights = [slots.originals[f].weight for f in fqns]
        result = PassResult([], [torch.zeros_like(w, dtype=torch.float32) for w in weights], [])
        for index, batch in enumerate(batches):
            seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
            handles = [slots.model.get_submodule(f).register_forward_hook(_recorder(f, seen)) for f in fqns]
            torch.manual_seed(self.seed + index)
            try:
                with torch.enable_grad():
                    if first:
                        loss = call_loss(self.loss_fn, slots.model, batch, "plan_precision")
                    else:
                        loss = check_loss(self.loss_fn(slots.model, batch))
            finally:
                for handle in handles:
                    handle.remove()
            if not torch.isfinite(loss.detach()).all():
                result.losses.append(math.inf)
                continue
            self._backward(result, loss, weights, seen, capture=capture and index == 0, keep=keep)
        return result

    def run_with(self, formats: dict[str, str], batch_sets: Sequence[Sequence[Any]]) -> list[PassResult]:
        """One pass per set of batches with the layers of ``formats`` in those formats, put back in fp32
        after."""
        self.slots.set(formats, self.generator)
        try:
            return [self.run(batches) for batches in batch_sets]
        finally:
            self.slots.set(dict.fromkeys(formats, "fp32"), self.generator)

    def _backward(
        self,
        result: PassResult,
        loss: torch.Tensor,
        weights: list[torch.Tensor],
        seen: dict[str, tuple[torch.Tensor, torch.Tensor]],
        *,
        capture: bool,
        keep: bool,
    ) -> None:
        # a frozen layer's weight (requires_grad=False) has no gradient: its total stays zero
        trained = [(t, w) for t, w in zip(result.weight_grads, weights, strict=True) if w.requires_grad]
        grad_in = [f for f, (x, _) in seen.items() if x.requires_grad]
        grad_out = [f for f, (_, y) in seen.items() if y.requires_grad] if capture or keep else []
        targets = [*(w for _, w in trained), *(seen[f][0] for f in grad_in), *(seen[f][1] for f in grad_out)]
        grads = torch.autograd.grad(loss, targets, allow_unused=True) if targets else ()
        result.losses.append(float(loss.detach()))
        for (total, _), g in zip(trained, grads[: len(trained)], strict=True):
            if g is not None:
                total += g.float()
        inputs = grads[len(trained) : len(trained) + len(grad_in)]
        in_grads = {f: g.float() for f, g in zip(grad_in, inputs, strict=True) if g is not None}
        result.input_grads.append(in_grads)
        outs = dict(zip(grad_out, grads[len(trained) + len(grad_in) :], strict=True))
        if keep:
            result.kept.append(
                {
                    f: Kept(seen[f][0].detach(), seen[f][1].detach(), g, seen[f][0].requires_grad)
                    for f, g in outs.items()
                    if g is not None
                }
            )
        if capture:
            for fqn, (x, _) in seen.items():
                entry = {"x": _flat(x), "w": self.slots.originals[fqn].weight.detach().float()}
                if outs.get(fqn) is not None:
                    entry["go"] = _flat(outs[fqn])
                result.captured[fqn] = entry


def _recorder(fqn: str, seen: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> Callable[..., None]:
    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        seen.setdefault(fqn, (args[0], output))  # a layer called twice is measured at its first call

    return hook


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1, t.shape[-1]).float()


def divergences(ref: PassResult, run: PassResult, fqn: str | None) -> Divergence:
    """Relative loss change, weight-gradient change (all linears) and ``fqn``'s input-gradient change."""
    if any(loss == math.inf for loss in run.losses):
        return NONFINITE
    tiny = torch.finfo(torch.float32).tiny
    delta = sum(abs(a - b) for a, b in zip(run.losses, ref.losses, strict=True))
    loss = delta / max(sum(abs(b) for b in ref.losses), tiny)
    num = sum(float((a - b).square().sum()) for a, b in zip(run.weight_grads, ref.weight_grads, strict=True))
    den = sum(float(b.square().sum()) for b in ref.weight_grads)
    weight_grad = (num / max(den, tiny)) ** 0.5
    batches = zip(run.input_grads, ref.input_grads, strict=False)
    pairs = [(a[fqn], b[fqn]) for a, b in batches if fqn is not None and fqn in a and fqn in b]
    input_grad = None
    if pairs:
        num = sum(float((a - b).square().sum()) for a, b in pairs)
        den = sum(float(b.square().sum()) for _, b in pairs)
        input_grad = (num / max(den, tiny)) ** 0.5
    return Divergence(loss, weight_grad, input_grad)


class Measurer:
    """Each layer's divergences per format (``layers[fqn].divergence[fmt]``), measured on demand and
    each (layer, format) at most once: one forward/backward over the batches with that layer alone in
    that format. Quantization statistics come from the reference pass's captured operands, so a format
    over ``limits.max_flushed`` needs no pass to be ruled out (unless ``limits.exhaustive``).

    ``cost_fn(format, m, n, k)`` prices every format at ``rows`` (the run's step; None: each layer's
    calibration rows) while the errors are measured on ``batches``.
    """

    def __init__(
        self,
        runner: PassRunner,
        ref: PassResult,
        *,
        batches: Sequence[Any],
        cost_fn: Callable[[str, int, int, int], float],
        formats: Sequence[str],
        limits: PlanLimits,
        rows: int | None = None,
    ) -> None:
        self.runner, self.ref, self.batches = runner, ref, batches
        self.formats, self.limits = list(formats), limits
        self.layers: dict[str, LayerMeasure] = {}
        for fqn in runner.slots.originals:
            captured = ref.captured.get(fqn)
            if captured is None:
                continue  # never called on these batches: nothing to measure, left as it is
            m, k = captured["x"].shape
            n = captured["w"].shape[0]
            priced = m if rows is None else rows  # errors are measured at m, the cost is the run's
            costs = {fmt: float(cost_fn(fmt, priced, n, k)) for fmt in (*formats, "bf16", "fp32")}
            self.layers[fqn] = LayerMeasure((m, n, k), priced, 6 * priced * n * k, costs)

    def measure(self, fqn: str, fmt: str) -> Divergence:
        done = self.layers[fqn].divergence
        if fmt not in done:
            done[fmt] = self._one(fqn, fmt)
        return done[fmt]

    def cheapest(self, grad_limit: float) -> None:
        """Per layer, the formats in order of cost until the cheapest admissible one (and its equals)."""
        for fqn, info in self.layers.items():
            found = None
            for fmt in sorted(self.formats, key=lambda f: info.cost[f]):
                if found is not None and info.cost[fmt] > found:
                    break
                d = self.measure(fqn, fmt)
                flushed = d.fprop_flushed > self.limits.max_flushed
                wgrad = d.weight_grad
                if d.loss is not None and wgrad is not None and not flushed and wgrad <= grad_limit:
                    found = info.cost[fmt]

    def complete(self) -> bool:
        """Measure every (layer, format) not measured yet; True if there was any."""
        todo = [
            (f, fmt) for f, info in self.layers.items() for fmt in self.formats if fmt not in info.divergence
        ]
        for fqn, fmt in todo:
            self.measure(fqn, fmt)
        return bool(todo)

    def switch_to_exact(self) -> bool:
        """Re-measure every estimated (layer, format) exactly from now on; False: already exact."""
        return False

    def _one(self, fqn: str, fmt: str) -> Divergence:
        if fmt == "fp32":
            return EXACT
        stats = {"error": 0.0, "flushed": 0.0, "saturated": 0.0, "outlier_blocks": 0.0}
        forward = 0.0
        if fmt not in HIGH_PRECISION:
            per_operand = operand_stats(self.ref.captured[fqn], get_recipe(fmt), 8.0)
            stats = {key: max((getattr(s, key) for s in per_operand.values()), default=0.0) for key in stats}
            forward = max((s.flushed for op, s in per_operand.items() if op.startswith("fprop")), default=0.0)
        if forward > self.limits.max_flushed and not self.limits.exhaustive:  # ruled out: no pass needed
            return Divergence(None, None, None, fprop_flushed=forward, **stats)
        return dataclasses.replace(self._divergences(fqn, fmt), fprop_flushed=forward, **stats)

    def _divergences(self, fqn: str, fmt: str) -> Divergence:
        """One forward/backward over the batches with ``fqn`` alone in ``fmt``."""
        return divergences(self.ref, self.runner.run_with({fqn: fmt}, [self.batches])[0], fqn)
