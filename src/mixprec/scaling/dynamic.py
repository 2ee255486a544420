"""DynamicScale: torch's dynamic loss scale, with hysteresis, a floor and a cap.

The scale update itself is torch's ``_amp_update_scale_`` (:func:`update_scale_`, at the end), with the same
rule written in tensor ops for devices whose backend lacks that kernel.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from mixprec.scaling.devices import wide_float
from mixprec.scaling.rules import (
    DEFAULTS,
    FLOAT32_TINY,
    ScaleRule,
    check_count,
    check_flag,
    check_positive,
    check_scale,
    optional,
    required,
)

__all__ = ["FLOAT32_TINY", "DynamicScale", "check_backoff_factor", "check_growth_factor"]


def check_growth_factor(name: str, value: Any) -> float:
    """``float(value)`` for a finite number > 1; otherwise a ValueError naming it."""
    if check_positive(name, value) <= 1:
        raise ValueError(f"{name} must be > 1, got {value!r}")
    return float(value)


def check_backoff_factor(name: str, value: Any) -> float:
    """``float(value)`` for a number in (0, 1); otherwise a ValueError naming it."""
    if check_positive(name, value) >= 1:
        raise ValueError(f"{name} must be in (0, 1), got {value!r}")
    return float(value)


def _check_bound(name: str, value: Any) -> float | None:
    return None if value is None else check_scale(name, value)


class DynamicScale(ScaleRule):
    """Torch's dynamic loss scale, with hysteresis, a floor and a cap.

    Once per ``update()``, on the device (each product rounded once to float32, as torch's kernel does)::

        if found_inf:                           # some optimizer saw inf/nan and skipped its step
            growth_tracker = 0
            hysteresis_left = max(hysteresis_left - 1, 0)
            if hysteresis_left == 0:            # tolerated overflows used up: back off
                scale = max(scale * backoff_factor, min_scale)
        else:
            growth_tracker += 1
            if growth_tracker >= growth_interval:
                growth_tracker = 0
                hysteresis_left = hysteresis    # a clean window earns the tolerance back
                if isfinite(scale * growth_factor):     # never grow to inf (torch)
                    scale = min(scale * growth_factor, max_scale)
            if amax == 0 and scale < init_scale:    # underflow recovery (beyond torch, see below)
                scale = min(init_scale, max_scale)  # amax: measured every underflow_check_interval-th

    With ``hysteresis=1``, ``min_scale=None`` and ``max_scale=None`` this is torch's rule, except that the
    scale stops at the smallest normal float32 instead of collapsing to 0 after ~160 overflows in a row, and
    that growth happens at ``>=`` rather than ``==`` growth_interval (torch never grows again if the interval
    is lowered below the current tracker). With ``hysteresis=1`` the counter is not kept: every overflow backs
    off.

    Underflow recovery: after a long run of overflows (a stretch of bad data, a NaN loss) the scale sits at
    the floor, every half-precision gradient flushes to exactly 0, no step overflows and nothing grows for
    ``growth_interval`` steps: training stalls silently. So a step whose gradients are finite and *all
    exactly zero* (``amax == 0``) with the scale below ``init_scale`` puts the scale back to
    ``init_scale``: zeros everywhere under a finite loss are underflow, and nothing that is all zero can
    overflow. If ``init_scale`` is still too high, the next steps back off as usual. A model whose
    gradients are genuinely all zero at a lowered scale costs at most a few skipped steps. Without amax
    (``update(found_inf)``) the rule is torch's.

    Where amax comes from, and the trade-off: a non-fused step that checks the gradients itself syncs
    anyway for its skip decision; it reads the scale in that sync and, below 1 on a clean step, measures
    amax at once. A fused optimizer's step (``AdamW(fused=True)``) has no sync and only a check pass, and
    torch's check op gives found_inf but no amax; measuring it there takes public-op kernels instead, which
    cost more than torch's op (per-tensor ``aminmax``; one ``_foreach_norm(inf)`` plus a reduction is
    slower still on a CPU). An explicit ``unscale_`` has no sync either, and the user may edit
    the gradients after it (clipping an inf norm zeroes them all, which is not underflow). So those passes
    measure amax only on every ``underflow_check_interval``-th update (a host-side counter, saved in
    ``state_dict``) and run torch's op on the others: a stall is noticed within ``underflow_check_interval``
    updates instead of at once, and the measuring pass costs 1/16 of itself per step at the default (the
    figures and their commands: docs/measured-figures.md, "loss-scaling overhead").
    ``underflow_check_interval=1`` measures on every such pass.

    Args:
        init_scale: starting scale.
        growth_factor: factor > 1 applied after ``growth_interval`` good steps in a row.
        backoff_factor: factor in (0, 1) applied on overflow.
        growth_interval: good steps in a row before growing, >= 1.
        hysteresis: overflows tolerated before backing off (Megatron/DeepSpeed meaning), >= 1. Every
            overflow still skips its step.
        min_scale: floor, in [smallest normal float32, float32 max]; None means the smallest normal float32
            (so the scale and its reciprocal stay finite, never 0).
        max_scale: cap, in the same range; None means none (growth still stops short of inf).
        underflow_restart: the underflow recovery above; False gives torch's rule exactly, and lets a fused
            optimizer's check pass run torch's own op (no amax to measure), at torch's cost.
        underflow_check_interval: passes without a sync (fused steps, explicit ``unscale_``) measure amax
            on every this-many-th update, >= 1.
        raise_at_min_scale: raise RuntimeError when a skipped step would back off from the floor
            (checked when the scaler has already synced for the skip decision, so never on fused steps).

    Raises:
        ValueError: for any argument outside the ranges above, or ``min_scale > max_scale``, or
            ``init_scale`` outside ``[min_scale, max_scale]``.
        TypeError: for a ``underflow_restart`` or ``raise_at_min_scale`` that is not a bool.
    """

    growth: ClassVar[str | None] = "interval"

    def __init__(
        self,
        init_scale: float = DEFAULTS.init_scale,
        growth_factor: float = DEFAULTS.growth_factor,
        backoff_factor: float = DEFAULTS.backoff_factor,
        growth_interval: int = DEFAULTS.growth_interval,
        *,
        hysteresis: int = DEFAULTS.hysteresis,
        min_scale: float | None = DEFAULTS.min_scale,
        max_scale: float | None = DEFAULTS.max_scale,
        underflow_restart: bool = True,
        underflow_check_interval: int = 16,
        raise_at_min_scale: bool = False,
    ) -> None:
        super().__init__(init_scale)
        self.underflow_restart = check_flag("underflow_restart", underflow_restart)
        self.underflow_check_interval = check_count("underflow_check_interval", underflow_check_interval)
        self._underflow_check_tracker = 0  # updates since the last amax-measuring one, mod the interval
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.hysteresis = check_count("hysteresis", hysteresis)
        self.min_scale = min_scale
        self.max_scale = _check_bound("max_scale", max_scale)
        self.raise_at_min_scale = check_flag("raise_at_min_scale", raise_at_min_scale)
        _check_bounds(self.min_scale, self.max_scale, self.init_scale)
        self._floor_holds = True  # the scale is known to be >= the floor (init_scale is)
        self._growth_tracker: torch.Tensor | None = None
        self._hysteresis_left: torch.Tensor | None = None
        self._init_growth_tracker = 0
        self._init_hysteresis_left = self.hysteresis
        self._tracker_unchecked = False  # the tracker may be >= growth_interval (interval lowered, loaded)

    # Validated attributes: the GradScaler's set_growth_factor() & co. write through these.
    @property
    def growth_factor(self) -> float:
        """Factor > 1 applied on growth."""
        return self._growth_factor

    @growth_factor.setter
    def growth_factor(self, value: float) -> None:
        self._growth_factor = check_growth_factor("growth_factor", value)

    @property
    def backoff_factor(self) -> float:
        """Factor in (0, 1) applied on back-off."""
        return self._backoff_factor

    @backoff_factor.setter
    def backoff_factor(self, value: float) -> None:
        self._backoff_factor = check_backoff_factor("backoff_factor", value)

    @property
    def growth_interval(self) -> int:
        """Good steps in a row before growing."""
        return self._growth_interval

    @growth_interval.setter
    def growth_interval(self, value: int) -> None:
        self._growth_interval = check_count("growth_interval", value)
        self._tracker_unchecked = True

    @property
    def min_scale(self) -> float | None:
        """The floor on back-off; None means the smallest normal float32."""
        return self._min_scale

    @min_scale.setter
    def min_scale(self, value: float | None) -> None:
        self._min_scale = _check_bound("min_scale", value)
        self._floor_holds = False  # the scale may now be below the new floor

    def set_scale(self, new_scale: float | torch.Tensor) -> None:
        super().set_scale(new_scale)
        self._floor_holds = not isinstance(new_scale, torch.Tensor) and new_scale >= self.floor

    @property
    def amax_use(self) -> str:  # type: ignore[override]
        """``"when_free"``: amax == 0 is the underflow signal; ``"none"`` without ``underflow_restart``."""
        return "when_free" if self.underflow_restart else "none"

    @property
    def amax_due(self) -> bool:  # type: ignore[override]  # ScaleRule's plain attribute, computed here
        """Whether this iteration is one whose fused steps measure amax (every ``underflow_check_interval``-th
        update, counted on the host)."""
        return self.underflow_restart and self._underflow_check_tracker == 0

    @property
    def floor(self) -> float:
        """The effective minimum scale."""
        return FLOAT32_TINY if self.min_scale is None else self.min_scale

    def _create_state(self, device: torch.device) -> None:
        super()._create_state(device)
        self._growth_tracker = torch.full((), self._init_growth_tracker, dtype=torch.int32, device=device)
        self._hysteresis_left = torch.full((), self._init_hysteresis_left, dtype=torch.int32, device=device)
        self._tracker_unchecked = True

    def update(self, found_inf: torch.Tensor, amax: torch.Tensor | None = None) -> None:
        """Torch's ``_amp_update_scale_`` (back-off, interval growth, never to inf), then what it lacks.

        Around torch's one op, each only where configured or needed: the tracker clamped below the interval
        once after ``growth_interval`` was lowered or loaded (so growth happens at ``>=``), hysteresis (a
        tolerated overflow keeps the scale it had), the floor on back-off, the cap on growth, the underflow
        restart. No host sync. The default (torch's arguments) is two ops: torch's and the floor as one
        clamp, exact while the scale is known to be at or above the floor (then only a back-off can take it
        below); after a scale set below the floor, the floor applies on back-off only (three ops).
        """
        scale = self._require_state()
        tracker, left = self._growth_tracker, self._hysteresis_left
        assert tracker is not None and left is not None
        self._underflow_check_tracker = (self._underflow_check_tracker + 1) % self.underflow_check_interval
        if self._tracker_unchecked:
            tracker.clamp_max_(self.growth_interval - 1)
            self._tracker_unchecked = False
        before = scale.clone() if self.hysteresis > 1 else None
        update_scale_(
            scale, tracker, found_inf, self.growth_factor, self.backoff_factor, self.growth_interval
        )
        restarts = amax is not None and self.underflow_restart
        if before is None and self._floor_holds:
            scale.clamp_min_(self.floor)
            if self.max_scale is None and not restarts:
                return
        found = found_inf > 0
        if before is not None:  # Megatron/DeepSpeed hysteresis: back off only once the tolerance is used up
            left_after = (left - found.int()).clamp_min_(0)
            tolerated = found & (left_after > 0)
            scale.copy_(torch.where(tolerated, before, torch.maximum(scale, found * self.floor)))
            left.copy_(left_after.masked_fill_(~found & (tracker == 0), self.hysteresis))
        elif not self._floor_holds:
            torch.maximum(scale, found * self.floor, out=scale)  # the floor, where it backed off
        if self.max_scale is not None:  # the cap, where it grew (the tracker restarts only on growth)
            scale.copy_(torch.where(~found & (tracker == 0), scale.clamp_max(self.max_scale), scale))
        if restarts:
            assert amax is not None
            restart = min(self.init_scale, self.max_scale or math.inf)
            underflow = (amax.to(scale.device) == 0) & ~found & (scale < restart)
            scale.masked_fill_(underflow, restart)

    def _require_state(self) -> torch.Tensor:
        if self._scale is None:
            raise RuntimeError(f"{self.name}.update() called before the scale exists (no tensor was scaled)")
        return self._scale

    def skip_reads(self) -> list[torch.Tensor]:
        """``[hysteresis_left, scale]`` with ``raise_at_min_scale`` (once they exist), else none."""
        if not self.raise_at_min_scale or self._scale is None or self._hysteresis_left is None:
            return []
        return [self._hysteresis_left, self._scale]

    def after_skip(self, values: Sequence[float] | None = None) -> None:
        reads = self.skip_reads()
        if not reads:
            return
        left, scale = [t.item() for t in reads] if values is None else values
        if left <= 1 and scale <= self.floor:
            raise RuntimeError(
                f"loss scale is already at min_scale={self.floor:g} and gradients still overflow: something "
                "is non-finite at any scale (a loss or op producing inf/nan). Raised because "
                "raise_at_min_scale=True"
            )

    def get_growth_tracker(self) -> int:
        """Good steps in a row since the last growth or overflow (a host sync)."""
        return self._read(self._growth_tracker, self._init_growth_tracker)

    def get_hysteresis_left(self) -> int:
        """Overflows still tolerated before the next back-off (a host sync)."""
        return self._read(self._hysteresis_left, self._init_hysteresis_left)

    @staticmethod
    def _read(tensor: torch.Tensor | None, default: int) -> int:
        return default if tensor is None else int(tensor.item())

    def state_dict(self) -> dict[str, Any]:
        """Torch's GradScaler keys plus mixprec's; torch's ``load_state_dict`` ignores the extra ones."""
        return {
            **super().state_dict(),
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "_growth_tracker": self.get_growth_tracker(),
            "hysteresis": self.hysteresis,
            "_hysteresis_tracker": self.get_hysteresis_left(),
            "min_scale": self.min_scale,
            "max_scale": self.max_scale,
            "underflow_restart": self.underflow_restart,
            "underflow_check_interval": self.underflow_check_interval,
            "_underflow_check_tracker": self._underflow_check_tracker,
            "raise_at_min_scale": self.raise_at_min_scale,
        }

    def read_state(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Checked values from :meth:`state_dict` or torch's GradScaler's (which lacks hysteresis, min/max:
        those stay as they are); changes nothing.

        Raises:
            TypeError, ValueError: naming the missing or bad key.
        """
        values = super().read_state(state_dict)
        hysteresis = optional(state_dict, "hysteresis", self.hysteresis, check_count)
        interval = optional(
            state_dict, "underflow_check_interval", self.underflow_check_interval, check_count
        )
        values.update(
            growth_factor=required(state_dict, "growth_factor", check_growth_factor),
            backoff_factor=required(state_dict, "backoff_factor", check_backoff_factor),
            growth_interval=required(state_dict, "growth_interval", check_count),
            growth_tracker=required(state_dict, "_growth_tracker", check_count, 0),
            hysteresis=hysteresis,
            hysteresis_left=optional(state_dict, "_hysteresis_tracker", hysteresis, check_count, 0),
            min_scale=optional(state_dict, "min_scale", self.min_scale, _check_bound),
            max_scale=optional(state_dict, "max_scale", self.max_scale, _check_bound),
            underflow_restart=optional(state_dict, "underflow_restart", self.underflow_restart, check_flag),
            underflow_check_interval=interval,
            underflow_check_tracker=optional(state_dict, "_underflow_check_tracker", 0, check_count, 0),
            raise_at_min_scale=optional(
                state_dict, "raise_at_min_scale", self.raise_at_min_scale, check_flag
            ),
        )
        if values["hysteresis_left"] > hysteresis:
            raise ValueError(
                f"state_dict['_hysteresis_tracker'] ({values['hysteresis_left']}) must be <= hysteresis "
                f"({hysteresis})"
            )
        if values["underflow_check_tracker"] >= interval:
            raise ValueError(
                f"state_dict['_underflow_check_tracker'] ({values['underflow_check_tracker']}) must be < "
                f"underflow_check_interval ({interval})"
            )
        _check_bounds(values["min_scale"], values["max_scale"], None)
        return values

    def _apply_state(self, values: dict[str, Any]) -> None:
        super()._apply_state(values)
        self._growth_factor = values["growth_factor"]
        self._backoff_factor = values["backoff_factor"]
        self._growth_interval = values["growth_interval"]
        self.hysteresis = values["hysteresis"]
        self.min_scale, self.max_scale = values["min_scale"], values["max_scale"]
        self._floor_holds = values["scale"] >= self.floor
        self.raise_at_min_scale = values["raise_at_min_scale"]
        self.underflow_restart = values["underflow_restart"]
        self.underflow_check_interval = values["underflow_check_interval"]
        self._underflow_check_tracker = values["underflow_check_tracker"]
        self._init_growth_tracker = values["growth_tracker"]
        self._init_hysteresis_left = values["hysteresis_left"]
        self._tracker_unchecked = True
        if self._growth_tracker is not None and self._hysteresis_left is not None:
            self._growth_tracker.fill_(self._init_growth_tracker)
            self._hysteresis_left.fill_(self._init_hysteresis_left)


def _check_bounds(min_scale: float | None, max_scale: float | None, init_scale: float | None) -> None:
    """``min_scale <= max_scale`` and, when given, ``init_scale`` between them (None: no bound)."""
    low = FLOAT32_TINY if min_scale is None else min_scale
    high = math.inf if max_scale is None else max_scale
    if low > high:
        raise ValueError(f"min_scale ({min_scale}) must be <= max_scale ({max_scale})")
    if init_scale is not None and not low <= init_scale <= high:
        raise ValueError(f"init_scale {init_scale} is outside [min_scale, max_scale] = [{low}, {high}]")


# -- torch's scale update, and the same rule as tensor ops where its kernel is missing ----------------

# Device types where torch's ``_amp_update_scale_`` has no kernel (found at the first call): the same rule
# then runs as tensor ops, which give the same bits (tests/scaling/test_devices.py).
_WITHOUT_UPDATE_OP: set[str] = set()


def update_scale_(
    scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    found_inf: torch.Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
) -> None:
    """torch.amp.GradScaler's update, in place and without a host sync: torch's own dispatcher op.

    ``scale`` (float32, 0-dim) and ``growth_tracker`` (int32, 0-dim) on one device; ``found_inf`` (float32,
    0-dim) non-zero when a step overflowed::

        if found_inf:  scale *= backoff_factor;  growth_tracker = 0
        elif growth_tracker + 1 == growth_interval:
            growth_tracker = 0
            if isfinite(scale * growth_factor):  scale *= growth_factor
        else:  growth_tracker += 1

    Each product is computed in float64 and rounded once to float32, as in torch's kernels.
    """
    args = (scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval)
    if scale.device.type not in _WITHOUT_UPDATE_OP:
        try:
            torch._amp_update_scale_(*args)
            return
        except NotImplementedError:
            _WITHOUT_UPDATE_OP.add(scale.device.type)
    update_scale_with_tensor_ops_(*args)


def update_scale_with_tensor_ops_(
    scale: torch.Tensor,
    tracker: torch.Tensor,
    found_inf: torch.Tensor,
    growth: float,
    backoff: float,
    interval: int,
) -> None:
    """:func:`update_scale_` written with public tensor ops, for devices without torch's kernel."""
    found = found_inf != 0
    successful = (tracker + 1) * ~found
    grow = successful == interval
    grown = times(scale, growth)
    grown = torch.where(torch.isfinite(grown), grown, scale)
    scale.copy_(torch.where(found, times(scale, backoff), torch.where(grow, grown, scale)))
    tracker.copy_(successful.masked_fill_(grow, 0))


def times(scale: torch.Tensor, factor: float) -> torch.Tensor:
    """``scale * factor`` rounded once to float32, as torch's kernel computes it (in float64, then rounded).

    A float32 product of two float32 numbers is already the correctly rounded exact product, so when
    ``factor`` is exact in float32 (2.0, 0.5, ...) the float64 round trip is skipped: same bits, fewer ops.
    """
    if struct.unpack("f", struct.pack("f", factor))[0] == factor:
        return scale * factor
    return (scale.to(wide_float(scale.device)) * factor).float()
