"""HeadroomScale: grow the loss scale as soon as the gradients show room for it."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from mixprec import formats
from mixprec.scaling.devices import wide_float
from mixprec.scaling.dynamic import DynamicScale
from mixprec.scaling.rules import DEFAULTS, FLOAT32_MAX, check_positive, optional

__all__ = ["HeadroomScale"]


class HeadroomScale(DynamicScale):
    """DynamicScale that also jumps up to the largest scale the gradients leave room for.

    The interval rule needs ``growth_interval`` good steps per doubling, so a run whose gradients are tiny
    spends thousands of steps underflowing before the scale catches up. The scaler already reads every
    gradient for the inf/nan check; the same pass yields ``amax``, the largest ``|gradient|`` after
    unscaling, and from it this rule sees how far the scale can rise. Once per ``update()``, on the device::

        before = scale
        <DynamicScale's update>                          # back-off, hysteresis, interval growth
        if not found_inf and 0 < amax < inf:
            # most growth steps k that keep the scaled gradients under the format's max with room to spare
            k = floor(log_growth(format.max / (margin * amax * before)))
            k = min(k, steps that stay below overflow_scale and max_scale)
            if before * growth_factor**k > scale:
                scale = before * growth_factor**k;  growth_tracker = 0;  hysteresis_left = hysteresis
        if found_inf:
            overflow_scale = before                      # never jump back to where it overflowed
        elif <interval growth happened>:
            overflow_scale = inf                         # the slow probe moved past it: lift the ceiling

    Overflow still backs off exactly as in DynamicScale. The margin covers activation gradients, which can
    be larger than the parameter gradients the check sees.

    Args:
        init_scale: starting scale.
        growth_factor: factor > 1 for growth, interval and headroom alike.
        backoff_factor: factor in (0, 1) applied on overflow.
        growth_interval: good steps in a row before an interval growth.
        format: the format the scaled gradients must fit (the backward's dtype): a
            :class:`mixprec.formats.Format`, dtype or name. Default fp16.
        margin: keep ``amax * scale * margin <= format.max``; >= 1. Default 32 (five doublings spare).
        **dynamic: ``hysteresis``, ``min_scale``, ``max_scale``, ``underflow_restart``, ``raise_at_min_scale``
            as in DynamicScale.

    Raises:
        ValueError: for a bad argument, naming it.
    """

    amax_use = "every_step"  # type: ignore[assignment]
    growth: ClassVar[str | None] = "headroom"

    def __init__(
        self,
        init_scale: float = DEFAULTS.init_scale,
        growth_factor: float = DEFAULTS.growth_factor,
        backoff_factor: float = DEFAULTS.backoff_factor,
        growth_interval: int = DEFAULTS.growth_interval,
        *,
        format: formats.Format | torch.dtype | str = "fp16",
        margin: float = 32.0,
        **dynamic: Any,
    ) -> None:
        super().__init__(init_scale, growth_factor, backoff_factor, growth_interval, **dynamic)
        self.format = _check_format("format", format)
        self.margin = _check_margin("margin", margin)
        self._overflow_scale: torch.Tensor | None = None
        self._init_overflow_scale = math.inf

    def _create_state(self, device: torch.device) -> None:
        super()._create_state(device)
        self._overflow_scale = torch.full((), self._init_overflow_scale, dtype=torch.float32, device=device)

    def update(self, found_inf: torch.Tensor, amax: torch.Tensor | None = None) -> None:
        if amax is None:
            raise ValueError("HeadroomScale.update() needs amax, the largest |unscaled gradient|")
        scale, ceiling = self._require_state(), self._overflow_scale
        assert ceiling is not None and self._growth_tracker is not None and self._hysteresis_left is not None
        before = scale.clone()
        super().update(found_inf, amax)  # back-off, hysteresis, interval growth, floor, cap, restart
        found = found_inf > 0
        grew = ~found & (self._growth_tracker == 0)  # the tracker restarts on a clean step only by growing
        candidate = self._room(before, amax.to(before.device), ceiling)
        jump = ~found & (candidate > scale)
        scale.copy_(torch.where(jump, candidate, scale))
        self._growth_tracker.masked_fill_(jump, 0)
        self._hysteresis_left.masked_fill_(jump, self.hysteresis)
        ceiling.copy_(torch.where(found, before, ceiling.masked_fill(grew, math.inf)))

    def _room(self, scale: torch.Tensor, amax: torch.Tensor, ceiling: torch.Tensor) -> torch.Tensor:
        """``scale * growth_factor**k`` for the largest k >= 0 that the headroom and the caps allow."""
        wide = wide_float(scale.device)
        scale_w, amax_w = scale.to(wide), amax.to(wide)
        log_growth = math.log2(self.growth_factor)
        fits = torch.floor(torch.log2(self.format.max / (self.margin * amax_w * scale_w)) / log_growth)
        cap = torch.clamp_max(ceiling.to(wide) / self.growth_factor, self._cap())
        below_cap = torch.floor(torch.log2(cap / scale_w) / log_growth)
        known = torch.isfinite(amax_w) & (amax_w > 0)
        steps = torch.where(known, torch.minimum(fits, below_cap), 0.0).clamp_min(0.0)
        candidate = scale_w * torch.pow(self.growth_factor, steps)
        # log2 rounding can overshoot by one step at exact powers: take it back where it does
        over = (candidate * amax_w * self.margin > self.format.max) | (candidate > cap)
        candidate = torch.where(over & (steps > 0), candidate / self.growth_factor, candidate)
        return candidate.float()

    def _cap(self) -> float:
        return min(FLOAT32_MAX, math.inf if self.max_scale is None else self.max_scale)

    def state_dict(self) -> dict[str, Any]:
        overflow = self._init_overflow_scale if self._overflow_scale is None else self._overflow_scale.item()
        return {
            **super().state_dict(),
            "headroom_format": self.format.name,
            "headroom_margin": self.margin,
            "_overflow_scale": float(overflow),
        }

    def read_state(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        values = super().read_state(state_dict)
        values.update(
            format=optional(state_dict, "headroom_format", self.format, _check_format),
            margin=optional(state_dict, "headroom_margin", self.margin, _check_margin),
            overflow_scale=optional(state_dict, "_overflow_scale", math.inf, _check_overflow_scale),
        )
        return values

    def _apply_state(self, values: dict[str, Any]) -> None:
        super()._apply_state(values)
        self.format, self.margin = values["format"], values["margin"]
        self._init_overflow_scale = values["overflow_scale"]
        if self._overflow_scale is not None:
            self._overflow_scale.fill_(self._init_overflow_scale)


def _check_format(name: str, value: Any) -> formats.Format:
    try:
        return formats.get(value)
    except (TypeError, ValueError) as error:
        raise type(error)(f"{name}: {error}") from error


def _check_margin(name: str, value: Any) -> float:
    if check_positive(name, value) < 1:
        raise ValueError(f"{name} must be >= 1, got {value!r}")
    return float(value)


def _check_overflow_scale(name: str, value: Any) -> float:
    if value == math.inf:
        return math.inf
    return check_positive(name, value)
