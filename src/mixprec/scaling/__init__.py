"""Loss scaling: scale the loss, unscale and check the gradients, skip non-finite steps, move the scale.

``GradScaler`` is the drop-in for ``torch.amp.GradScaler``; how the scale moves is a small rule object
(``DynamicScale``, ``HeadroomScale``, ``StaticScale``, ``NoScale``).
"""

from mixprec.scaling.dynamic import DynamicScale
from mixprec.scaling.grad_scaler import GradScaler
from mixprec.scaling.headroom import HeadroomScale
from mixprec.scaling.monitor import SkipMonitor
from mixprec.scaling.rules import NoScale, ScaleRule, StaticScale
from mixprec.scaling.state import GradScalerError, OptState

__all__ = [
    "DynamicScale",
    "GradScaler",
    "GradScalerError",
    "HeadroomScale",
    "NoScale",
    "OptState",
    "ScaleRule",
    "SkipMonitor",
    "StaticScale",
]
