"""Loss-scale update rules: small objects that own the scale and decide how it moves.

A rule keeps the scale (and whatever counters its algorithm needs) as 0-dim tensors, created on the device of
the first tensor scaled, and changes them with tensor ops only, so that :meth:`ScaleRule.update` never waits
for the device. :class:`~mixprec.scaling.GradScaler` drives a rule; the rules know nothing about optimizers.

- :class:`~mixprec.scaling.dynamic.DynamicScale`: torch's rule (back off on overflow, grow after
  ``growth_interval`` good steps), plus hysteresis, a floor and a cap.
- :class:`~mixprec.scaling.headroom.HeadroomScale`: DynamicScale that also grows as soon as the gradients
  show room for it.
- :class:`StaticScale`: a fixed scale (apex ``loss_scale=128``).
- :class:`NoScale`: scale 1; the scaler still checks gradients and skips non-finite steps.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

__all__ = ["NoScale", "ScaleRule", "StaticScale", "check_count", "check_positive"]


def check_positive(name: str, value: Any) -> float:
    """``float(value)`` if it is a finite number > 0; otherwise a ValueError naming it."""
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not is_number or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def check_count(name: str, value: Any, minimum: int = 1) -> int:
    """``value`` if it is an int >= minimum; otherwise a ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


class ScaleRule:
    """Base rule: a scale that ``update()`` leaves alone.

    Args:
        init_scale: the scale before the first update; a finite number > 0.

    Attributes:
        needs_amax: whether :meth:`update` reads ``amax`` (the scaler computes it in the same pass anyway).
        is_identity: whether the scale is always exactly 1, so unscaling can skip the multiply.
    """

    needs_amax: ClassVar[bool] = False
    is_identity: ClassVar[bool] = False

    def __init__(self, init_scale: float) -> None:
        self.init_scale = check_positive("init_scale", init_scale)
        self._scale: torch.Tensor | None = None

    @property
    def name(self) -> str:
        """The rule's class name, saved in state_dict() to refuse loading into a different rule."""
        return type(self).__name__

    @property
    def scale(self) -> torch.Tensor | None:
        """The scale as a float32 0-dim tensor, or None before the first :meth:`ensure_state`."""
        return self._scale

    def ensure_state(self, device: torch.device) -> torch.Tensor:
        """Create the state tensors on ``device`` if they do not exist yet; return the scale tensor."""
        if self._scale is None:
            self._create_state(device)
        assert self._scale is not None
        return self._scale

    def _create_state(self, device: torch.device) -> None:
        self._scale = torch.full((), self.init_scale, dtype=torch.float32, device=device)

    def get_scale(self) -> float:
        """The scale as a Python float (a host sync once the tensor exists)."""
        return self.init_scale if self._scale is None else float(self._scale.item())

    def set_scale(self, new_scale: float | torch.Tensor) -> None:
        """Overwrite the scale: a finite float > 0, or a 1-element tensor (copied, not checked: no sync)."""
        if isinstance(new_scale, torch.Tensor):
            self.ensure_state(new_scale.device).copy_(new_scale.reshape(()))
            return
        value = check_positive("new_scale", new_scale)
        if self._scale is None:
            self.init_scale = value
        else:
            self._scale.fill_(value)

    def update(self, found_inf: torch.Tensor, amax: torch.Tensor | None = None) -> None:
        """Move the scale after an iteration.

        Args:
            found_inf: float32 0-dim tensor on the scale's device, > 0 if any gradient was non-finite.
            amax: float32 0-dim tensor, the largest ``|gradient|`` after unscaling (non-finite when
                ``found_inf``); only rules with ``needs_amax`` read it.
        """

    def after_skip(self) -> None:
        """Hook the scaler calls when it already knows, on the host, that a step was skipped."""

    def state_dict(self) -> dict[str, Any]:
        """The rule's configuration and state as plain Python values."""
        return {"rule": self.name, "scale": self.get_scale()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict` (or from torch's GradScaler keys, for DynamicScale).

        Raises:
            ValueError: when the dict was saved from a different kind of rule.
        """
        saved = state_dict.get("rule", self.name)  # torch's GradScaler saves no rule name
        if saved not in {cls.__name__ for cls in type(self).__mro__}:
            raise ValueError(f"state_dict was saved from a {saved} rule; this scaler uses {self.name}")
        self.set_scale(check_positive("state_dict['scale']", state_dict["scale"]))


class StaticScale(ScaleRule):
    """A fixed loss scale, as apex's ``loss_scale=128``. Non-finite steps are still skipped.

    Args:
        scale: the scale; a finite number > 0 (powers of two keep unscaling exact).
    """

    def __init__(self, scale: float) -> None:
        super().__init__(scale)


class NoScale(StaticScale):
    """No scaling (scale 1). The scaler still detects non-finite gradients and skips those steps."""

    is_identity: ClassVar[bool] = True

    def __init__(self) -> None:
        super().__init__(1.0)

    def set_scale(self, new_scale: float | torch.Tensor) -> None:
        if isinstance(new_scale, torch.Tensor) or new_scale != 1:
            raise ValueError(f"NoScale keeps the scale at 1, got new_scale={new_scale!r}; use StaticScale")
