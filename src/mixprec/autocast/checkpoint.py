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

__all__ = ["checkpoint"]


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
        ValueError: for ``use_reentrant=True``.
    """
    if use_reentrant:
        raise ValueError(
            "mixprec.checkpoint supports use_reentrant=False only (torch's recommended mode); "
            "the reentrant variant has no hook through which the autocast region can be replayed"
        )

    def contexts() -> tuple[Any, Any]:
        if context_fn is not None:
            forward_ctx, recompute_ctx = context_fn()
        else:
            forward_ctx, recompute_ctx = contextlib.nullcontext(), contextlib.nullcontext()
        region = autocast.current()  # called by torch at forward time: the region in force now
        if region is None:
            return forward_ctx, recompute_ctx
        return forward_ctx, _both(recompute_ctx, region)

    return torch.utils.checkpoint.checkpoint(
        function, *args, use_reentrant=False, context_fn=contexts, **kwargs
    )


@contextlib.contextmanager
def _both(first: Any, second: Any) -> Any:
    with first, second:
        yield
