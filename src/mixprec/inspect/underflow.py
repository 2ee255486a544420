"""`underflow_report`: how much of the gradient a format loses at a loss scale, per module.

Measured on one float32 forward and backward. Gradients scale linearly with the loss, so the backward
runs on the unscaled loss and each value ``g`` is judged as ``g * scale`` would be in the format: zero
when ``|g * scale| < smallest_subnormal / 2``, subnormal below ``smallest_normal``; values that are
exactly zero in float32 are counted apart ("already zero"). Activation gradients are the gradients of
the outputs of the model's leaf modules (what flows between modules, where fp16 loses the most, as in
Micikevicius et al., "Mixed Precision Training", 2018: 67% of the activation gradients of their SSD
model were zero in fp16); parameter gradients are listed under the module owning the parameter.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from mixprec import formats
from mixprec.inspect._modules import LossFn, call_loss, check_model, model_loss
from mixprec.inspect._restore import Handles, preserved, tensors_in
from mixprec.inspect.summaries import GradStats, Log2Histogram
from mixprec.inspect.underflow_report import UnderflowReport

__all__ = ["UnderflowReport", "underflow_report"]


class _Collector:
    """Accumulates :class:`GradStats` per module and a :class:`Log2Histogram` per kind."""

    def __init__(self, fmt: formats.Format, scale: float) -> None:
        self.fmt = fmt
        self.scale = scale
        self.stats: dict[str, dict[str, GradStats]] = {"activation": {}, "parameter": {}}
        self.histograms = {"activation": Log2Histogram(), "parameter": Log2Histogram()}

    def add(self, kind: str, module: str, grad: torch.Tensor) -> None:
        per_module = self.stats[kind]
        per_module[module] = per_module.get(module, GradStats()) + GradStats.measure(
            grad, self.fmt, self.scale
        )
        self.histograms[kind].add(grad)

    def hook_outputs(self, name: str, handles: Handles) -> Callable[..., None]:
        def forward_hook(module: nn.Module, args: Any, output: Any) -> None:
            for tensor in tensors_in(output):
                if tensor.requires_grad and tensor.is_floating_point():
                    handles.add(tensor.register_hook(lambda grad: self.add("activation", name, grad)))

        return forward_hook


def underflow_report(
    model: nn.Module,
    inputs: Any,
    *,
    loss_fn: LossFn,
    dtype: torch.dtype | str = torch.float16,
    scale: float = 1.0,
    target: float = 1e-3,
    margin: float = 2.0,
) -> UnderflowReport:
    """Fraction of activation and parameter gradients that would underflow in ``dtype`` at loss ``scale``.

    Runs one float32 forward and backward (no autocast) and restores the model exactly afterwards
    (hooks removed, parameters, buffers, grads, modes and RNG state as before).

    Args:
        model: the model (float32 parameters for a meaningful measurement).
        inputs: a tensor, a tuple/list (positional) or a dict (keyword) of model inputs.
        loss_fn: ``loss_fn(model, batch) -> scalar tensor``, the unscaled loss, called once with ``inputs``
            as the batch.
        dtype: the format the gradients would be cast to (a torch dtype or a format name like "e5m2").
        scale: the loss scale to judge at.
        target: the underflow fraction the recommended scale must stay under.
        margin: headroom factor below the format's max the recommended scale must keep.

    Returns:
        An :class:`UnderflowReport`; ``print(report.table())`` for the per-module figures.

    Raises:
        TypeError: for a ``loss_fn`` that is not ``loss_fn(model, batch)`` (refused before the model runs,
            or when it raises: the message names what was passed), or a non-numeric scale, target or
            margin.
        ValueError: for a non-positive or non-finite scale, a target outside [0, 1), a margin below 1, or
            a loss that is not a one-element tensor requiring grad, or that is inf/nan (nothing is changed
            then).
    """
    check_model(model)
    loss_fn = model_loss(loss_fn, "underflow_report")
    for name, value in (("scale", scale), ("target", target), ("margin", margin)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a number, got {type(value).__name__}: {value!r}")
    fmt = formats.get(dtype)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a finite number > 0, got {scale!r}")
    if not 0 <= target < 1:
        raise ValueError(f"target must be a fraction in [0, 1), got {target!r}")
    if margin < 1:
        raise ValueError(f"margin must be >= 1, got {margin!r}")
    collector = _Collector(fmt, float(scale))
    with preserved(model, inputs) as handles:
        for name, module in model.named_modules():
            if next(module.children(), None) is None:
                handles.add(module.register_forward_hook(collector.hook_outputs(name, handles)))
        with torch.enable_grad():
            loss = call_loss(loss_fn, model, inputs, "underflow_report")
            if not torch.isfinite(loss.detach()).all():  # its gradients are inf/nan: no underflow to count
                raise ValueError(
                    f"loss_fn returned {float(loss.detach().float().sum())} in the model's own precision, so "
                    "there are no finite gradients to judge; mixprec.inspect.find_nonfinite(model, inputs, "
                    "loss_fn=...) finds where the inf/nan comes from"
                )
            loss.backward()
        handles.remove_all()
        seen: set[int] = set()
        for name, module in model.named_modules():
            for param in module.parameters(recurse=False):
                if param.grad is not None and id(param) not in seen:
                    seen.add(id(param))
                    collector.add("parameter", name, param.grad)
    order = {name: index for index, (name, _) in enumerate(model.named_modules())}
    return UnderflowReport(
        format=fmt,
        scale=float(scale),
        activations=_in_order(collector.stats["activation"], order),
        parameters=_in_order(collector.stats["parameter"], order),
        activation_histogram=collector.histograms["activation"],
        parameter_histogram=collector.histograms["parameter"],
        target=target,
        margin=margin,
    )


def _in_order(stats: dict[str, GradStats], order: dict[str, int]) -> dict[str, GradStats]:
    """The same mapping, in the order of ``model.named_modules()`` (hooks fire in backward order)."""
    return dict(sorted(stats.items(), key=lambda item: order.get(item[0], len(order))))
