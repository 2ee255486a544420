"""Bitwise comparison for the kernel tests of the fake-CUDA tier."""

from __future__ import annotations

import torch

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bits, a nan anywhere equal to a nan (its payload and sign aside)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    nan_a, nan_b = torch.isnan(a.float()), torch.isnan(b.float())
    bits = _BITS[a.element_size()]
    return torch.equal(nan_a, nan_b) and torch.equal(a.view(bits)[~nan_a], b.view(bits)[~nan_b])
