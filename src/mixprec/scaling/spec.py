"""The loss-scale spec: the one place a ``loss_scale=`` value becomes a loss scaler.

Every entry point that takes a loss scale by value hands it here: :func:`mixprec.initialize`'s
``loss_scale=``, :class:`~mixprec.MixedPrecisionOptimizer`'s ``scaler=`` and, after translating apex's
spellings, :mod:`mixprec.apex`'s ``amp.initialize(loss_scale=)`` and ``FP16_Optimizer(static_loss_scale=)``.
So they accept the same specs and refuse the rest with the same message.
"""

from __future__ import annotations

import math
from typing import Any

from mixprec.scaling.grad_scaler import GradScaler
from mixprec.scaling.rules import NoScale, StaticScale

__all__ = ["ACCEPTED_LOSS_SCALES", "resolve_scaler"]

#: What a loss-scale spec may be, as every refusal says it.
ACCEPTED_LOSS_SCALES = (
    "None (no loss scaling), 'dynamic', a positive finite number (static scale) or a GradScaler"
)

_SCALER_METHODS = ("scale", "unscale_", "step", "update", "get_scale", "state_dict", "load_state_dict")


def resolve_scaler(
    spec: Any, device_type: str, *, min_scale: float | None = None, max_scale: float | None = None
) -> Any:
    """Turn a loss-scale spec into a loss scaler with ``torch.amp.GradScaler``'s API.

    Args:
        spec: None (no loss scaling, no skipping: a disabled scaler), ``"dynamic"`` (mixprec's GradScaler,
            starting at 2**16 clamped into the bounds), a positive finite number (a static scale: it never
            changes, but a step with inf/nan gradients is still skipped; at 1 fp16 gradients are accepted, as
            unscaling is a no-op) or a ready loss scaler (any object with GradScaler's methods, such as
            ``torch.amp.GradScaler``), returned as is.
        device_type: where the scale tensor lives ("cuda", "cpu", ...).
        min_scale: lower bound of a dynamic scale.
        max_scale: upper bound of a dynamic scale.

    Returns:
        A :class:`~mixprec.GradScaler` (disabled for None), or ``spec`` itself when it is a ready scaler.

    Raises:
        ValueError: for any other spec (``"loss_scale: unknown loss scale ...; accepted: ..."``, listing
            :data:`~mixprec.scaling.spec.ACCEPTED_LOSS_SCALES`), or bounds given with a spec they do not
            apply to.
    """
    if all(callable(getattr(spec, name, None)) for name in _SCALER_METHODS):
        _no_bounds(min_scale, max_scale, "a ready GradScaler (configure it directly)")
        return spec
    if spec is None:
        _no_bounds(min_scale, max_scale, "loss_scale=None")
        return GradScaler(device_type, enabled=False)
    if isinstance(spec, str) and spec == "dynamic":
        init_scale = min(max(2.0**16, min_scale or 0.0), max_scale or math.inf)
        return GradScaler(device_type, init_scale, min_scale=min_scale, max_scale=max_scale)
    if isinstance(spec, (int, float)) and not isinstance(spec, bool) and math.isfinite(spec) and spec > 0:
        _no_bounds(min_scale, max_scale, f"a static loss_scale ({spec})")
        if spec == 1:
            return GradScaler(device_type, rule=NoScale(), allow_fp16_grads=True)
        return GradScaler(device_type, rule=StaticScale(float(spec)))
    raise ValueError(f"loss_scale: unknown loss scale {spec!r}; accepted: {ACCEPTED_LOSS_SCALES}")


def _no_bounds(min_scale: float | None, max_scale: float | None, what: str) -> None:
    if min_scale is not None or max_scale is not None:
        raise ValueError(
            f"min/max loss scale ({min_scale}, {max_scale}) apply to 'dynamic' scaling only, not to {what}"
        )
