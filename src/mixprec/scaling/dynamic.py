"""DynamicScale: torch's dynamic loss scale, with hysteresis, a floor and a cap."""

from __future__ import annotations

import math
import struct
from typing import Any

import torch

from mixprec.scaling._devices import wide_float
from mixprec.scaling.rules import ScaleRule, check_count, check_positive

__all__ = ["FLOAT32_TINY", "DynamicScale"]

FLOAT32_TINY = torch.finfo(torch.float32).tiny  # default floor: positive, and 1/floor is still finite


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

    With ``hysteresis=1``, ``min_scale=None`` and ``max_scale=None`` this is torch's rule, except that the
    scale stops at the smallest normal float32 instead of collapsing to 0 after ~160 overflows in a row, and
    that growth happens at ``>=`` rather than ``==`` growth_interval (torch never grows again if the interval
    is lowered below the current tracker). With ``hysteresis=1`` the counter is not kept: every overflow backs
    off.

    Args:
        init_scale: starting scale.
        growth_factor: factor > 1 applied after ``growth_interval`` good steps in a row.
        backoff_factor: factor in (0, 1) applied on overflow.
        growth_interval: good steps in a row before growing, >= 1.
        hysteresis: overflows tolerated before backing off (Megatron/DeepSpeed meaning), >= 1. Every
            overflow still skips its step.
        min_scale: floor; None means the smallest normal float32.
        max_scale: cap; None means none (growth still stops short of inf).
        raise_at_min_scale: raise RuntimeError when a skipped step would back off from the floor
            (checked when the scaler has already synced for the skip decision, so never on fused steps).

    Raises:
        ValueError: for any argument outside the ranges above, or ``min_scale > max_scale``, or
            ``init_scale`` outside ``[min_scale, max_scale]``.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        *,
        hysteresis: int = 1,
        min_scale: float | None = None,
        max_scale: float | None = None,
        raise_at_min_scale: bool = False,
    ) -> None:
        super().__init__(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.hysteresis = check_count("hysteresis", hysteresis)
        self.min_scale = None if min_scale is None else check_positive("min_scale", min_scale)
        self.max_scale = None if max_scale is None else check_positive("max_scale", max_scale)
        self.raise_at_min_scale = bool(raise_at_min_scale)
        self._check_bounds(self.init_scale)
        self._growth_tracker: torch.Tensor | None = None
        self._hysteresis_left: torch.Tensor | None = None
        self._init_growth_tracker = 0
        self._init_hysteresis_left = self.hysteresis

    # Validated attributes: the GradScaler's set_growth_factor() & co. write through these.
    @property
    def growth_factor(self) -> float:
        """Factor > 1 applied on growth."""
        return self._growth_factor

    @growth_factor.setter
    def growth_factor(self, value: float) -> None:
        if check_positive("growth_factor", value) <= 1:
            raise ValueError(f"growth_factor must be > 1, got {value!r}")
        self._growth_factor = float(value)

    @property
    def backoff_factor(self) -> float:
        """Factor in (0, 1) applied on back-off."""
        return self._backoff_factor

    @backoff_factor.setter
    def backoff_factor(self, value: float) -> None:
        if check_positive("backoff_factor", value) >= 1:
            raise ValueError(f"backoff_factor must be in (0, 1), got {value!r}")
        self._backoff_factor = float(value)

    @property
    def growth_interval(self) -> int:
        """Good steps in a row before growing."""
        return self._growth_interval

    @growth_interval.setter
    def growth_interval(self, value: int) -> None:
        self._growth_interval = check_count("growth_interval", value)

    @property
    def floor(self) -> float:
        """The effective minimum scale."""
        return FLOAT32_TINY if self.min_scale is None else self.min_scale

    def _check_bounds(self, init_scale: float) -> None:
        low, high = self.floor, math.inf if self.max_scale is None else self.max_scale
        if low > high:
            raise ValueError(f"min_scale ({self.min_scale}) must be <= max_scale ({self.max_scale})")
        if not low <= init_scale <= high:
            raise ValueError(f"init_scale {init_scale} is outside [min_scale, max_scale] = [{low}, {high}]")

    def _create_state(self, device: torch.device) -> None:
        super()._create_state(device)
        self._growth_tracker = torch.full((), self._init_growth_tracker, dtype=torch.int32, device=device)
        self._hysteresis_left = torch.full((), self._init_hysteresis_left, dtype=torch.int32, device=device)

    def update(self, found_inf: torch.Tensor, amax: torch.Tensor | None = None) -> None:
        scale = self._require_state()
        found = found_inf > 0
        grow, back_off = self._advance_counters(found)
        scale.copy_(self._next_scale(scale, grow, back_off))

    def _require_state(self) -> torch.Tensor:
        if self._scale is None:
            raise RuntimeError(f"{self.name}.update() called before the scale exists (no tensor was scaled)")
        return self._scale

    def _advance_counters(self, found: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Step growth_tracker and hysteresis_left; return the (grow, back_off) decisions as bool tensors."""
        tracker, left = self._growth_tracker, self._hysteresis_left
        assert tracker is not None and left is not None
        next_tracker = (tracker + 1) * ~found
        grow = next_tracker >= self.growth_interval
        tracker.copy_(next_tracker.masked_fill_(grow, 0))
        if self.hysteresis == 1:  # torch's rule: every overflow backs off (fewer tiny ops per update)
            return grow, found
        left_after = (left - found.int()).clamp_min_(0)
        back_off = found & (left_after == 0)
        left.copy_(left_after.masked_fill_(grow, self.hysteresis))
        return grow, back_off

    def _next_scale(self, scale: torch.Tensor, grow: torch.Tensor, back_off: torch.Tensor) -> torch.Tensor:
        grown = _times(scale, self.growth_factor)
        grown = torch.where(torch.isfinite(grown), grown, scale)
        if self.max_scale is not None:
            grown = grown.clamp_max(self.max_scale)
        backed_off = _times(scale, self.backoff_factor).clamp_min_(self.floor)
        return torch.where(back_off, backed_off, torch.where(grow, grown, scale))

    def after_skip(self) -> None:
        if not self.raise_at_min_scale or self._scale is None or self._hysteresis_left is None:
            return
        if self._hysteresis_left.item() <= 1 and self._scale.item() <= self.floor:
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
            "raise_at_min_scale": self.raise_at_min_scale,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore, including from torch's GradScaler (whose keys lack hysteresis/min/max: those stay)."""
        super().load_state_dict(state_dict)
        self.growth_factor = state_dict["growth_factor"]
        self.backoff_factor = state_dict["backoff_factor"]
        self.growth_interval = state_dict["growth_interval"]
        self.hysteresis = check_count("hysteresis", state_dict.get("hysteresis", self.hysteresis))
        min_scale = state_dict.get("min_scale", self.min_scale)
        max_scale = state_dict.get("max_scale", self.max_scale)
        self.min_scale = None if min_scale is None else check_positive("min_scale", min_scale)
        self.max_scale = None if max_scale is None else check_positive("max_scale", max_scale)
        self._check_bounds(self.floor)
        self.raise_at_min_scale = bool(state_dict.get("raise_at_min_scale", self.raise_at_min_scale))
        self._init_growth_tracker = int(state_dict["_growth_tracker"])
        self._init_hysteresis_left = int(state_dict.get("_hysteresis_tracker", self.hysteresis))
        if self._growth_tracker is not None and self._hysteresis_left is not None:
            self._growth_tracker.fill_(self._init_growth_tracker)
            self._hysteresis_left.fill_(self._init_hysteresis_left)


def _times(scale: torch.Tensor, factor: float) -> torch.Tensor:
    """``scale * factor`` rounded once to float32, as torch's kernel computes it (in float64, then rounded).

    A float32 product of two float32 numbers is already the correctly rounded exact product, so when
    ``factor`` is exact in float32 (2.0, 0.5, ...) the float64 round trip is skipped: same bits, fewer ops.
    """
    if struct.unpack("f", struct.pack("f", factor))[0] == factor:
        return scale * factor
    return (scale.to(wide_float(scale.device)) * factor).float()
