"""The gradient pass: find non-finite values, measure amax and unscale, without a host sync.

Each gradient is read once for the check and, when unscaling, multiplied in place by ``inv_scale`` (a float32
tensor, so the product rounds exactly as in torch's ``_amp_foreach_non_finite_check_and_unscale_``). The
check happens before the multiply, as in torch: a finite gradient that the multiply pushes to inf (possible
only when the scale is below 1) does not count as an overflow.

Two kernels give the same results; the choice is per device type, as data:

- per tensor ``aminmax`` then ``mul_``: on the CPU the tensor is still in cache for the multiply, and
  ``aminmax`` is a fast exact check (nan propagates to both ends, +inf to max, -inf to min).
- ``_foreach_norm(inf)`` then ``_foreach_mul_``: a couple of multi-tensor launches on accelerators.

Two passes read every gradient; torch's own ``torch._amp_foreach_non_finite_check_and_unscale_`` (what
torch.amp.GradScaler runs) checks and multiplies in one. Decision: when the rule needs no amax, unscaling
runs that op (:func:`_torch_fused`); the public-op kernels above serve everything else (check-only passes for
fused optimizers, amax for HeadroomScale) and any torch build without it. Why, given the project's rule of
building on torch's public ops and dispatcher: it *is* a dispatcher op (``torch.ops.aten``, with CPU, CUDA
and MPS kernels, which torch.amp and FSDP's ShardedGradScaler call), its results are torch's bit for bit by
construction, and no public op can do a check and a multiply in one pass. Measured on 200 tensors / 8M fp32
values, one CPU thread: the fused op 1.4-1.6 ms; ``aminmax`` alone 1.7-1.9 ms, ``_foreach_max`` 1.6-1.7 ms,
a float64 ``sum`` 9 ms, ``_foreach_norm(1)`` 13 ms, so a public-op unscale stays near 1.7x torch's.
Fused optimizers (``Adam(fused=True)`` & co.) skip the multiply altogether: the scaler only checks and hands
them ``grad_scale``/``found_inf`` (scaling/fused.py).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable

import torch

__all__ = [
    "DeviceResults",
    "check_and_unscale_",
    "collect_grads",
    "combine_max",
    "foreach_kernel",
    "per_tensor_kernel",
]

Kernel = Callable[[list[torch.Tensor], "torch.Tensor | None"], "torch.Tensor | None"]
GradGroups = dict[torch.device, dict[torch.dtype, list[torch.Tensor]]]
DeviceResults = dict[torch.device, torch.Tensor]

FP16_MESSAGE = (
    "Attempting to unscale FP16 gradients. (mixprec: fp16 gradients usually mean fp16 parameters without "
    "fp32 master weights, where the optimizer update itself loses precision; keep the parameters in fp32 or "
    "use mixprec.MixedPrecisionOptimizer, or pass GradScaler(allow_fp16_grads=True) to unscale them anyway.)"
)


def collect_grads(params: Iterable[torch.Tensor], allow_fp16: bool) -> GradGroups:
    """Group the gradients to check by device and dtype; sparse gradients contribute their values, complex
    ones their real and imaginary parts.

    Raises:
        ValueError: for an fp16 (or complex32) gradient unless ``allow_fp16`` (torch's error, same first
            sentence).
        TypeError: for a sparse complex gradient.
    """
    groups: GradGroups = defaultdict(lambda: defaultdict(list))
    for param in params:
        if param.grad is None:
            continue
        if param.grad.is_sparse:
            if param.grad.is_complex():
                raise TypeError(f"complex sparse gradients are not supported (dtype {param.grad.dtype})")
            # Scaled fp16 values with duplicate indices may overflow once summed, so check the sums (torch).
            if param.grad.dtype == torch.float16 and not allow_fp16:
                raise ValueError(FP16_MESSAGE)
            if param.grad.dtype == torch.float16:
                param.grad = param.grad.coalesce()
            grad = param.grad._values()
        else:
            grad = _real_view(_local_shard(param.grad))
        if grad.dtype == torch.float16 and not allow_fp16:
            raise ValueError(FP16_MESSAGE)
        groups[grad.device][grad.dtype].append(grad)
    return groups


def _real_view(grad: torch.Tensor) -> torch.Tensor:
    """A complex gradient as its real and imaginary parts (``view_as_real``: same storage).

    Unscaling a complex number by a real scale unscales both parts, and it is non-finite exactly when a
    part is, so checking and multiplying the view checks and unscales the gradient.
    """
    return torch.view_as_real(grad) if grad.is_complex() else grad


def _local_shard(grad: torch.Tensor) -> torch.Tensor:
    """A DTensor gradient (FSDP2's fully_shard) is checked and unscaled through this rank's shard.

    DTensor ops would run collectives of their own and return a DTensor found_inf; the scaler agrees
    across ranks itself (scaling/sync.py). ``to_local()`` shares storage, so unscaling it in place
    unscales the gradient.
    """
    to_local = getattr(grad, "to_local", None)
    return to_local() if callable(to_local) else grad


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


KERNELS: dict[str, Kernel] = {"cpu": per_tensor_kernel}


# torch's one-pass check-and-multiply, where this torch build has it (see the module docstring).
TORCH_FUSED: Callable[..., None] | None = getattr(torch, "_amp_foreach_non_finite_check_and_unscale_", None)


def check_and_unscale_(
    groups: GradGroups,
    inv_scale: torch.Tensor,
    unscale: bool,
    kernel: Kernel | None = None,
    want_amax: bool = True,
) -> tuple[DeviceResults, DeviceResults]:
    """Check every gradient for inf/nan and, if ``unscale``, multiply it in place by ``inv_scale``.

    Args:
        groups: gradients by device and dtype, from :func:`collect_grads`.
        inv_scale: float32 0-dim tensor, ``1 / scale``.
        unscale: False to only check (fused optimizers unscale inside their own kernel).
        kernel: force one kernel (tests); default: torch's fused pass when unscaling without
            ``want_amax``, else ``KERNELS`` for the device type, else the foreach one.
        want_amax: measure amax; False lets an unscaling pass run torch's fused kernel instead.

    Returns:
        ``(found_inf, amax)`` per device: float32 0-dim tensors, ``found_inf`` 1.0 if any gradient on that
        device was non-finite else 0.0; ``amax`` the largest ``|gradient| * inv_scale`` (non-finite with
        ``found_inf``); ``amax`` is empty when it was not measured.
    """
    if kernel is None and unscale and not want_amax and TORCH_FUSED is not None:
        return _torch_fused(groups, inv_scale), {}
    found_inf: DeviceResults = {}
    amax: DeviceResults = {}
    for device, per_dtype in groups.items():
        device_inv = inv_scale.to(device, non_blocking=True)
        run = kernel or KERNELS.get(device.type, foreach_kernel)
        maxima = [run(grads, device_inv if unscale else None) for grads in per_dtype.values()]
        maxima = [m.float() for m in maxima if m is not None]
        scaled = _max(maxima) if maxima else torch.zeros((), device=device)
        found_inf[device] = (~torch.isfinite(scaled)).float()
        amax[device] = scaled * device_inv
    return found_inf, amax


def _torch_fused(groups: GradGroups, inv_scale: torch.Tensor) -> DeviceResults:
    """torch's ``_amp_foreach_non_finite_check_and_unscale_``, one call per device and dtype."""
    assert TORCH_FUSED is not None
    found_inf: DeviceResults = {}
    for device, per_dtype in groups.items():
        device_inv = inv_scale.to(device, non_blocking=True)
        found = torch.zeros((), dtype=torch.float32, device=device)
        for grads in per_dtype.values():
            TORCH_FUSED(grads, found, device_inv)
        found_inf[device] = found
    return found_inf


def _max(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Largest of 0-dim tensors, nan if any is nan."""
    return tensors[0] if len(tensors) == 1 else torch.stack(tensors).max()


def combine_max(tensors: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The largest of 0-dim tensors from any devices, on ``device`` (nan if any is nan; 0.0 if none)."""
    moved = [tensor.to(device, non_blocking=True) for tensor in tensors]
    return _max(moved) if moved else torch.zeros((), dtype=torch.float32, device=device)
