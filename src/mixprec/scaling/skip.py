"""After a non-finite gradient: every rank skips together (RankSync), and skips are counted (SkipMonitor).

:func:`agree_max` is mixprec's one rank agreement, the MAX over the ranks of a group in one all-reduce: the
scaler's found_inf and amax (RankSync) and the fp8 gradient hooks' amax (mixprec.distributed) go through it.

torch's GradScaler decides per rank. Under plain data parallelism (DDP) that is harmless: gradients are
averaged before the check, so an inf anywhere reaches every rank. With sharded parameters (FSDP, ZeRO) each
rank checks only its own shard: the rank whose shard overflowed skips while the others step, the replicas
silently diverge, and their loss scales drift apart. The scaler therefore agrees on found_inf first.

A skipped step is harmless once; a long unbroken run of them means something is non-finite at any scale, and
the monitor says so.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from mixprec.scaling.rules import check_count, optional

__all__ = ["RankSync", "SkipMonitor", "agree_max", "check_sync"]

_SPELLINGS = {"true": True, "false": False, "on": True, "off": False, "none": False}


def agree_max(values: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The MAX over the ranks of ``group`` of a float tensor, in one all-reduce (nan is sent as +inf).

    Every rank of ``group`` must call it with a tensor of the same shape and dtype. Without torch.distributed
    initialised, or with one rank, it returns ``values`` (nan kept) and communicates nothing. The ``wait()``
    blocks the host on gloo; on NCCL it only orders the CUDA streams, so the caller adds no host sync.

    Args:
        values: a floating-point tensor (any shape; a flag is 0.0/1.0, an amax >= 0).
        group: the ranks that agree; None means the default group.

    Returns:
        A new tensor of the agreed values (``values`` itself when nothing is communicated).

    Raises:
        TypeError: for a ``values`` that is not a floating-point tensor.
    """
    if not isinstance(values, torch.Tensor) or not values.is_floating_point():
        got = getattr(values, "dtype", values)
        raise TypeError(f"agree_max takes a floating-point tensor, got {got!r:.60}")
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return values
    agreed = values.nan_to_num(nan=math.inf, posinf=math.inf)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group, async_op=True).wait()
    return agreed


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

    found_inf is 0.0 or 1.0 and a nan amax is sent as +inf, so MAX is well defined (:func:`agree_max`, which
    adds no host sync on NCCL).

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
        parts = [found_inf] if amax is None else [found_inf, amax.to(found_inf.device)]
        values = agree_max(torch.stack(parts), self.process_group)
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


class SkipMonitor:
    """Counts skipped steps without syncing, and warns once after a long run of them.

    A step is skipped when any of its gradients is non-finite. Lowering the scale fixes overflow within a
    few dozen steps, so a long unbroken run means something is non-finite at any scale. Per ``update()``,
    on the device::

        if found_inf:  skipped_steps += 1;  skip_run += 1
        else:          skip_run = 0

    folded in batches: ``record`` keeps each iteration's found_inf tensor and every ``FOLD_EVERY``-th call
    applies the batch with a dozen tensor ops, instead of four per iteration, which on a fused optimizer's
    step would cost more than the scale update itself; reading the counters counts the batch so far
    without changing anything. Whenever the scaler has synced anyway (a skipped non-fused step, or
    reading the counters)::

        if skip_run >= warn_after and not warned:  warn once

    The run is read only where it may have reached ``warn_after``: the host keeps an upper bound of it
    (set where it was read or loaded, 0 after an iteration the host knows was clean, else one more per
    iteration), and while the bound is below ``warn_after`` a skipped step reads nothing more (so it costs
    the scaler's one sync, as torch's); past it, the scaler reads the run in that same sync
    (:meth:`may_warn`, :meth:`run_tensor`).

    Args:
        warn_after: consecutive skipped steps before the warning; None never warns.
    """

    FOLD_EVERY = 32

    def __init__(self, warn_after: int | None = 50) -> None:
        self.warn_after = None if warn_after is None else check_count("warn_after_skips", warn_after)
        self._skipped: torch.Tensor | None = None
        self._run: torch.Tensor | None = None
        self._pending: list[torch.Tensor] = []  # found_inf of iterations not yet counted
        self._init = {"skipped_steps": 0, "_skip_run": 0}
        self._bound = 0  # upper bound of skip_run known on the host (see the class doc)
        self._warned = False

    def ensure_state(self, device: torch.device) -> None:
        """Create the counters on ``device`` (the scale's) if they do not exist yet."""
        if self._skipped is None:
            self._skipped = torch.full((), self._init["skipped_steps"], dtype=torch.int64, device=device)
            self._run = torch.full((), self._init["_skip_run"], dtype=torch.int64, device=device)

    def record_no_step(self) -> None:
        """Count an iteration that stepped nothing (only ``update(new_scale)``): it skipped nothing."""
        self._fold()
        self._bound = 0
        if self._run is not None:
            self._run.zero_()
        else:
            self._init = {**self._init, "_skip_run": 0}

    def record(self, found_inf: torch.Tensor, clean: bool = False) -> None:
        """Count one iteration (no sync); ``found_inf`` > 0 means at least one step was skipped, and
        ``clean`` says the host knows it is 0 (every step of the iteration was decided on the host).

        ``found_inf`` is kept, not copied, until the batch is folded: it must not change afterwards (the
        scaler hands over a tensor nothing else writes).
        """
        self.ensure_state(found_inf.device)
        self._bound = 0 if clean else self._bound + 1
        self._pending.append(found_inf)
        if len(self._pending) >= self.FOLD_EVERY:
            self._fold()

    def _fold(self) -> None:
        """Apply the pending iterations to the counters (no sync)."""
        if self._pending:
            assert self._skipped is not None and self._run is not None
            skipped, run = self._counted()
            self._pending = []
            self._skipped.copy_(skipped)
            self._run.copy_(run)

    def _counted(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(skipped_steps, skip_run)`` with the pending iterations counted, oldest first; no change."""
        assert self._skipped is not None and self._run is not None
        if not self._pending:
            return self._skipped, self._run
        device = self._skipped.device
        flags = (torch.stack([found.to(device) for found in self._pending]) > 0).long()
        count = len(self._pending)
        trailing = flags.flip(0).cumprod(0).sum()  # skips at the end of the batch
        return self._skipped + flags.sum(), torch.where(trailing == count, self._run + count, trailing)

    def counts(self) -> tuple[int, int]:
        """``(skipped_steps, skip_run)``, read in one host sync."""
        if self._skipped is None:
            return self._init["skipped_steps"], self._init["_skip_run"]
        skipped, run = (int(v) for v in torch.stack(self._counted()).tolist())
        self._bound = run
        return skipped, run

    @property
    def skipped_steps(self) -> int:
        """Iterations in which at least one optimizer step was skipped (a host sync)."""
        return self.counts()[0]

    @property
    def skip_run(self) -> int:
        """Skipped iterations in a row up to the last update (a host sync)."""
        if self._run is None:
            return self._init["_skip_run"]
        self._bound = int(self._counted()[1].item())
        return self._bound

    def may_warn(self, pending: int) -> bool:
        """Whether ``skip_run + pending`` may have reached ``warn_after`` (by the host's bound; no sync)."""
        return not self._warned and self.warn_after is not None and self._bound + pending >= self.warn_after

    def run_tensor(self) -> torch.Tensor:
        """``skip_run`` as a 0-dim int64 tensor on the counters' device (no sync), for the caller's read."""
        assert self._run is not None, "run_tensor() before the counters exist"
        return self._counted()[1]

    def check(self, pending: int, scale: float | Callable[[], float], run: int | None = None) -> None:
        """Warn once if ``skip_run + pending`` reached ``warn_after``; call only where a sync just happened.

        Args:
            pending: skipped steps of the current iteration not yet recorded by ``update()`` (0 or 1).
            scale: the current loss scale, for the message, or a function reading it (called only to warn).
            run: ``skip_run`` as the caller read it in its sync; None reads it here, and only where
                :meth:`may_warn` (a host sync then).
        """
        if not self.may_warn(pending):
            return
        if run is None:
            run = self.skip_run
        else:
            self._bound = run
        run += pending
        if self.warn_after is None or run < self.warn_after:  # may_warn ruled out None; mypy cannot see it
            return
        self._warned = True
        scale = scale() if callable(scale) else scale
        warnings.warn(
            f"mixprec.GradScaler: the last {run} optimizer steps were all skipped because gradients "
            f"contained inf/nan, and lowering the loss scale (now {scale:g}) has not stopped it. This means "
            "something is non-finite at any scale: the loss itself or an op in the forward/backward produces "
            "inf/nan (log(0), division by zero, an overflow in the forward pass, bad input data). The model "
            "is not training. Check torch.isfinite(loss), or use mixprec.inspect to find the first "
            "non-finite op. (Shown once.)",
            RuntimeWarning,
            stacklevel=4,
        )

    def state_dict(self) -> dict[str, Any]:
        """``skipped_steps`` and ``_skip_run`` as ints (one host sync)."""
        skipped, run = self.counts()
        return {"skipped_steps": skipped, "_skip_run": run}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the counters; a dict without them (torch's) resets them to 0.

        Raises:
            ValueError: for a counter that is not an int >= 0, naming it (nothing is changed then).
        """
        self._apply_state(self.read_state(state_dict))

    def read_state(self, state_dict: dict[str, Any]) -> dict[str, int]:
        """The checked counters :meth:`load_state_dict` would restore; changes nothing."""
        return {key: optional(state_dict, key, 0, check_count, 0) for key in ("skipped_steps", "_skip_run")}

    def _apply_state(self, values: dict[str, int]) -> None:
        self._init = dict(values)
        self._bound = values["_skip_run"]
        self._pending = []
        if self._skipped is not None and self._run is not None:
            self._skipped.fill_(self._init["skipped_steps"])
            self._run.fill_(self._init["_skip_run"])
