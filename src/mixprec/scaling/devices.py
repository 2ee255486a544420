"""Device facts as data: which backends lack float64, which device string is valid, which missing backend
disables a scaler. Kept as tables, not ``if device ==`` branches, so a new device type is one entry."""

from __future__ import annotations

import warnings

import torch

__all__ = ["parse_device", "warn_if_unavailable", "wide_float"]

# Device types whose backends have no float64. Everywhere else the scale arithmetic is done in float64 and
# rounded once to float32, which is what torch's own kernels do, so the scale matches torch bit for bit.
_WITHOUT_FLOAT64: frozenset[str] = frozenset({"mps"})


def wide_float(device: torch.device) -> torch.dtype:
    """The widest float dtype the device computes in: float64, or float32 where float64 is missing."""
    return torch.float32 if device.type in _WITHOUT_FLOAT64 else torch.float64


def parse_device(device: str | torch.device) -> torch.device:
    """``torch.device(device)``, with a ValueError that names the bad value.

    Raises:
        ValueError: when torch cannot parse ``device``.
    """
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(
            f"device must be a torch device such as 'cpu' or 'cuda:0', got {device!r}"
        ) from error


# Device types whose scaler torch disables, with a warning, when the backend is missing: cuda, GradScaler's
# default device, where code written for a GPU runs on a machine without one. Every other type (mps, xpu,
# hpu, xla, a PrivateUse1 backend) stays enabled, as in torch: the scale lives where the tensors are.
_DISABLED_WITHOUT_BACKEND: frozenset[str] = frozenset({"cuda"})


def warn_if_unavailable(device: torch.device | None, stacklevel: int) -> bool:
    """True, after a warning naming ``device``, when a scaler for it must be disabled (torch's rule)."""
    if device is None or device.type not in _DISABLED_WITHOUT_BACKEND:
        return False
    if getattr(torch, device.type).is_available():
        return False
    warnings.warn(
        f"mixprec.GradScaler is enabled for device {str(device)!r}, but {device.type} is not "
        "available. Disabling: scale() returns its input and step() calls optimizer.step().",
        stacklevel=stacklevel + 1,
    )
    return True
