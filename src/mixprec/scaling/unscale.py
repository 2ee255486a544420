"""The gradient pass: find non-finite values, measure amax and unscale, without a host sync.

Each gradient is read once for the check and, when unscaling, multiplied in place by ``inv_scale`` (a float32
tensor, so the product rounds exactly as in torch's ``_amp_foreach_non_finite_check_and_unscale_``). The
check happens before the multiply, as in torch: a finite gradient that the multiply pushes to inf (possible
only when the scale is below 1) does not count as an overflow.

A pass that measures no amax runs torch's own one-pass check-and-multiply op (:func:`_torch_op`; a check-only
pass multiplies by 1, as torch's does): it is a dispatcher op with CPU, CUDA and MPS kernels, its results are
torch's bit for bit by construction, and no public op checks and multiplies in one pass, so a public-op pass
costs more than torch's (docs/measured-figures.md, "the gradient pass").
Passes that measure amax (HeadroomScale; the default rule's every-K-th check), and devices or torch builds
without the op, run one of two public-op kernels, chosen per device type as data (``KERNELS``):

- per tensor ``aminmax`` then ``mul_``: on the CPU the tensor is still in cache for the multiply, and
  ``aminmax`` is a fast exact check (nan propagates to both ends, +inf to max, -inf to min).
- ``_foreach_norm(inf)`` then ``_foreach_mul_``: a couple of multi-tensor launches on accelerators.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from mixprec.scaling.grads import GradGroups, collect_grads

__all__ = [
    "DeviceResults",
    "check_and_unscale_",
    "combine_max",
    "foreach_kernel",
    "measure_amax",
    "per_tensor_kernel",
]

Kernel = Callable[[list[torch.Tensor], "torch.Tensor | None"], "torch.Tensor | None"]
DeviceResults = dict[torch.device, torch.Tensor]


def per_tensor_kernel(grads: list[torch.Tensor], inv_scale: torch.Tensor | None) -> torch.Tensor | None:
    """Check-then-multiply one tensor at a time; returns max ``|grad|`` before unscaling (nan if any nan)."""
    lows, highs = [], []
    for grad in grads:
        if grad.numel() == 0:
            continue
        low, high = torch.aminmax(grad)
        lows.append(low)
        highs.append(high)
        if inv_scale is not None:
            grad.mul_(inv_scale)
    if not highs:
        return None
    return torch.maximum(torch.stack(highs).max(), -torch.stack(lows).min())


def foreach_kernel(grads: list[torch.Tensor], inv_scale: torch.Tensor | None) -> torch.Tensor | None:
    """Multi-tensor check then multiply; returns max ``|grad|`` before unscaling (nan if any nan)."""
    grads = [grad for grad in grads if grad.numel() > 0]
    if not grads:
        return None
    norms = torch._foreach_norm(grads, float("inf"))
    if inv_scale is not None:
        torch._foreach_mul_(grads, inv_scale)
    return torch.stack(norms).max()


# The public-op kernel per device type; any type not listed runs the foreach one.
KERNELS: dict[str, Kernel] = {"cpu": per_tensor_kernel}


# torch's one-pass check-and-multiply, where this torch build has it (see the module docstring).
TORCH_FUSED: Callable[..., None] | None = getattr(torch, "_amp_foreach_non_finite_check_and_unscale_", None)


def check_and_unscale_(
    groups: GradGroups,
    inv_scale: torch.Tensor,
    unscale: bool,
    want_amax: bool = True,
) -> tuple[DeviceResults, DeviceResults]:
    """Check every gradient for inf/nan and, if ``unscale``, multiply it in place by ``inv_scale``.

    Args:
        groups: gradients by device and dtype, from :func:`~mixprec.scaling.grads.collect_grads`.
        inv_scale: float32 0-dim tensor, ``1 / scale``.
        unscale: False to only check (fused optimizers unscale inside their own kernel).
        want_amax: measure amax (with ``KERNELS`` for the device type, else the foreach kernel); False runs
            torch's one-pass op where this build and device have it.

    Returns:
        ``(found_inf, amax)`` per device: float32 0-dim tensors, ``found_inf`` 1.0 if any gradient on that
        device was non-finite else 0.0; ``amax`` the largest ``|gradient| * inv_scale`` (non-finite with
        ``found_inf``); ``amax`` is empty when it was not measured.
    """
    if want_amax or TORCH_FUSED is None:
        return _public_ops(groups, inv_scale, unscale)
    # torch's check runs a multiply; a check-only pass multiplies by 1, as torch.amp.GradScaler does
    multiplier = inv_scale if unscale else torch.ones_like(inv_scale)
    found_inf: DeviceResults = {}
    for device, per_dtype in groups.items():
        device_inv = multiplier.to(device, non_blocking=True)
        found = _torch_op(device, per_dtype, device_inv)
        if found is None:  # no kernel for this device type: the public ops give the same values
            found = _public_ops({device: per_dtype}, device_inv, unscale=True)[0][device]
        found_inf[device] = found
    return found_inf, {}


def _public_ops(
    groups: GradGroups, inv_scale: torch.Tensor, unscale: bool
) -> tuple[DeviceResults, DeviceResults]:
    """:func:`check_and_unscale_` with the device type's public-op kernel: found_inf and amax per device."""
    found_inf: DeviceResults = {}
    amax: DeviceResults = {}
    for device, per_dtype in groups.items():
        device_inv = inv_scale.to(device, non_blocking=True)
        run = KERNELS.get(device.type, foreach_kernel)
        results = [run(grads, device_inv if unscale else None) for grads in per_dtype.values()]
        maxima = [m.float() for m in results if m is not None]
        scaled = _max(maxima) if maxima else torch.zeros((), device=device)
        found_inf[device] = (~torch.isfinite(scaled)).float()
        amax[device] = scaled * device_inv
    return found_inf, amax


# Device types without a kernel for torch's check op (found at the first call); their passes run the
# public-op kernels, which give the same found_inf and unscaled values.
_WITHOUT_CHECK_OP: set[str] = set()


def _torch_op(
    device: torch.device, per_dtype: dict[torch.dtype, list[torch.Tensor]], inv_scale: torch.Tensor
) -> torch.Tensor | None:
    """found_inf from torch's ``_amp_foreach_non_finite_check_and_unscale_`` (one call per dtype), or None
    where the device type has no kernel for it."""
    if TORCH_FUSED is None or device.type in _WITHOUT_CHECK_OP:
        return None
    found = torch.zeros((), dtype=torch.float32, device=device)
    try:
        for grads in per_dtype.values():  # the dispatcher refuses before touching any gradient
            TORCH_FUSED(grads, found, inv_scale)
    except NotImplementedError:
        _WITHOUT_CHECK_OP.add(device.type)
        return None
    return found


def measure_amax(params: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The largest ``|gradient|`` of ``params`` (nan if any is nan), a float32 0-dim tensor on ``device``."""
    groups = collect_grads(params, allow_fp16=True)
    _, amax = _public_ops(groups, torch.ones((), device=device), unscale=False)
    return combine_max(amax.values(), device)


def _max(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Largest of 0-dim tensors, nan if any is nan."""
    return tensors[0] if len(tensors) == 1 else torch.stack(tensors).max()


def combine_max(tensors: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The largest of 0-dim tensors from any devices, on ``device`` (nan if any is nan; 0.0 if none)."""
    moved = [t if t.device == device else t.to(device, non_blocking=True) for t in tensors]
    return _max(moved) if moved else torch.zeros((), dtype=torch.float32, device=device)
