"""The planner's measurements: one forward/backward over the planning batches with some layers swapped.

Layers are swapped in place for the length of one pass (a :class:`Slots` puts the originals back) and
share their parameters with the originals, so nothing the user holds changes; gradients come from
``torch.autograd.grad`` and never touch ``.grad``. Each batch of every pass starts from the same seed, so
dropout draws the same masks in the reference and in the quantized runs and only the format differs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mixprec.inspect.lowbit import _layer
from mixprec.lowbit import LowbitLinear, get_recipe

#: The formats that are not a :mod:`mixprec.lowbit` recipe: a layer left in a float dtype.
HIGH_PRECISION = {"fp32": torch.float32, "bf16": torch.bfloat16}


class CastLinear(nn.Linear):
    """An ``nn.Linear`` whose GEMM runs in ``dtype`` (the planner's stand-in for a bf16 layer)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(self.dtype)
        return F.linear(input.to(self.dtype), self.weight.to(self.dtype), bias).to(input.dtype)


def swapped_in(
    linear: nn.Linear, fmt: str, generator: torch.Generator | dict[torch.device, torch.Generator] | None
) -> nn.Linear:
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
    new.weight, new.bias = linear.weight, linear.bias
    new.dtype = HIGH_PRECISION[fmt]
    new.train(linear.training)
    return new


class Slots:
    """The model's linear layers by qualified name, swappable for one pass and restored after."""

    def __init__(self, model: nn.Module, fqns: Sequence[str]) -> None:
        self.model = model
        self.originals = {fqn: model.get_submodule(fqn) for fqn in fqns}
        self.passes = 0  # forward/backward passes over a set of batches, for the plan's record

    def set(self, formats: dict[str, str], generator: torch.Generator | None) -> None:
        for fqn, fmt in formats.items():
            self._put(fqn, swapped_in(self.originals[fqn], fmt, generator))

    def restore(self) -> None:
        for fqn, module in self.originals.items():
            self._put(fqn, module)

    def _put(self, fqn: str, module: nn.Module) -> None:
        parent, _, child = fqn.rpartition(".")
        setattr(self.model.get_submodule(parent), child, module)


@dataclass
class PassResult:
    """One pass: per-batch losses, weight gradients summed over batches, per-batch layer input gradients."""

    losses: list[float]
    weight_grads: list[torch.Tensor]
    input_grads: list[dict[str, torch.Tensor]]
    captured: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    #: with ``keep``: per batch, per layer (input x, output y, output gradient g_y, x requires grad)
    kept: list[dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]]] = field(default_factory=list)


def run_pass(
    slots: Slots,
    batches: Sequence[Any],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    seed: int,
    capture: bool = False,
    keep: bool = False,
) -> PassResult:
    """Forward and backward of ``loss_fn(model, batch)`` for each batch with the layers as they are now.

    With ``capture``, the first batch's layer inputs, weights and output gradients are kept (float32,
    flattened to 2-D) for the quantization statistics. With ``keep``, every batch's layer inputs, outputs
    and output gradients are kept as they are (detached; memory: about ``2 x (in + 2 x out)`` values per
    row per layer, for the one-pass estimates of :mod:`mixprec.inspect._plan_local`).
    """
    slots.passes += 1
    fqns = list(slots.originals)
    weights = [slots.originals[f].weight for f in fqns]
    result = PassResult([], [torch.zeros_like(w, dtype=torch.float32) for w in weights], [])
    for index, batch in enumerate(batches):
        seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        handles = [slots.model.get_submodule(f).register_forward_hook(_recorder(f, seen)) for f in fqns]
        torch.manual_seed(seed + index)
        try:
            with torch.enable_grad():
                loss = loss_fn(slots.model, batch)
        finally:
            for handle in handles:
                handle.remove()
        check_scalar(loss)
        if not torch.isfinite(loss.detach()).all():
            result.losses.append(float("inf"))
            continue
        _backward(result, loss, weights, seen, (capture and index == 0, keep), slots)
    return result


def _recorder(fqn: str, seen: dict) -> Callable[..., None]:
    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        seen.setdefault(fqn, (args[0], output))  # a layer called twice is measured at its first call

    return hook


def _backward(result: PassResult, loss: torch.Tensor, weights: list, seen: dict, modes: tuple, slots) -> None:
    capture, keep = modes
    grad_in = [f for f, (x, _) in seen.items() if x.requires_grad]
    grad_out = [f for f, (_, y) in seen.items() if y.requires_grad] if capture or keep else []
    targets = [*weights, *(seen[f][0] for f in grad_in), *(seen[f][1] for f in grad_out)]
    grads = torch.autograd.grad(loss, targets, allow_unused=True)
    result.losses.append(float(loss.detach()))
    for total, g in zip(result.weight_grads, grads[: len(weights)], strict=True):
        if g is not None:
            total += g.float()
    inputs = grads[len(weights) : len(weights) + len(grad_in)]
    result.input_grads.append({f: g.float() for f, g in zip(grad_in, inputs, strict=True) if g is not None})
    outs = dict(zip(grad_out, grads[len(weights) + len(grad_in) :], strict=True))
    if keep:
        kept = {
            f: (seen[f][0].detach(), seen[f][1].detach(), g, seen[f][0].requires_grad)
            for f, g in outs.items()
        }
        result.kept.append({f: v for f, v in kept.items() if v[2] is not None})
    if capture:
        for fqn, (x, _) in seen.items():
            entry = {"x": _flat(x), "w": slots.originals[fqn].weight.detach().float()}
            if outs.get(fqn) is not None:
                entry["go"] = _flat(outs[fqn])
            result.captured[fqn] = entry


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1, t.shape[-1]).float()


def check_scalar(loss: Any) -> None:
    """Refuse a loss that is not a one-element tensor requiring grad."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        got = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(f"loss_fn must return a one-element tensor, got {got}")
    if not loss.requires_grad:
        raise ValueError("loss_fn returned a tensor that does not require grad; nothing to backpropagate")


def divergences(ref: PassResult, run: PassResult, fqn: str | None) -> dict[str, float | None]:
    """Relative loss change, weight-gradient change (all linears) and ``fqn``'s input-gradient change."""
    if any(loss == float("inf") for loss in run.losses):
        return {"loss": float("inf"), "weight_grad": float("inf"), "input_grad": float("inf")}
    tiny = torch.finfo(torch.float32).tiny
    delta = sum(abs(a - b) for a, b in zip(run.losses, ref.losses, strict=True))
    loss = delta / max(sum(abs(b) for b in ref.losses), tiny)
    num = sum(float((a - b).square().sum()) for a, b in zip(run.weight_grads, ref.weight_grads, strict=True))
    den = sum(float(b.square().sum()) for b in ref.weight_grads)
    out: dict[str, float | None] = {"loss": loss, "weight_grad": (num / max(den, tiny)) ** 0.5}
    out["input_grad"] = None
    batches = zip(run.input_grads, ref.input_grads, strict=False)
    pairs = [(a[fqn], b[fqn]) for a, b in batches if fqn in a and fqn in b]
    if pairs:
        num = sum(float((a - b).square().sum()) for a, b in pairs)
        den = sum(float(b.square().sum()) for _, b in pairs)
        out["input_grad"] = (num / max(den, tiny)) ** 0.5
    return out


#: The divergences of a layer left in the model's precision: the reference itself.
EXACT = {"loss": 0.0, "weight_grad": 0.0, "input_grad": 0.0}
EXACT.update(error=0.0, flushed=0.0, saturated=0.0, outlier_blocks=0.0, fprop_flushed=0.0)
_STATS = ("error", "flushed", "saturated", "outlier_blocks")


class Measurer:
    """Each layer's divergences per format (``layers[fqn]["divergence"][fmt]``), measured on demand and
    each (layer, format) at most once: one forward/backward over the batches with that layer alone in
    that format. Quantization statistics come from the reference pass's captured operands, so a format
    over ``max_flushed`` needs no pass to be ruled out (unless ``exhaustive``)."""

    def __init__(
        self, slots, ref, batches, loss_fn, seed, generator, cost_fn, formats, limits, rows=None
    ) -> None:
        self.slots, self.ref, self.batches, self.loss_fn = slots, ref, batches, loss_fn
        self.seed, self.generator, self.formats = seed, generator, formats
        self.max_flushed, self.exhaustive = limits
        self.layers: dict[str, dict[str, Any]] = {}
        for fqn in slots.originals:
            captured = ref.captured.get(fqn)
            if captured is None:
                continue  # never called on these batches: nothing to measure, left as it is
            m, k = captured["x"].shape
            n = captured["w"].shape[0]
            priced = m if rows is None else rows  # errors are measured at m, the cost is the run's
            costs = {fmt: float(cost_fn(fmt, priced, n, k)) for fmt in (*formats, "bf16", "fp32")}
            self.layers[fqn] = {
                "shape": [m, n, k],
                "priced_rows": priced,
                "flops": 6 * priced * n * k,
                "cost": costs,
                "divergence": {},
            }

    def measure(self, fqn: str, fmt: str) -> dict[str, Any]:
        done = self.layers[fqn]["divergence"]
        if fmt not in done:
            done[fmt] = self._one(fqn, fmt)
        return done[fmt]

    def cheapest(self, grad_limit: float) -> None:
        """Per layer, the formats in order of cost until the cheapest admissible one (and its equals)."""
        for fqn, info in self.layers.items():
            found = None
            for fmt in sorted(self.formats, key=lambda f: info["cost"][f]):
                if found is not None and info["cost"][fmt] > found:
                    break
                d = self.measure(fqn, fmt)
                flushed = d["fprop_flushed"] > self.max_flushed
                if d["loss"] is not None and not flushed and d["weight_grad"] <= grad_limit:
                    found = info["cost"][fmt]

    def complete(self) -> bool:
        """Measure every (layer, format) not measured yet; True if there was any."""
        todo = [
            (f, fmt)
            for f, info in self.layers.items()
            for fmt in self.formats
            if fmt not in info["divergence"]
        ]
        for fqn, fmt in todo:
            self.measure(fqn, fmt)
        return bool(todo)

    def switch_to_exact(self) -> bool:
        """Re-measure every estimated (layer, format) exactly from now on; False: already exact."""
        return False

    def _one(self, fqn: str, fmt: str) -> dict[str, Any]:
        if fmt == "fp32":
            return dict(EXACT)
        stats = dict.fromkeys(_STATS, 0.0)
        forward = 0.0
        if fmt not in HIGH_PRECISION:
            per_operand = _layer(self.ref.captured[fqn], get_recipe(fmt), 8.0)
            stats = {key: max((getattr(s, key) for s in per_operand.values()), default=0.0) for key in stats}
            forward = max((s.flushed for op, s in per_operand.items() if op.startswith("fprop")), default=0.0)
        stats["fprop_flushed"] = forward
        if forward > self.max_flushed and not self.exhaustive:  # ruled out: no pass needed
            return {"loss": None, "weight_grad": None, "input_grad": None, **stats}
        return {**self._divergences(fqn, fmt), **stats}

    def _divergences(self, fqn: str, fmt: str) -> dict[str, Any]:
        """One forward/backward over the batches with ``fqn`` alone in ``fmt``."""
        self.slots.set({fqn: fmt}, self.generator)
        try:
            run = run_pass(self.slots, self.batches, self.loss_fn, self.seed)
        finally:
            self.slots.set({fqn: "fp32"}, self.generator)
        return divergences(self.ref, run, fqn)
