"""torch.optim's fused-optimizer protocol: hand the scale and found_inf to an optimizer that unscales and
skips inside its own kernel.

Optimizers that do (``Adam(fused=True)`` and the like) set ``_step_supports_amp_scaling = True`` and read two
attributes during ``step()``: ``grad_scale`` (divide the gradients by it; None if they are already unscaled)
and ``found_inf`` (skip the update where it is non-zero). These two public names are the only ones mixprec
writes on an optimizer, and only for the duration of the call: whatever was there before is restored.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["run_fused_step", "supports_fused_scaling"]

_PROTOCOL = ("grad_scale", "found_inf")
_MISSING = object()


def supports_fused_scaling(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` handles ``grad_scale``/``found_inf`` itself.

    Raises:
        TypeError: for an optimizer on torch's older protocol (a ``grad_scaler`` argument to ``step``), which
            calls private methods of torch's own GradScaler; it would otherwise step on scaled gradients.
    """
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        return False
    if _takes_grad_scaler(getattr(optimizer.step, "__func__", optimizer.step)):
        raise TypeError(
            f"{type(optimizer).__name__}.step() takes a grad_scaler argument: torch's deprecated protocol, "
            "which relies on torch.amp.GradScaler internals and is not supported by mixprec.GradScaler. "
            "Read optimizer.grad_scale and optimizer.found_inf in step() instead (what torch.optim does)."
        )
    return True


# Whether a step function takes ``grad_scaler`` (weakly keyed: a closure may hold its optimizer).
_TAKES_GRAD_SCALER: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def _takes_grad_scaler(step: Callable[..., Any]) -> bool:
    """Whether ``step`` has a ``grad_scaler`` parameter; cached, as ``inspect.signature`` is slow."""
    try:
        return _TAKES_GRAD_SCALER[step]
    except (KeyError, TypeError):
        takes = "grad_scaler" in inspect.signature(step).parameters
    try:
        _TAKES_GRAD_SCALER[step] = takes
    except TypeError:  # not weakly referenceable or not hashable: asked again next time
        pass
    return takes


def run_fused_step(
    optimizer: torch.optim.Optimizer,
    grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """Call ``optimizer.step(*args, **kwargs)`` with the protocol attributes set, then restore them."""
    saved = {name: optimizer.__dict__.get(name, _MISSING) for name in _PROTOCOL}
    optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
    optimizer.found_inf = found_inf  # type: ignore[attr-defined]
    try:
        return optimizer.step(*args, **kwargs)
    finally:
        for name, value in saved.items():
            if value is _MISSING:
                delattr(optimizer, name)
            else:
                setattr(optimizer, name, value)
