"""Agreeing on the amax across data-parallel ranks: one all-reduce for every delayed history of a model.

Transformer Engine reduces the amaxes of all fp8 tensors of a step in one flat buffer (``MAX``) so every
rank computes the same scales next step. :func:`sync_float8_amax_history` does the same for mixprec: it
gathers the newest entry of every ``amax_history`` row of every delayed :class:`Float8Linear` of a model
into one float32 tensor, all-reduces it once with ``MAX`` and writes the results back.

Call it after ``backward()`` (the grad_output amaxes are pushed there) and before the next forward, every
step, on every rank. Histories start equal (zeros) and each step adds the same agreed entry, so all ranks
hold the same histories and compute the same scales (the first step, with an empty history, scales
each rank's tensors by its own amax). Dynamic scaling needs no agreement.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from mixprec.float8.convert import float8_linears

__all__ = ["sync_float8_amax_history"]


@torch.no_grad()
def sync_float8_amax_history(model: nn.Module, group: dist.ProcessGroup | None = None) -> int:
    """All-reduce (MAX) the newest amax of every delayed history in ``model``, in one collective.

    Args:
        model: a model converted with delayed scaling (DDP-wrapped or not).
        group: the process group (default: the world).

    Returns:
        The number of amax values reduced (3 per delayed Float8Linear); 0, and no collective, when the
        model has no delayed history or ``torch.distributed`` is not initialised.
    """
    histories = [m.amax_history for _, m in float8_linears(model) if m.amax_history is not None]
    if not histories or not (dist.is_available() and dist.is_initialized()):
        return 0
    newest = torch.cat([h[:, 0] for h in histories])
    dist.all_reduce(newest, op=dist.ReduceOp.MAX, group=group)
    for history, agreed in zip(histories, newest.split([h.shape[0] for h in histories]), strict=True):
        history[:, 0].copy_(agreed)
    return newest.numel()
