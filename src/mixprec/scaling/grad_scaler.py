"""GradScaler: the loss scaler's state machine, in call order (scale -> unscale_ -> step -> update).

Per optimizer and iteration the scaler keeps a record: its stage (READY -> UNSCALED -> STEPPED) and what the
gradient pass measured (found_inf, amax per device). ``update()`` combines the records and hands the result
to the rule (rules.py, dynamic.py, headroom.py) and the skip monitor (skip.py). The gradients a pass reads
come from grads.py, the pass itself is unscale.py, fused optimizers get their hand-off from fused.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist

from mixprec._tree import map_tensors
from mixprec.scaling import rules
from mixprec.scaling.devices import parse_device, warn_if_unavailable, wide_float
from mixprec.scaling.dynamic import DynamicScale
from mixprec.scaling.fused import run_fused_step, supports_fused_scaling
from mixprec.scaling.grads import check_optimizer, collect_grads, params_of
from mixprec.scaling.headroom import HeadroomScale  # noqa: F401  (registers growth="headroom")
from mixprec.scaling.rules import DEFAULTS, GradScalerError, ScaleRule
from mixprec.scaling.skip import RankSync, SkipMonitor
from mixprec.scaling.unscale import check_and_unscale_, combine_max, measure_amax

__all__ = ["GradScaler", "GradScalerError", "OptState"]


class OptState(Enum):
    """Where one optimizer is within the current iteration."""

    READY = 0  # nothing done since the last update()
    UNSCALED = 1  # unscale_() ran: gradients are unscaled and checked
    STEPPED = 2  # step() ran (or skipped); only update() may follow


@dataclass
class _Record:
    """What the scaler knows about one optimizer in the current iteration (kept in the scaler, not on it)."""

    stage: OptState = OptState.READY
    found_inf: dict[torch.device, torch.Tensor] = field(default_factory=dict)
    amax: dict[torch.device, torch.Tensor] = field(default_factory=dict)
    skipped: bool | None = None  # the step's skip decision where the host read it, else None (fused)


class GradScaler:
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
    (HeadroomScale). The default rule reads amax for its underflow restart (:class:`DynamicScale`): a
    non-fused ``step`` measures it in the sync it makes anyway, when the scale is below 1 and the step is
    clean; fused steps and explicit ``unscale_`` calls measure it in their pass every
    ``underflow_check_interval``-th update.

    Under torch.distributed every rank skips or steps together: each optimizer's found_inf is all-reduced
    (MAX) over ``process_group`` in one collective before its skip decision, and ``update()`` combines those
    agreed values without another one, so the scales stay equal (see :class:`~mixprec.scaling.skip.RankSync`).

    Args:
        device: any device torch knows ("cuda", "cpu", "mps", "xpu", "hpu", ...) or None (default); the scale
            lives on the device of the first tensor scaled. As torch, ``"cuda"`` without CUDA disables the
            scaler with a warning; other device types stay enabled.
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
        monitor: the :class:`~mixprec.scaling.skip.SkipMonitor` behind ``skipped_steps``.
        rank_sync: the :class:`~mixprec.scaling.skip.RankSync` that all-reduces found_inf across ranks.

    Raises:
        ValueError: for a bad argument, naming it and the accepted values.
        TypeError: for a ``rule`` that is not a ScaleRule, or a flag (``enabled``, ``allow_fp16_grads``) that
            is not a bool.
    """

    def __init__(
        self,
        device: str | torch.device | None = None,
        init_scale: float = DEFAULTS.init_scale,
        growth_factor: float = DEFAULTS.growth_factor,
        backoff_factor: float = DEFAULTS.backoff_factor,
        growth_interval: int = DEFAULTS.growth_interval,
        enabled: bool = True,
        *,
        rule: ScaleRule | None = None,
        growth: str = DEFAULTS.growth,
        hysteresis: int = DEFAULTS.hysteresis,
        min_scale: float | None = DEFAULTS.min_scale,
        max_scale: float | None = DEFAULTS.max_scale,
        allow_fp16_grads: bool = False,
        warn_after_skips: int | None = 50,
        process_group: dist.ProcessGroup | None = None,
        sync: str | bool = "auto",
    ) -> None:
        self._device = None if device is None else parse_device(device)
        arguments = rules.RuleArguments(
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            growth=growth,
            hysteresis=hysteresis,
            min_scale=min_scale,
            max_scale=max_scale,
        )
        self.rule = rules.build_rule(rule, arguments)
        self.monitor = SkipMonitor(warn_after_skips)
        self.rank_sync = RankSync(sync, process_group)
        self.allow_fp16_grads = rules.check_flag("allow_fp16_grads", allow_fp16_grads)
        enabled = rules.check_flag("enabled", enabled)
        self._enabled = enabled and not warn_if_unavailable(self._device, stacklevel=2)
        self._records: dict[int, _Record] = {}

    def is_enabled(self) -> bool:
        """Whether loss scaling is on."""
        return self._enabled

    # -- scale -----------------------------------------------------------------------------------------

    def scale(self, outputs: Any) -> Any:
        """Multiply a tensor, or every tensor of nested lists/tuples/dicts, by the current scale.

        The scale is created on the device of the first tensor ever scaled; tensors on other devices get a
        copy (once per call). Disabled: returns ``outputs`` unchanged.

        Raises:
            ValueError: for a leaf that is not a tensor (torch's error type), naming its type.
        """
        if not self._enabled:
            return outputs
        per_device: dict[torch.device, torch.Tensor] = {}

        def multiply(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.device not in per_device:
                scale = self.rule.ensure_state(tensor.device)
                self.monitor.ensure_state(scale.device)
                per_device[tensor.device] = scale.to(tensor.device, non_blocking=True)
            return tensor * per_device[tensor.device]

        return map_tensors(outputs, multiply, strict=True)

    def _require_scale(self, funcname: str) -> torch.Tensor:
        if self.rule.scale is None:
            raise GradScalerError(
                f"Attempted {funcname} but _scale is None.  This may indicate your script did not use "
                "scaler.scale(loss or outputs) earlier in the iteration."
            )
        return self.rule.scale

    def _record(self, optimizer: torch.optim.Optimizer) -> _Record:
        check_optimizer(optimizer)
        return self._records.setdefault(id(optimizer), _Record())

    # -- unscale_ --------------------------------------------------------------------------------------

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
        self._check_grads(optimizer, record, scale, unscale=True, measure_amax=True)
        record.stage = OptState.UNSCALED

    def _check_grads(
        self,
        optimizer: torch.optim.Optimizer,
        record: _Record,
        scale: torch.Tensor,
        unscale: bool,
        measure_amax: bool,
    ) -> None:
        """The gradient pass: found_inf (and amax, where the rule needs it) per device, unscaling if asked.

        amax: in every pass for ``"every_step"`` rules; for ``"when_free"`` ones where the rule says it is due
        and ``measure_amax`` (a fused step, which has no sync, or an explicit ``unscale_``, after which the
        user may edit the gradients: clipping an inf norm zeroes them); else a non-fused step's sync.
        """
        allow_fp16 = self.allow_fp16_grads or not unscale  # a check-only pass leaves gradients alone
        groups = collect_grads(params_of(optimizer), allow_fp16)
        use = self.rule.amax_use
        want_amax = use == "every_step" or (use == "when_free" and measure_amax and self.rule.amax_due)
        if unscale or want_amax:  # the reciprocal in float64 (where there is one), as torch
            inv_scale = scale.to(wide_float(scale.device)).reciprocal().float()
        else:
            inv_scale = torch.ones_like(scale)  # a check-only pass multiplies by 1, as torch's does
        unscale = unscale and not self.rule.is_identity
        record.found_inf, record.amax = check_and_unscale_(groups, inv_scale, unscale, want_amax=want_amax)

    # -- step ------------------------------------------------------------------------------------------

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
        rules.refuse_closure(args, kwargs)
        scale = self._require_scale("step")
        record = self._record(optimizer)
        if record.stage is OptState.STEPPED:
            raise GradScalerError("step() has already been called since the last update().")
        if supports_fused_scaling(optimizer):
            return self._fused_step(optimizer, record, scale, args, kwargs)
        checked_here = record.stage is OptState.READY  # else unscale_() checked, and the user may edit since
        if checked_here:  # this step's sync measures amax where the rule needs it
            self._check_grads(optimizer, record, scale, unscale=True, measure_amax=False)
        if not record.found_inf:
            self._records.pop(id(optimizer))  # nothing was unscaled: leave no trace of this call
            raise GradScalerError(
                "No inf checks were recorded for this optimizer. (None of its parameters has a .grad: was "
                "backward() called on the scaled loss, and does the optimizer hold the model's parameters?)"
            )
        found_inf = self._agree_found_inf(record, scale.device)
        if self._skip_decision(optimizer, record, scale, found_inf, checked_here):
            retval = None
        else:
            retval = optimizer.step(*args, **kwargs)
        record.stage = OptState.STEPPED
        return retval

    def _fused_step(
        self,
        optimizer: torch.optim.Optimizer,
        record: _Record,
        scale: torch.Tensor,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """Hand scale and found_inf to an optimizer that unscales and skips in its own kernel (no sync)."""
        if record.stage is OptState.READY:
            self._check_grads(optimizer, record, scale, unscale=False, measure_amax=True)
            # As torch: compose with a grad_scale the user may have set on the optimizer.
            grad_scale: torch.Tensor | None = scale * getattr(optimizer, "grad_scale", 1)
        else:
            grad_scale = getattr(optimizer, "grad_scale", None)  # already unscaled by unscale_()
        found_inf = self._agree_found_inf(record, scale.device)
        retval = run_fused_step(optimizer, grad_scale, found_inf, args, kwargs)
        record.stage = OptState.STEPPED
        return retval

    def _agree_found_inf(self, record: _Record, device: torch.device) -> torch.Tensor:
        """One optimizer's found_inf (1.0 if any device's is non-zero) on ``device``, the same on every rank.

        Every skip decision goes through here: found_inf (with amax, where the rule reads it) is all-reduced
        across ranks, one collective per optimizer, and replaces the record's, so ``update()`` needs none.
        """
        found_inf = combine_max(record.found_inf.values(), device)
        measured = self.rule.amax_use != "none" and record.amax
        amax = combine_max(record.amax.values(), device) if measured else None
        found_inf, amax = self.rank_sync.max_across_ranks(found_inf, amax)
        record.found_inf = {device: found_inf}
        if amax is not None:
            record.amax = {device: amax}
        return found_inf

    def _skip_decision(
        self,
        optimizer: torch.optim.Optimizer,
        record: _Record,
        scale: torch.Tensor,
        found_inf: torch.Tensor,
        checked_here: bool,
    ) -> bool:
        """Read found_inf on the host: the step's one sync, as torch's. What else the host needs this step
        is read in the same sync: the scale where the rule reads amax but this step's own check
        (``checked_here``) gave none, the run of skips where the skip warning may be due
        (:meth:`SkipMonitor.may_warn`), and what the rule's ``after_skip`` reads.

        Below a scale of 1 (only there can all gradients flush to zero) a clean step measures amax, agreed
        across ranks. A skipped step is handed to the skip monitor and the rule's ``after_skip``.
        """
        wants_amax = self.rule.amax_use != "none" and not record.amax and checked_here
        wants_run = self.monitor.may_warn(pending=1)
        reads = {"found": found_inf}
        if wants_amax or wants_run:
            reads["scale"] = scale
        if wants_run:
            reads["run"] = self.monitor.run_tensor()
        rule_reads = self.rule.skip_reads()
        reads.update((f"rule{i}", t) for i, t in enumerate(rule_reads))
        if len(reads) == 1:
            got = {"found": found_inf.item()}
        else:
            parts = [t.to(found_inf.device, torch.float32) for t in reads.values()]
            got = dict(zip(reads, torch.stack(parts).tolist(), strict=True))
        record.skipped = skipped = got["found"] != 0
        if wants_amax and not skipped and got["scale"] < 1:
            amax_here = measure_amax(params_of(optimizer), scale.device)
            agreed = self.rank_sync.max_across_ranks(found_inf, amax_here)[1]
            record.amax = {scale.device: amax_here if agreed is None else agreed}  # None only without amax
        if skipped:
            run = int(got["run"]) if wants_run else None
            self.monitor.check(pending=1, scale=got.get("scale", self.rule.get_scale), run=run)
            if rule_reads:
                self.rule.after_skip([got[f"rule{i}"] for i in range(len(rule_reads))])
            else:
                self.rule.after_skip()
        return skipped

    # -- update ----------------------------------------------------------------------------------------

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Move the scale once per iteration, after every optimizer's ``step`` (no sync).

        Args:
            new_scale: set the scale to this instead: a float or int in [smallest normal float32, float32
                max], or a 1-element tensor whose value is copied (not checked: that would sync). An
                iteration that only calls ``update(new_scale)`` skipped nothing (``last_step_skipped``).

        Raises:
            GradScalerError: no ``new_scale`` and no ``step``/``unscale_`` this iteration, or no scale() yet.
            ValueError: for a bad ``new_scale``; the scaler is left as it was, and ``update()`` may follow.
        """
        if not self._enabled:
            return
        scale = self._require_scale("update")
        checked = None if new_scale is None else rules.check_new_scale(new_scale)
        records = [record for record in self._records.values() if record.found_inf]
        if checked is None and not records:
            raise GradScalerError("No inf checks were recorded prior to update.")
        for record in records:
            if record.stage is not OptState.STEPPED:
                self._agree_found_inf(record, scale.device)  # unscale_() without step(): agree now
        found_inf = combine_max((t for r in records for t in r.found_inf.values()), scale.device)
        if checked is not None:
            self.rule.set_scale(checked)
        else:
            all_measured = self.rule.amax_use != "none" and all(record.amax for record in records)
            amax = (t for r in records for t in r.amax.values()) if all_measured else None
            self.rule.update(found_inf, None if amax is None else combine_max(amax, scale.device))
        if records:  # known clean on the host where every step's decision was read there
            self.monitor.record(found_inf, clean=all(record.skipped is False for record in records))
        else:
            self.monitor.record_no_step()
        self._records = {}

    # -- what torch's GradScaler also offers: getters, setters, checkpoints ---------------------------

    def get_scale(self) -> float:
        """The current scale as a Python float (a host sync); 1.0 when disabled."""
        return self.rule.get_scale() if self._enabled else 1.0

    @property
    def skipped_steps(self) -> int:
        """Iterations whose step was skipped by at least one optimizer (a host sync); 0 when disabled."""
        if not self._enabled:
            return 0
        skipped, run = self.monitor.counts()
        self.monitor.check(pending=0, scale=self.rule.get_scale, run=run)
        return skipped

    @property
    def last_step_skipped(self) -> bool:
        """Whether the iteration closed by the last ``update()`` skipped a step (a host sync)."""
        return self._enabled and self.monitor.skip_run > 0

    def _dynamic(self, name: str) -> DynamicScale:
        if not isinstance(self.rule, DynamicScale):
            rule = self.rule.name
            raise TypeError(f"{name} belongs to DynamicScale and HeadroomScale; this scaler's rule is {rule}")
        return self.rule

    def get_growth_factor(self) -> float:
        """The growth factor of the dynamic rule (TypeError for StaticScale and NoScale)."""
        return self._dynamic("growth_factor").growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the growth factor (> 1; ValueError otherwise)."""
        self._dynamic("growth_factor").growth_factor = new_factor

    def get_backoff_factor(self) -> float:
        """The backoff factor of the dynamic rule."""
        return self._dynamic("backoff_factor").backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the backoff factor (in (0, 1))."""
        self._dynamic("backoff_factor").backoff_factor = new_factor

    def get_growth_interval(self) -> int:
        """The growth interval of the dynamic rule."""
        return self._dynamic("growth_interval").growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval (>= 1)."""
        self._dynamic("growth_interval").growth_interval = new_interval

    def state_dict(self) -> dict[str, Any]:
        """Torch's keys (``scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``,
        ``_growth_tracker``) plus mixprec's; empty when disabled. Call it after :meth:`update`."""
        if not self._enabled:
            return {}
        return {**self.rule.state_dict(), **self.monitor.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict` or from a torch GradScaler's; a no-op when disabled.

        Every key is checked before anything changes (see :meth:`validate_state_dict`): a dict that raises
        leaves the scaler exactly as it was.

        Raises:
            RuntimeError: for an empty dict (saved from a disabled scaler).
            TypeError: when ``state_dict`` is not a dict.
            ValueError: for a missing or bad key (named), or a dict saved from a different kind of rule.
        """
        if not self._enabled:
            return
        rule_values, monitor_values = self._read_state(state_dict)
        self.rule._apply_state(rule_values)
        self.monitor._apply_state(monitor_values)

    def validate_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Raise what :meth:`load_state_dict` would raise for ``state_dict``, changing nothing.

        For wrappers that restore several parts at once (a model, an optimizer, this scaler): check every
        part first, then load them all.
        """
        if self._enabled:
            self._read_state(state_dict)

    def _read_state(self, state_dict: dict[str, Any]) -> tuple[dict[str, Any], dict[str, int]]:
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}: {state_dict!r:.80}")
        if len(state_dict) == 0:
            raise RuntimeError(
                "The source state dict is empty, possibly because it was saved from a disabled instance of "
                "GradScaler."
            )
        return self.rule.read_state(state_dict), self.monitor.read_state(state_dict)

    def __getstate__(self) -> dict[str, Any]:
        if self._records:
            raise GradScalerError(
                "A GradScaler instance may only be pickled at the beginning of an iteration, or at the end "
                "after scaler.update()."
            )
        return self.__dict__.copy()
