"""GradScaler: a drop-in for ``torch.amp.GradScaler`` built from a rule, a gradient pass and a monitor."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist

from mixprec.scaling import kernels
from mixprec.scaling._devices import is_available, parse_device, wide_float
from mixprec.scaling.accessors import TorchAccessors
from mixprec.scaling.decisions import Decisions
from mixprec.scaling.factory import build_rule
from mixprec.scaling.fused import supports_fused_scaling
from mixprec.scaling.guards import check_new_scale, check_optimizer, refuse_closure
from mixprec.scaling.monitor import SkipMonitor
from mixprec.scaling.outputs import map_tensors
from mixprec.scaling.rules import ScaleRule, check_flag
from mixprec.scaling.state import GradScalerError, OptimizerRecord, OptState
from mixprec.scaling.sync import RankSync

__all__ = ["GradScaler"]

_NO_SCALE_YET = (
    "This may indicate your script did not use scaler.scale(loss or outputs) earlier in the iteration."
)


class GradScaler(TorchAccessors, Decisions):
    """Loss scaling for mixed-precision training; same calls, errors and checkpoints as torch.amp.GradScaler.

    Typical use, exactly as with torch::

        scaler = mixprec.GradScaler()
        for batch in data:
            optimizer.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(batch)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)                 # optional: to clip or inspect gradients
            scaler.step(optimizer)                     # skipped if any gradient is inf/nan
            scaler.update()
            if not scaler.last_step_skipped:           # beyond torch: keep the LR schedule honest
                lr_scheduler.step()

    How the scale moves is a rule object (:class:`DynamicScale` by default); the constructor's torch
    arguments build one, or pass ``rule=`` (:class:`StaticScale`, :class:`NoScale`, :class:`HeadroomScale`).
    ``unscale_`` and ``update`` never wait for the device; ``step`` syncs once for its skip decision, as torch
    does, except with fused optimizers, which skip inside their kernel.

    Unscaling runs torch's one-pass check-and-multiply op unless the rule needs amax every step
    (HeadroomScale): see scaling/kernels.py for that decision. The default rule still reads amax for its
    underflow recovery (all-zero gradients at a lowered scale restart it, see :class:`DynamicScale`): fused
    optimizers' check pass measures it anyway; otherwise ``step``, which syncs once for its skip decision,
    reads the scale in that same sync and, only when the scale is below 1 and the step is clean, reads the
    gradients once more for amax (plus one all-reduce under torch.distributed).

    Under torch.distributed every rank skips or steps together: each optimizer's found_inf is all-reduced
    (MAX) over ``process_group`` in one collective before its skip decision, and ``update()`` combines those
    agreed values without another one, so the scales stay equal (see :class:`~mixprec.scaling.sync.RankSync`).

    Args:
        device: device type the scaler is meant for; None (default) means the device of the first tensor
            scaled. Like torch, an explicit device whose backend is unavailable disables the scaler with a
            warning.
        init_scale: starting scale, in [smallest normal float32, float32 max] (the scale and its reciprocal
            are float32).
        growth_factor: > 1, applied after ``growth_interval`` good steps in a row.
        backoff_factor: in (0, 1), applied on overflow.
        growth_interval: >= 1.
        enabled: False makes every method a no-op and ``step`` a plain ``optimizer.step()``.
        rule: a ready rule object instead of the arguments above.
        growth: ``"interval"`` (torch's rule) or ``"headroom"`` (also grow as soon as gradients allow).
        hysteresis: overflows tolerated before backing off (every overflow still skips its step).
        min_scale: floor for the scale, >= the smallest normal float32 (the default), so never 0.
        max_scale: cap for the scale, <= float32 max.
        allow_fp16_grads: unscale fp16 gradients instead of raising torch's ValueError.
        warn_after_skips: warn once after this many skipped steps in a row; None never warns.
        process_group: the ranks that must agree on skipping; None means the default group.
        sync: ``"auto"`` (agree when torch.distributed is initialised with more than one rank), True (the
            same, but raise if it is not initialised) or False (decide per rank, as torch does).

    Attributes:
        rule: the :class:`~mixprec.scaling.rules.ScaleRule` that owns the scale.
        monitor: the :class:`~mixprec.scaling.monitor.SkipMonitor` behind ``skipped_steps``.
        rank_sync: the :class:`~mixprec.scaling.sync.RankSync` that all-reduces found_inf across ranks.

    Raises:
        ValueError: for a bad argument, naming it and the accepted values.
        TypeError: for a ``rule`` that is not a ScaleRule, or a flag (``enabled``, ``allow_fp16_grads``) that
            is not a bool.
    """

    def __init__(
        self,
        device: str | torch.device | None = None,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        rule: ScaleRule | None = None,
        growth: str = "interval",
        hysteresis: int = 1,
        min_scale: float | None = None,
        max_scale: float | None = None,
        allow_fp16_grads: bool = False,
        warn_after_skips: int | None = 50,
        process_group: dist.ProcessGroup | None = None,
        sync: str | bool = "auto",
    ) -> None:
        self._device = None if device is None else parse_device(device)
        self.rule = build_rule(
            rule,
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            growth=growth,
            hysteresis=hysteresis,
            min_scale=min_scale,
            max_scale=max_scale,
        )
        self.monitor = SkipMonitor(warn_after_skips)
        self.rank_sync = RankSync(sync, process_group)
        self.allow_fp16_grads = check_flag("allow_fp16_grads", allow_fp16_grads)
        self._enabled = check_flag("enabled", enabled) and self._backend_usable()
        self._records: dict[int, OptimizerRecord] = {}

    def _backend_usable(self) -> bool:
        if self._device is None or is_available(self._device.type):
            return True
        warnings.warn(
            f"mixprec.GradScaler is enabled for device {str(self._device)!r}, but {self._device.type} is not "
            "available. Disabling: scale() returns its input and step() calls optimizer.step().",
            stacklevel=3,
        )
        return False

    def is_enabled(self) -> bool:
        """Whether scaling is on."""
        return self._enabled

    # -- scale -----------------------------------------------------------------------------------------

    def scale(self, outputs: Any) -> Any:
        """Multiply a tensor, or every tensor of nested lists/tuples/dicts, by the current scale.

        The scale is created on the device of the first tensor ever scaled; tensors on other devices get a
        copy (made once per call). Disabled: returns ``outputs`` unchanged.
        """
        if not self._enabled:
            return outputs
        per_device: dict[torch.device, torch.Tensor] = {}

        def multiply(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.device not in per_device:
                scale = self._ensure_state(tensor.device)
                per_device[tensor.device] = scale.to(tensor.device, non_blocking=True)
            return tensor * per_device[tensor.device]

        return map_tensors(outputs, multiply)

    def _ensure_state(self, device: torch.device) -> torch.Tensor:
        scale = self.rule.ensure_state(device)
        self.monitor.ensure_state(scale.device)
        return scale

    def _require_scale(self, funcname: str) -> torch.Tensor:
        if self.rule.scale is None:
            raise GradScalerError(f"Attempted {funcname} but _scale is None.  " + _NO_SCALE_YET)
        return self.rule.scale

    def _record(self, optimizer: torch.optim.Optimizer) -> OptimizerRecord:
        check_optimizer(optimizer)
        return self._records.setdefault(id(optimizer), OptimizerRecord())

    # -- unscale_ / step -------------------------------------------------------------------------------

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale in place, checking them for inf/nan (no sync).

        Optional: :meth:`step` does it if not done. Call it once per optimizer per iteration, after all
        gradients are accumulated, to clip or inspect unscaled gradients. Sparse fp16 gradients are
        coalesced first (replacing ``.grad``), as in torch.

        Raises:
            GradScalerError: when called twice in an iteration, after ``step``, or before any ``scale``.
            ValueError: for fp16 gradients unless ``allow_fp16_grads``.
            TypeError: for an ``optimizer`` without ``param_groups``.
        """
        if not self._enabled:
            return
        scale = self._require_scale("unscale_")
        record = self._record(optimizer)
        if record.stage is OptState.UNSCALED:
            raise GradScalerError(
                "unscale_() has already been called on this optimizer since the last update()."
            )
        if record.stage is OptState.STEPPED:
            raise GradScalerError("unscale_() is being called after step().")
        self._check_grads(optimizer, record, scale, unscale=True, allow_fp16=self.allow_fp16_grads)
        record.stage = OptState.UNSCALED

    def _check_grads(
        self,
        optimizer: torch.optim.Optimizer,
        record: OptimizerRecord,
        scale: torch.Tensor,
        unscale: bool,
        allow_fp16: bool,
    ) -> None:
        params = (param for group in optimizer.param_groups for param in group["params"])
        groups = kernels.collect_grads(params, allow_fp16)
        # The reciprocal in float64 (where the device has it), as torch does: float32 division can be inexact.
        inv_scale = scale.to(wide_float(scale.device)).reciprocal().float()
        unscale = unscale and not self.rule.is_identity
        record.found_inf, record.amax = kernels.check_and_unscale_(
            groups, inv_scale, unscale, want_amax=self.rule.needs_amax
        )

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless :meth:`unscale_` ran) and call ``optimizer.step(*args, **kwargs)`` unless a
        gradient is inf/nan.

        Returns:
            What ``optimizer.step`` returned, or None when the step was skipped.

        Raises:
            GradScalerError: for a closure (keyword or positional), a second ``step`` in the iteration, no
                ``scale`` earlier, or an optimizer none of whose parameters has a gradient.
            TypeError: for an ``optimizer`` without ``param_groups``.
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        refuse_closure(args, kwargs)
        scale = self._require_scale("step")
        record = self._record(optimizer)
        if record.stage is OptState.STEPPED:
            raise GradScalerError("step() has already been called since the last update().")
        if supports_fused_scaling(optimizer):
            return self._fused_step(optimizer, record, scale, args, kwargs)
        if record.stage is OptState.READY:
            self.unscale_(optimizer)
        if not record.found_inf:
            self._records.pop(id(optimizer))  # nothing was unscaled: leave no trace of this call
            raise GradScalerError(
                "No inf checks were recorded for this optimizer. (None of its parameters has a .grad: was "
                "backward() called on the scaled loss, and does the optimizer hold the model's parameters?)"
            )
        found_inf = self._combine_found_inf(record, scale.device)
        skip = self._skip_decision(optimizer, record, found_inf, scale)
        retval = self._on_skip() if skip else optimizer.step(*args, **kwargs)
        record.stage = OptState.STEPPED
        return retval

    # -- update ----------------------------------------------------------------------------------------

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Move the scale once per iteration, after every optimizer's ``step`` (no sync).

        Args:
            new_scale: set the scale to this instead: a float or int in [smallest normal float32, float32
                max], or a 1-element tensor whose value is copied (not checked: that would sync).

        An iteration that only calls ``update(new_scale)`` (no step, no unscale_) skipped nothing:
        ``last_step_skipped`` is False after it.

        Raises:
            GradScalerError: with no ``new_scale`` and no step/unscale_ in this iteration, or no scale() ever.
            ValueError: for a bad ``new_scale``; the scaler is left as it was, and ``update()`` may follow.
        """
        if not self._enabled:
            return
        scale = self._require_scale("update")
        checked = None if new_scale is None else check_new_scale(new_scale)
        if checked is None and not any(record.found_inf for record in self._records.values()):
            raise GradScalerError("No inf checks were recorded prior to update.")
        for record in self._records.values():
            if record.found_inf and record.stage is not OptState.STEPPED:
                self._combine_found_inf(record, scale.device)  # unscale_() without step(): agree now
        found_infs = [tensor for record in self._records.values() for tensor in record.found_inf.values()]
        found_inf = kernels.combine_max(found_infs, scale.device)
        if checked is not None:
            self.rule.set_scale(checked)
        else:
            self.rule.update(found_inf, self._combine_amax(scale.device))
        if found_infs:
            self.monitor.record(found_inf)
        else:
            self.monitor.record_no_step()
        self._records = {}

    # -- accessors -------------------------------------------------------------------------------------

    def get_scale(self) -> float:
        """The current scale as a Python float (a host sync); 1.0 when disabled."""
        return self.rule.get_scale() if self._enabled else 1.0

    @property
    def skipped_steps(self) -> int:
        """Iterations whose step was skipped by at least one optimizer (a host sync); 0 when disabled."""
        if not self._enabled:
            return 0
        self.monitor.check(pending=0, scale=self.rule.get_scale())
        return self.monitor.skipped_steps

    @property
    def last_step_skipped(self) -> bool:
        """Whether the iteration closed by the last ``update()`` skipped a step (a host sync)."""
        return self._enabled and self.monitor.skip_run > 0
