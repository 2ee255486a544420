"""What the scaler needs to know about device types, kept as data rather than branches."""

from __future__ import annotations

import torch

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


def is_available(device_type: str) -> bool:
    """Whether ``device_type`` is usable here: ``torch.<type>.is_available()`` where that exists."""
    backend = getattr(torch, device_type, None)
    probe = getattr(backend, "is_available", None)
    return bool(probe()) if callable(probe) else True
