"""Loss scaling: scale the loss, unscale and check the gradients, skip non-finite steps, move the loss scale.

This package is about the *loss* scale only; the per-block scales of low-bit formats are
:mod:`mixprec.lowbit`'s. ``GradScaler`` (grad_scaler.py) is the drop-in for ``torch.amp.GradScaler``, its
state machine read in call order; how the loss scale moves is a small rule object (rules.py:
``StaticScale``, ``NoScale``; dynamic.py: ``DynamicScale``, with torch's update op; headroom.py:
``HeadroomScale``); ``resolve_scaler`` (spec.py) is the one place a ``loss_scale=`` value (None, "dynamic",
a number, a ready scaler) becomes a scaler, for every entry point that takes one; the gradients a pass reads
in grads.py, the check-and-unscale pass in unscale.py, torch.optim's fused-optimizer hand-off in fused.py,
device facts in devices.py; rank agreement and the skip count in skip.py.
"""

from mixprec.scaling.dynamic import DynamicScale
from mixprec.scaling.grad_scaler import GradScaler, GradScalerError, OptState
from mixprec.scaling.headroom import HeadroomScale
from mixprec.scaling.rules import NoScale, ScaleRule, StaticScale
from mixprec.scaling.skip import SkipMonitor
from mixprec.scaling.spec import resolve_scaler

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
    "resolve_scaler",
]
