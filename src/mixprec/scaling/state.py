"""The per-optimizer state machine of one iteration, and the error its misuse raises."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

__all__ = ["GradScalerError", "OptState", "OptimizerRecord"]


class GradScalerError(RuntimeError, AssertionError):
    """Misuse of the scale/unscale_/step/update sequence.

    A RuntimeError, and also an AssertionError because torch raises AssertionError for some of these
    (no scale() before step, no inf checks before update), so code written against torch still catches them.
    """


class OptState(Enum):
    """Where one optimizer is within the current iteration."""

    READY = 0  # nothing done since the last update()
    UNSCALED = 1  # unscale_() ran: gradients are unscaled and checked
    STEPPED = 2  # step() ran (or skipped); only update() may follow


@dataclass
class OptimizerRecord:
    """What the scaler knows about one optimizer in the current iteration (kept in the scaler, not on it)."""

    stage: OptState = OptState.READY
    found_inf: dict[torch.device, torch.Tensor] = field(default_factory=dict)
    amax: dict[torch.device, torch.Tensor] = field(default_factory=dict)
