"""RankSync: one all-reduce (MAX) of found_inf, so that every rank skips or steps together.

torch's GradScaler decides per rank. Under plain data parallelism (DDP) that is harmless: gradients are
averaged before the check, so an inf anywhere reaches every rank. With sharded parameters (FSDP, ZeRO) each
rank checks only its own shard: the rank whose shard overflowed skips while the others step, the replicas
silently diverge, and their loss scales drift apart. The scaler therefore agrees on found_inf first.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["SYNC_MODES", "RankSync", "check_sync"]

SYNC_MODES: tuple[str | bool, ...] = ("auto", True, False)
_SPELLINGS = {"true": True, "false": False, "on": True, "off": False, "none": False}


def check_sync(sync: Any) -> str | bool:
    """``sync`` if it is ``"auto"``, True or False; otherwise a ValueError naming the accepted values."""
    if isinstance(sync, bool) or sync == "auto":
        return sync
    meant = _SPELLINGS.get(sync.lower()) if isinstance(sync, str) else None
    hint = f" (did you mean {meant!r}?)" if meant is not None else ""
    raise ValueError(f"sync must be one of 'auto', True, False; got {sync!r}{hint}")


class RankSync:
    """All-reduces a scaler's per-optimizer found_inf (MAX) across the ranks of a process group.

    Once per optimizer step, on the device::

        if sync is False or the group has a single rank:  return found_inf, amax        # no collective
        values = [found_inf, amax]                  # amax only for rules that read it (HeadroomScale)
        all_reduce(values, MAX, group, async_op=True).wait()      # ONE collective, any number of devices
        return values

    found_inf is 0.0 or 1.0 and a nan amax is sent as +inf, so MAX is well defined. The ``wait()`` blocks the
    host on gloo; on NCCL it only orders the CUDA streams, so the scaler still adds no host sync of its own.

    Args:
        sync: ``"auto"`` (default): agree when torch.distributed is initialised and the group has more than
            one rank. True: the same, but raise if torch.distributed is not initialised when the scaler first
            needs it. False: never (torch's per-rank decisions).
        process_group: the ranks that must agree; None means the default group (every rank). With FSDP2 on
            a device mesh, the default group covers every shard and replica.

    Raises:
        ValueError: for a ``sync`` other than "auto", True, False, or a ``process_group`` with ``sync=False``.
        TypeError: for a ``process_group`` that is not a ``torch.distributed.ProcessGroup``.
    """

    def __init__(self, sync: str | bool = "auto", process_group: dist.ProcessGroup | None = None) -> None:
        self.sync = check_sync(sync)
        if process_group is not None:
            if not dist.is_available():
                raise RuntimeError("process_group was given, but this torch build has no torch.distributed")
            if self.sync is False:
                raise ValueError("process_group was given with sync=False; drop one of them")
            if not isinstance(process_group, dist.ProcessGroup):
                raise TypeError(
                    f"process_group must be a torch.distributed.ProcessGroup or None, got "
                    f"{type(process_group).__name__}: {process_group!r}"
                )
        self.process_group = process_group

    def is_active(self) -> bool:
        """Whether found_inf is all-reduced now (asked at every step: the group may be set up later).

        Raises:
            RuntimeError: with ``sync=True`` when torch.distributed is not initialised.
        """
        if self.sync is False:
            return False
        if not (dist.is_available() and dist.is_initialized()):
            if self.sync is True:
                raise RuntimeError(
                    "GradScaler(sync=True) needs torch.distributed to be initialised "
                    "(torch.distributed.init_process_group) before the first step; use sync='auto' to "
                    "run on one process as well"
                )
            return False
        return dist.get_world_size(self.process_group) > 1

    def max_across_ranks(
        self, found_inf: torch.Tensor, amax: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The MAX over the ranks of ``found_inf`` (and ``amax``): 0-dim float32 tensors, one collective."""
        if not self.is_active():
            return found_inf, amax
        if amax is None:
            parts = [found_inf]
        else:
            parts = [found_inf, amax.to(found_inf.device).nan_to_num(nan=math.inf, posinf=math.inf)]
        values = torch.stack(parts)
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.process_group, async_op=True).wait()
        return values[0], None if amax is None else values[1]

    def __deepcopy__(self, memo: dict[int, Any]) -> RankSync:
        # A process group is a handle to this process's communicator: a copy shares it.
        return RankSync(self.sync, self.process_group)

    def __getstate__(self) -> dict[str, Any]:
        if self.process_group is not None:
            raise TypeError(
                "a GradScaler built with an explicit process_group cannot be pickled (process groups belong "
                "to one process); save scaler.state_dict() instead, or deepcopy it"
            )
        return self.__dict__.copy()

    def __repr__(self) -> str:
        group = "default" if self.process_group is None else "custom"
        return f"RankSync(sync={self.sync!r}, process_group={group})"
