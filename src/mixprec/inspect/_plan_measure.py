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

from mixprec.lowbit import LowbitLinear

#: The formats that are not a :mod:`mixprec.lowbit` recipe: a layer left in a float dtype.
HIGH_PRECISION = {"fp32": torch.float32, "bf16": torch.bfloat16}


class CastLinear(nn.Linear):
    """An ``nn.Linear`` whose GEMM runs in ``dtype`` (the planner's stand-in for a bf16 layer)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(self.dtype)
        return F.linear(input.to(self.dtype), self.weight.to(self.dtype), bias).to(input.dtype)


def swapped_in(linear: nn.Linear, fmt: str, generator: torch.Generator | None) -> nn.Linear:
    """A module computing ``linear`` in ``fmt``, sharing its parameters."""
    if fmt not in HIGH_PRECISION:
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


def run_pass(
    slots: Slots,
    batches: Sequence[Any],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    seed: int,
    capture: bool = False,
) -> PassResult:
    """Forward and backward of ``loss_fn(model, batch)`` for each batch with the layers as they are now.

    With ``capture``, the first batch's layer inputs, weights and output gradients are kept (float32,
    flattened to 2-D) for the quantization statistics.
    """
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
        _backward(result, loss, weights, seen, capture and index == 0, slots)
    return result


def _recorder(fqn: str, seen: dict) -> Callable[..., None]:
    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        seen.setdefault(fqn, (args[0], output))  # a layer called twice is measured at its first call

    return hook


def _backward(
    result: PassResult, loss: torch.Tensor, weights: list, seen: dict, capture: bool, slots
) -> None:
    grad_in = [f for f, (x, _) in seen.items() if x.requires_grad]
    grad_out = [f for f, (_, y) in seen.items() if y.requires_grad] if capture else []
    targets = [*weights, *(seen[f][0] for f in grad_in), *(seen[f][1] for f in grad_out)]
    grads = torch.autograd.grad(loss, targets, allow_unused=True)
    result.losses.append(float(loss.detach()))
    for total, g in zip(result.weight_grads, grads[: len(weights)], strict=True):
        if g is not None:
            total += g.float()
    inputs = grads[len(weights) : len(weights) + len(grad_in)]
    result.input_grads.append({f: g.float() for f, g in zip(grad_in, inputs, strict=True) if g is not None})
    if capture:
        outs = dict(zip(grad_out, grads[len(weights) + len(grad_in) :], strict=True))
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
