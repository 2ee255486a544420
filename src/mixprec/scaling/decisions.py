"""The parts of GradScaler that decide: skip or step, rank agreement, amax, the fused-optimizer hand-off."""

from __future__ import annotations

from typing import Any

import torch

from mixprec.scaling import kernels
from mixprec.scaling.fused import run_fused_step
from mixprec.scaling.monitor import SkipMonitor
from mixprec.scaling.rules import ScaleRule
from mixprec.scaling.state import OptimizerRecord, OptState
from mixprec.scaling.sync import RankSync

__all__ = ["Decisions"]


class Decisions:
    """Mixin of :class:`~mixprec.scaling.GradScaler`: every skip decision and what it needs to agree on."""

    rule: ScaleRule
    monitor: SkipMonitor
    rank_sync: RankSync
    _records: dict[int, OptimizerRecord]

    def _skip_decision(
        self,
        optimizer: torch.optim.Optimizer,
        record: OptimizerRecord,
        found_inf: torch.Tensor,
        scale: torch.Tensor,
    ) -> bool:
        """Read found_inf on the host (the step's one sync). With the same sync, a rule that reads amax but
        got none from torch's fused pass learns the scale: below 1 (only there can every gradient flush to
        zero), a clean step measures amax for the underflow check, agreed across ranks."""
        if not (self.rule.reads_amax and not record.amax):
            return bool(found_inf.item() != 0)
        found, current = torch.stack([found_inf, scale.to(found_inf.device)]).tolist()
        if found == 0 and current < 1:
            params = (param for group in optimizer.param_groups for param in group["params"])
            groups = kernels.collect_grads(params, allow_fp16=True)
            _, amax = kernels.check_and_unscale_(groups, torch.ones((), device=scale.device), False)
            _, agreed = self.rank_sync.max_across_ranks(
                found_inf, kernels.combine_max(amax.values(), scale.device)
            )
            record.amax = {scale.device: agreed}
        return found != 0

    def _fused_step(
        self,
        optimizer: torch.optim.Optimizer,
        record: OptimizerRecord,
        scale: torch.Tensor,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """Hand the scale and found_inf to an optimizer that unscales and skips in its own kernel."""
        if record.stage is OptState.READY:
            self._check_grads(optimizer, record, scale, unscale=False, allow_fp16=True)
            # As torch: compose with a grad_scale the user may have set on the optimizer.
            grad_scale = scale * getattr(optimizer, "grad_scale", 1)
        else:
            grad_scale = getattr(optimizer, "grad_scale", None)  # already unscaled by unscale_()
        found_inf = self._combine_found_inf(record, scale.device)
        retval = run_fused_step(optimizer, grad_scale, found_inf, args, kwargs)
        record.stage = OptState.STEPPED
        return retval

    def _on_skip(self) -> None:
        """A step was just skipped and the host knows it: the cheap moment for checks that need a sync."""
        self.monitor.check(pending=1, scale=self.rule.get_scale())
        self.rule.after_skip()

    def _combine_found_inf(self, record: OptimizerRecord, device: torch.device) -> torch.Tensor:
        """One optimizer's found_inf (1.0 if any device's is non-zero) on ``device``, the same on every rank.

        Every skip decision goes through here, and :meth:`update` only combines its results: this is where
        found_inf (with amax, when the rule reads it) is all-reduced across ranks, one collective per
        optimizer. The agreed values replace the record's, so ``update()`` needs no collective of its own.
        """
        found_inf = kernels.combine_max(record.found_inf.values(), device)
        measured = self.rule.reads_amax and record.amax
        amax = kernels.combine_max(record.amax.values(), device) if measured else None
        found_inf, amax = self.rank_sync.max_across_ranks(found_inf, amax)
        record.found_inf = {device: found_inf}
        if amax is not None:
            record.amax = {device: amax}
        return found_inf

    def _combine_amax(self, device: torch.device) -> torch.Tensor | None:
        """The largest amax over every optimizer, or None unless the rule reads it and all have one."""
        records = [record for record in self._records.values() if record.found_inf]
        if not self.rule.reads_amax or not all(record.amax for record in records):
            return None
        return kernels.combine_max((a for record in records for a in record.amax.values()), device)
