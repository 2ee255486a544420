"""Gradient checks on a model or optimizer: which parameters hold inf/nan, and the largest magnitude.

Both read ``.grad`` only, so they work with any scaler (mixprec's or ``torch.amp.GradScaler``) and
cost nothing unless called. Each does one host sync per device.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

__all__ = ["grad_amax", "named_grads", "nonfinite_params"]

Source = nn.Module | torch.optim.Optimizer | Iterable[Any]


def named_grads(source: Source, *, model: nn.Module | None = None) -> list[tuple[str, torch.Tensor]]:
    """``(name, grad)`` for every parameter of ``source`` that has a gradient.

    Args:
        source: a model, an optimizer, or an iterable of parameters or ``(name, parameter)`` pairs.
        model: names an optimizer's parameters as ``model.named_parameters()`` does; without it they are
            ``"param_groups[i][j]"``.

    Raises:
        TypeError: for a source of another kind, or a ``model`` that is not an ``nn.Module``.
    """
    return [(name, _dense(p.grad)) for name, p in _named_params(source, model) if p.grad is not None]


def _named_params(source: Source, model: nn.Module | None) -> list[tuple[str, torch.Tensor]]:
    if isinstance(source, nn.Module):
        return list(source.named_parameters())
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module or None, got {type(model).__name__}: {model!r:.60}")
    if isinstance(source, torch.optim.Optimizer):
        names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
        return [
            (names.get(id(p), f"param_groups[{i}][{j}]"), p)
            for i, group in enumerate(source.param_groups)
            for j, p in enumerate(group["params"])
        ]
    if isinstance(source, Iterable) and not isinstance(source, (str, bytes, torch.Tensor)):
        items = list(source)
        pairs = [item if isinstance(item, tuple) else (f"params[{i}]", item) for i, item in enumerate(items)]
        if all(len(pair) == 2 and isinstance(pair[1], torch.Tensor) for pair in pairs):
            return pairs
    raise TypeError(
        "source must be an nn.Module, an optimizer or an iterable of parameters or (name, parameter) pairs, "
        f"got {type(source).__name__}: {source!r:.60}"
    )


def _dense(grad: torch.Tensor) -> torch.Tensor:
    return grad.coalesce().values() if grad.is_sparse else grad


def _per_device(values: list[torch.Tensor]) -> list[float]:
    """``[float(v) for v in values]`` with one host sync per device instead of one per tensor."""
    result: list[float] = [0.0] * len(values)
    by_device: dict[torch.device, list[int]] = {}
    for index, value in enumerate(values):
        by_device.setdefault(value.device, []).append(index)
    for indices in by_device.values():
        for index, number in zip(indices, torch.stack([values[i] for i in indices]).tolist(), strict=True):
            result[index] = float(number)
    return result


def nonfinite_params(source: Source, *, model: nn.Module | None = None) -> list[str]:
    """Names of the parameters whose gradient holds inf or nan (call it after a skipped step).

    Args:
        source: a model, an optimizer, or an iterable of parameters or ``(name, parameter)`` pairs.
        model: names an optimizer's parameters (see ``named_grads``).

    Returns:
        The names, in parameter order; empty when every gradient is finite or there are none.
    """
    grads = named_grads(source, model=model)
    if not grads:
        return []
    flags = _per_device(
        [(~torch.isfinite(g)).any().float() if g.numel() else g.new_zeros(()) for _, g in grads]
    )
    return [name for (name, _), bad in zip(grads, flags, strict=True) if bad]


def grad_amax(source: Source, *, model: nn.Module | None = None) -> float | None:
    """The largest ``|grad|`` over all parameters (inf/nan when a gradient is not finite; None: no grads)."""
    grads = [g for _, g in named_grads(source, model=model) if g.numel()]
    if not grads:
        return None
    maxima = _per_device([torch.linalg.vector_norm(g.float(), float("inf")) for g in grads])
    return math.nan if any(math.isnan(m) for m in maxima) else max(maxima)
