"""`custom_fwd` / `custom_bwd`: torch.amp's decorators, plus the policy's deviations in backward.

A mixprec region is torch's autocast state, so torch.amp.custom_fwd/custom_bwd already do the right
thing inside it (and inside a pinned module). mixprec's versions add two things: ``device_type`` may be
omitted (the innermost region's device is used), and ``custom_bwd`` replays the policy's deviations
(ops moved between lists) that were in force when ``forward`` ran.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from mixprec.autocast.engine import _state, current_rules
from mixprec.autocast.region import autocast
from mixprec.policy.names import _family, as_dtype

__all__ = ["custom_bwd", "custom_fwd"]


class _PerFamily(dict):
    """torch.amp's decorated function per device type, made on first use ("cpu", "cuda", "mps", ...)."""

    def __init__(self, make: Callable[[str], Callable]) -> None:
        super().__init__()
        self.make = make

    def __missing__(self, family: str) -> Callable:
        self[family] = made = self.make(family)
        return made


def _default_family() -> str:
    return _state.frames[-1].device_type if _state.frames else "cpu"


def custom_fwd(
    fwd: Callable | None = None,
    *,
    device_type: str | None = None,
    cast_inputs: torch.dtype | str | None = None,
) -> Callable:
    """Decorate ``forward`` of a ``torch.autograd.Function`` (as ``torch.amp.custom_fwd``).

    In an enabled region: with ``cast_inputs``, floating tensors on the device are cast to it and
    ``forward`` runs with autocast (torch's and mixprec's) off; without, ``forward`` runs under the
    current region and :func:`custom_bwd` replays it in ``backward``. Outside a region: a no-op.

    Args:
        device_type: "cpu", "cuda" or any type torch.autocast takes; default: the device of the
            innermost mixprec region, else "cpu".
        cast_inputs: dtype (or dtype name such as "fp16", see :meth:`mixprec.Policy.parse`) to cast
            incoming floating tensors to, or None.

    Raises:
        ValueError, TypeError: for an unsupported ``device_type`` or a ``cast_inputs`` that is neither a
            dtype nor a known dtype name.
    """
    if device_type is not None:
        device_type = _family(device_type)
    if cast_inputs is not None:
        cast_inputs = as_dtype(cast_inputs, "cast_inputs")
    if fwd is None:
        return functools.partial(custom_fwd, device_type=device_type, cast_inputs=cast_inputs)
    inner = fwd
    if cast_inputs is not None:

        def inner(ctx: Any, *args: Any, **kwargs: Any) -> Any:  # torch turned its autocast off: so do we
            with autocast(ctx._mixprec_family, enabled=False):
                return fwd(ctx, *args, **kwargs)

    by_family = _PerFamily(lambda f: torch.amp.custom_fwd(inner, device_type=f, cast_inputs=cast_inputs))

    @functools.wraps(fwd)
    def decorate_fwd(ctx: Any, *args: Any, **kwargs: Any) -> Any:
        family = device_type or _default_family()
        ctx._mixprec_family = family
        ctx._mixprec_rules = current_rules() if cast_inputs is None else None
        return by_family[family](ctx, *args, **kwargs)

    return decorate_fwd


def custom_bwd(bwd: Callable | None = None, *, device_type: str | None = None) -> Callable:
    """Decorate ``backward`` of a ``torch.autograd.Function``: run it in the forward's autocast state.

    torch's state is replayed by ``torch.amp.custom_bwd``; the policy's deviations recorded by
    :func:`custom_fwd` are replayed on top.
    """
    if device_type is not None:
        device_type = _family(device_type)
    if bwd is None:
        return functools.partial(custom_bwd, device_type=device_type)

    def inner(ctx: Any, *args: Any, **kwargs: Any) -> Any:
        rules = getattr(ctx, "_mixprec_rules", None)
        if rules is None or not getattr(ctx, "_fwd_used_autocast", False) or not rules.deviations:
            return bwd(ctx, *args, **kwargs)
        with autocast(rules.device_type, dtype=rules.compute_dtype, policy=rules.policy):
            return bwd(ctx, *args, **kwargs)

    by_family = _PerFamily(lambda f: torch.amp.custom_bwd(inner, device_type=f))

    @functools.wraps(bwd)
    def decorate_bwd(ctx: Any, *args: Any, **kwargs: Any) -> Any:
        family = device_type or getattr(ctx, "_mixprec_family", None) or _default_family()
        if not hasattr(ctx, "_fwd_used_autocast"):  # forward was not decorated: no state to replay
            return bwd(ctx, *args, **kwargs)
        return by_family[family](ctx, *args, **kwargs)

    return decorate_bwd
