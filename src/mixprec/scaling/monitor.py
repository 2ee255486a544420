"""SkipMonitor: count skipped steps on the device, and say so when skipping never stops."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from mixprec.scaling.rules import check_count, optional

__all__ = ["SkipMonitor"]


class SkipMonitor:
    """Counts skipped steps without syncing, and warns once after a long run of them.

    A step is skipped when any of its gradients is non-finite. Lowering the scale fixes overflow within a
    few dozen steps, so a long unbroken run means something is non-finite at any scale. Per ``update()``,
    on the device::

        if found_inf:  skipped_steps += 1;  skip_run += 1
        else:          skip_run = 0

    and, whenever the scaler has synced anyway (a skipped non-fused step, or reading the counters)::

        if skip_run >= warn_after and not warned:  warn once

    Args:
        warn_after: consecutive skipped steps before the warning; None never warns.
    """

    def __init__(self, warn_after: int | None = 50) -> None:
        self.warn_after = None if warn_after is None else check_count("warn_after_skips", warn_after)
        self._skipped: torch.Tensor | None = None
        self._run: torch.Tensor | None = None
        self._init = {"skipped_steps": 0, "_skip_run": 0}
        self._warned = False

    def ensure_state(self, device: torch.device) -> None:
        """Create the counters on ``device`` (the scale's) if they do not exist yet."""
        if self._skipped is None:
            self._skipped = torch.full((), self._init["skipped_steps"], dtype=torch.int64, device=device)
            self._run = torch.full((), self._init["_skip_run"], dtype=torch.int64, device=device)

    def record_no_step(self) -> None:
        """Count an iteration that stepped nothing (only ``update(new_scale)``): it skipped nothing."""
        if self._run is not None:
            self._run.zero_()
        else:
            self._init = {**self._init, "_skip_run": 0}

    def record(self, found_inf: torch.Tensor) -> None:
        """Count one iteration (no sync); ``found_inf`` > 0 means at least one step was skipped."""
        self.ensure_state(found_inf.device)
        assert self._skipped is not None and self._run is not None
        skipped = found_inf > 0
        self._skipped.add_(skipped)
        self._run.mul_(skipped).add_(skipped)  # run + 1 after a skip, else 0

    @property
    def skipped_steps(self) -> int:
        """Iterations in which at least one optimizer step was skipped (a host sync)."""
        return self._init["skipped_steps"] if self._skipped is None else int(self._skipped.item())

    @property
    def skip_run(self) -> int:
        """Skipped iterations in a row up to the last update (a host sync)."""
        return self._init["_skip_run"] if self._run is None else int(self._run.item())

    def check(self, pending: int, scale: float) -> None:
        """Warn once if ``skip_run + pending`` reached ``warn_after``; call only where a sync just happened.

        Args:
            pending: skipped steps of the current iteration not yet recorded by ``update()`` (0 or 1).
            scale: the current loss scale, for the message.
        """
        if self._warned or self.warn_after is None:
            return
        run = self.skip_run + pending
        if run < self.warn_after:
            return
        self._warned = True
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
        """``skipped_steps`` and ``_skip_run`` as ints."""
        return {"skipped_steps": self.skipped_steps, "_skip_run": self.skip_run}

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
        if self._skipped is not None and self._run is not None:
            self._skipped.fill_(self._init["skipped_steps"])
            self._run.fill_(self._init["_skip_run"])
