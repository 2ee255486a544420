"""Checks on what users pass to GradScaler.step() and update()."""

from __future__ import annotations

from typing import Any

import torch

from mixprec.scaling.rules import check_scale
from mixprec.scaling.state import GradScalerError

__all__ = ["check_new_scale", "check_optimizer", "refuse_closure"]


def refuse_closure(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raise GradScalerError for a closure, by keyword (as torch) or positional (torch lets it through)."""
    if "closure" in kwargs:
        raise GradScalerError("Closure use is not currently supported if GradScaler is enabled.")
    if args and callable(args[0]):
        raise GradScalerError(
            f"step() got a callable as its first positional argument ({args[0]!r:.60}), which "
            "optimizer.step() would take as a closure. Closures are not supported while GradScaler is "
            "enabled: the closure's backward() would leave scaled gradients that are never unscaled (torch "
            "passes it through silently). Call scaler.scale(loss).backward() yourself, then "
            "scaler.step(optimizer)."
        )


def check_new_scale(new_scale: Any) -> float | torch.Tensor:
    """``new_scale`` if it is a number or a 1-element tensor without grad, else ValueError."""
    if isinstance(new_scale, torch.Tensor):
        if new_scale.numel() != 1 or new_scale.requires_grad:
            raise ValueError(
                "new_scale should be a float or a 1-element tensor with requires_grad=False, got a tensor of "
                f"shape {tuple(new_scale.shape)} with requires_grad={new_scale.requires_grad}"
            )
        return new_scale
    if isinstance(new_scale, bool) or not isinstance(new_scale, (int, float)):
        kind = type(new_scale).__name__
        raise ValueError(f"new_scale should be a float, int or 1-element tensor, got {kind}: {new_scale!r}")
    return check_scale("new_scale", new_scale)


def check_optimizer(optimizer: Any) -> None:
    """TypeError naming ``optimizer`` unless it has ``param_groups``, a list of dicts with "params"."""
    groups = getattr(optimizer, "param_groups", None)
    if not isinstance(groups, list) or not all(isinstance(g, dict) and "params" in g for g in groups):
        raise TypeError(
            "optimizer must be a torch.optim.Optimizer (an object whose param_groups is a list of dicts with "
            f"'params'), got {type(optimizer).__name__}: {optimizer!r:.80}"
        )
