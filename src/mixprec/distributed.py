"""mixprec under torch.distributed: helpers for DDP and FSDP training with mixprec's scaler.

Nothing here is needed to train: ``mixprec.GradScaler`` agrees on skipping by itself (see
:class:`mixprec.scaling.skip.RankSync`), and ``mixprec.autocast`` and ``MixedPrecisionOptimizer`` are
per-process and unaffected by the wrappers. What is here:

- :func:`compression_hook`: torch's DDP gradient-compression hooks by format name, and what they do to the
  scaler (docs/distributed.md explains the fp16 overflow in the all-reduce).
- :func:`replicas_identical`: whether every rank holds bit-identical tensors, the invariant DDP relies on and
  a per-rank skip decision silently breaks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["COMPRESSION_HOOKS", "compression_hook", "replicas_identical"]

#: Format name -> name of the DDP comm hook in torch.distributed.algorithms.ddp_comm_hooks.default_hooks.
COMPRESSION_HOOKS: dict[str, str] = {"fp16": "fp16_compress_hook", "bf16": "bf16_compress_hook"}


def compression_hook(format: str) -> Callable[..., Any]:
    """Torch's DDP comm hook that all-reduces gradient buckets in ``format`` ("fp16" or "bf16").

    Use: ``ddp_model.register_comm_hook(None, mixprec.distributed.compression_hook("bf16"))``. Each bucket is
    cast to ``format``, divided by the world size, summed across ranks and cast back. With "fp16" a scaled
    gradient above 65504 becomes inf in the cast: the scaler sees inf on every rank, skips and backs off until
    the scaled gradients fit, so the hook caps the loss scale at about ``65504 / max|grad|``. "bf16" has
    fp32's range (no overflow) and 8 significant bits.

    Raises:
        ValueError: for another format, naming the accepted ones.
        RuntimeError: when torch.distributed is not available.
    """
    if not isinstance(format, str) or format not in COMPRESSION_HOOKS:
        raise ValueError(f"compression format must be one of {sorted(COMPRESSION_HOOKS)}, got {format!r}")
    if not dist.is_available():
        raise RuntimeError("this torch build has no torch.distributed, so no DDP comm hooks")
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return getattr(default_hooks, COMPRESSION_HOOKS[format])


def _digest(tensors: Iterable[torch.Tensor]) -> str:
    """SHA-256 of the tensors' shapes, dtypes and bytes, in order."""
    digest = hashlib.sha256()
    for tensor in tensors:
        data = tensor.detach().cpu().contiguous()
        digest.update(f"{tuple(data.shape)}{data.dtype};".encode())
        digest.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _tensor_list(tensors: object) -> list[torch.Tensor]:
    """A module's parameters then buffers, or the given iterable of tensors as a list (else TypeError)."""
    if isinstance(tensors, torch.nn.Module):
        return [*tensors.parameters(), *tensors.buffers()]
    if isinstance(tensors, Iterable) and not isinstance(tensors, (str, bytes, torch.Tensor)):
        items = list(tensors)
        if all(isinstance(t, torch.Tensor) for t in items):
            return items
    raise TypeError(
        "tensors must be an nn.Module or an iterable of tensors, "
        f"got {type(tensors).__name__}: {tensors!r:.60}"
    )


def replicas_identical(
    tensors: torch.nn.Module | Iterable[torch.Tensor], group: dist.ProcessGroup | None = None
) -> bool:
    """Whether every rank of ``group`` holds bit-identical tensors (a module's parameters and buffers).

    A collective: every rank of the group must call it. It hashes on the host (a device sync, and a copy of
    each tensor to the CPU), so it is a check for tests and debugging, not for every step. With one process,
    or without torch.distributed initialised, it is True.

    Args:
        tensors: a module (its ``parameters()`` then ``buffers()``) or tensors in the same order on each rank.
        group: the ranks to compare; None means the default group.

    Raises:
        TypeError: when ``tensors`` is neither a module nor an iterable of tensors.
    """
    tensors = _tensor_list(tensors)
    digest = _digest(tensors)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return True
    digests: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(digests, digest, group=group)
    return len(set(digests)) == 1
