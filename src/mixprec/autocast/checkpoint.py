"""Activation checkpointing that recomputes in the dtypes the forward used.

``torch.utils.checkpoint`` replays ``torch.autocast``'s state during recomputation but knows nothing
of mixprec's regions: a block checkpointed inside ``mixprec.autocast`` would be recomputed in fp32
and torch raises "Recomputed values ... have different metadata". :func:`checkpoint` passes the
region in force at the call to the recomputation through torch's ``context_fn`` hook.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch.utils.checkpoint

from mixprec.autocast.region import autocast

__all__ = ["autocast_context_fn", "checkpoint"]


def checkpoint(
    function: Callable[..., Any],
    *args: Any,
    use_reentrant: bool = False,
    context_fn: Callable[[], tuple[Any, Any]] | None = None,
    **kwargs: Any,
) -> Any:
    """``torch.utils.checkpoint.checkpoint`` (non-reentrant) that replays the mixprec region on recompute.

    Args:
        function: the function or module to checkpoint.
        *args: its inputs.
        use_reentrant: must be False; the reentrant variant offers no hook to replay the region.
        context_fn: as torch's: returns (forward context, recompute context); both are kept.
        **kwargs: passed to ``torch.utils.checkpoint.checkpoint`` and on to ``function``.

    Raises:
        TypeError: for a ``function`` that is not callable.
        ValueError: for ``use_reentrant=True``.
    """
    if not callable(function):
        raise TypeError(f"function must be a callable (a function or module), got {type(function).__name__}")
    if use_reentrant:
        raise ValueError(
            "mixprec.checkpoint supports use_reentrant=False only (torch's recommended mode); "
            "the reentrant variant has no hook through which the autocast region can be replayed"
        )

    def contexts() -> tuple[Any, Any]:
        forward_ctx, recompute_ctx = context_fn() if context_fn is not None else autocast_context_fn()
        if context_fn is None:
            return forward_ctx, recompute_ctx
        _, region = autocast_context_fn()
        return forward_ctx, _both(recompute_ctx, region)

    return torch.utils.checkpoint.checkpoint(
        function, *args, use_reentrant=False, context_fn=contexts, **kwargs
    )


def autocast_context_fn() -> tuple[Any, Any]:
    """A ``context_fn`` for ``torch.utils.checkpoint`` (non-reentrant) that replays the mixprec region.

    torch's checkpoint calls it at forward time; the recompute then runs under the rules in force at
    that point (an edited policy, a pinned module and the qualified names of the region's root
    included), not only torch's autocast state. Use it where the checkpoint call is not yours, e.g.
    ``model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False,
    "context_fn": mixprec.autocast_context_fn})`` for a Hugging Face model.

    Returns:
        (forward context, recompute context): a no-op, and the region (a no-op outside a region).
    """
    region = autocast.current()
    return contextlib.nullcontext(), region if region is not None else contextlib.nullcontext()


@contextlib.contextmanager
def _both(first: Any, second: Any) -> Any:
    with first, second:
        yield
