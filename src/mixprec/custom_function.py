"""`custom_fwd` / `custom_bwd` for ``torch.autograd.Function`` under mixprec.autocast (as torch.amp's)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from mixprec._engine import _FLOAT64, _rebuild, _state
from mixprec.autocast import _innermost, autocast

__all__ = ["custom_bwd", "custom_fwd"]


def custom_fwd(
    fwd: Callable | None = None, *, device_type: str | None = None, cast_inputs: torch.dtype | None = None
) -> Callable:
    """Decorate ``forward`` of a ``torch.autograd.Function`` (as ``torch.amp.custom_fwd``).

    Inside an enabled mixprec region: with ``cast_inputs``, floating tensors on the device are cast to
    it and ``forward`` runs with autocast disabled; without, ``forward`` runs under the current region
    and ``custom_bwd`` replays that state in ``backward``. Outside a region it is a no-op.

    Args:
        device_type: the device family; default: that of the innermost active region.
        cast_inputs: dtype to cast incoming floating tensors to, or None.
    """
    if fwd is None:
        return functools.partial(custom_fwd, device_type=device_type, cast_inputs=cast_inputs)

    @functools.wraps(fwd)
    def decorate_fwd(ctx: Any, *args: Any, **kwargs: Any) -> Any:
        frame = (
            _state.frames[-1]
            if device_type is None and _state.frames
            else (_innermost(device_type) if device_type is not None else None)
        )
        active = frame is not None and frame.enabled
        ctx._mixprec_autocast = (frame.device_type, frame.rules) if active else None  # type: ignore[union-attr]
        if not active or cast_inputs is None:
            return fwd(ctx, *args, **kwargs)
        ctx._mixprec_autocast = None
        family = frame.device_type  # type: ignore[union-attr]
        with autocast(family, enabled=False):
            args = tuple(_cast_inputs(a, cast_inputs, family) for a in args)
            kwargs = {k: _cast_inputs(v, cast_inputs, family) for k, v in kwargs.items()}
            return fwd(ctx, *args, **kwargs)

    return decorate_fwd


def _cast_inputs(value: Any, dtype: torch.dtype, device_type: str) -> Any:
    if isinstance(value, torch.Tensor):
        eligible = value.is_floating_point() and value.device.type == device_type and value.dtype != _FLOAT64
        return value.to(dtype) if eligible else value
    if isinstance(value, (list, tuple)):
        return _rebuild(value, [_cast_inputs(v, dtype, device_type) for v in value])
    if isinstance(value, dict):
        return {k: _cast_inputs(v, dtype, device_type) for k, v in value.items()}
    return value


def custom_bwd(bwd: Callable | None = None, *, device_type: str | None = None) -> Callable:
    """Decorate ``backward`` of a ``torch.autograd.Function``: run it under the forward's autocast state."""
    if bwd is None:
        return functools.partial(custom_bwd, device_type=device_type)

    @functools.wraps(bwd)
    def decorate_bwd(ctx: Any, *args: Any, **kwargs: Any) -> Any:
        saved = getattr(ctx, "_mixprec_autocast", None)
        if saved is None:
            family = device_type or (_state.frames[-1].device_type if _state.frames else "cpu")
            with autocast(family, enabled=False):
                return bwd(ctx, *args, **kwargs)
        family, rules = saved
        with autocast(family, policy=rules.policy, dtype=rules.compute_dtype):
            return bwd(ctx, *args, **kwargs)

    return decorate_bwd
