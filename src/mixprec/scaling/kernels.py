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
torch.amp.GradScaler runs) checks and multiplies in one. Decision: a pass that measures no amax runs that op
(:func:`_torch_fused`; a check-only pass multiplies by 1, as torch's does); the public-op kernels above serve
the passes that measure amax (HeadroomScale; the default rule's every-K-th fused check) and devices or
torch builds without the op. Why, given the project's rule of building on public ops: it *is* a dispatcher
op (``torch.ops.aten``, with CPU, CUDA and MPS kernels, which torch.amp and FSDP's ShardedGradScaler call),
its results are torch's bit for bit by construction, and no public op can check and multiply in one pass.
On 200 tensors / 8M fp32 values, one CPU thread: the fused op 1.4-1.6 ms; ``aminmax`` alone 1.7-1.9 ms,
``_foreach_max`` 1.6-1.7 ms, a float64 ``sum`` 9 ms, ``_foreach_norm(1)`` 13 ms (``inf``: 22 ms), so a
public-op unscale stays near 1.7x torch's. Fused optimizers (``Adam(fused=True)`` & co.) skip the multiply:
the scaler only checks and hands them ``grad_scale``/``found_inf`` (:func:`run_fused_step`, at the end).

Device types are data here, not branches: which kernel runs where (``KERNELS``), which backends lack float64
(``wide_float``), which missing backend disables a scaler (``warn_if_unavailable``).
"""

from __future__ import annotations

import inspect
import struct
import warnings
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

__all__ = [
    "DeviceResults",
    "check_and_unscale_",
    "check_optimizer",
    "collect_grads",
    "combine_max",
    "foreach_kernel",
    "measure_amax",
    "params_of",
    "parse_device",
    "per_tensor_kernel",
    "run_fused_step",
    "supports_fused_scaling",
    "times",
    "update_scale_",
    "warn_if_unavailable",
    "wide_float",
]

Kernel = Callable[[list[torch.Tensor], "torch.Tensor | None"], "torch.Tensor | None"]
GradGroups = dict[torch.device, dict[torch.dtype, list[torch.Tensor]]]
DeviceResults = dict[torch.device, torch.Tensor]

FP16_MESSAGE = (
    "Attempting to unscale FP16 gradients. (mixprec: fp16 gradients usually mean fp16 parameters without "
    "fp32 master weights, where the optimizer update itself loses precision; keep the parameters in fp32 or "
    "use mixprec.MixedPrecisionOptimizer, or pass GradScaler(allow_fp16_grads=True) to unscale them anyway.)"
)


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


def check_optimizer(optimizer: Any) -> None:
    """TypeError naming ``optimizer`` unless it has ``param_groups``, a list of dicts with "params"."""
    groups = getattr(optimizer, "param_groups", None)
    if not isinstance(groups, list) or not all(isinstance(g, dict) and "params" in g for g in groups):
        raise TypeError(
            "optimizer must be a torch.optim.Optimizer (an object whose param_groups is a list of dicts with "
            f"'params'), got {type(optimizer).__name__}: {optimizer!r:.80}"
        )


def params_of(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """Every parameter of every group of ``optimizer``."""
    return (param for group in optimizer.param_groups for param in group["params"])


def collect_grads(params: Iterable[torch.Tensor], allow_fp16: bool) -> GradGroups:
    """Group the gradients to check by device and dtype; sparse gradients contribute their values, complex
    ones their real and imaginary parts.

    Dense real plain-tensor gradients are grouped by torch.optim's C++ helper
    (``torch._C._group_tensors_by_device_and_dtype``): on a fused step a Python loop asking each gradient
    its device and dtype is most of the scaler's cost. Sparse, complex and subclass (FSDP2's DTensor)
    gradients take the per-gradient loop.

    Raises:
        ValueError: for an fp16 (or complex32) gradient unless ``allow_fp16`` (torch's error, same first
            sentence).
        TypeError: for a sparse complex gradient.
    """
    params = list(params)
    grads = [param.grad for param in params]
    grads = [grad for grad in grads if grad is not None]
    if not grads:
        return {}
    if any(grad.is_sparse or type(grad) is not torch.Tensor for grad in grads):
        return _collect_each(params, allow_fp16)
    grouped = torch._C._group_tensors_by_device_and_dtype([grads], False)
    if any(dtype.is_complex for _, dtype in grouped):
        return _collect_each(params, allow_fp16)
    if not allow_fp16 and any(dtype == torch.float16 for _, dtype in grouped):
        raise ValueError(FP16_MESSAGE)
    groups: GradGroups = defaultdict(dict)
    for (device, dtype), (lists, _) in grouped.items():
        groups[device][dtype] = lists[0]
    return groups


def _collect_each(params: list[torch.Tensor], allow_fp16: bool) -> GradGroups:
    """:func:`collect_grads` one gradient at a time, for sparse, complex and subclass gradients."""
    groups: GradGroups = defaultdict(lambda: defaultdict(list))
    for param in params:
        if param.grad is None:
            continue
        if param.grad.is_sparse:
            if param.grad.is_complex():
                raise TypeError(f"complex sparse gradients are not supported (dtype {param.grad.dtype})")
            if param.grad.dtype == torch.float16 and allow_fp16:  # refused below otherwise
                param.grad = param.grad.coalesce()  # duplicates may overflow once summed: check sums (torch)
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
    across ranks itself (scaling/skip.py). ``to_local()`` shares storage, so unscaling it in place
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
    if kernel is None and not want_amax and TORCH_FUSED is not None:
        # torch's check runs a multiply; a check-only pass multiplies by 1, as torch.amp.GradScaler does
        return _torch_fused(groups, inv_scale if unscale else torch.ones_like(inv_scale)), {}
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


def measure_amax(params: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The largest ``|gradient|`` of ``params`` (nan if any is nan), a float32 0-dim tensor on ``device``."""
    groups = collect_grads(params, allow_fp16=True)
    _, amax = check_and_unscale_(groups, torch.ones((), device=device), False)
    return combine_max(amax.values(), device)


# Device types without a kernel for torch's check op (found at the first call); their passes run the
# public-op kernels, which give the same found_inf and unscaled values.
_WITHOUT_CHECK_OP: set[str] = set()


def _torch_fused(groups: GradGroups, inv_scale: torch.Tensor) -> DeviceResults:
    """torch's ``_amp_foreach_non_finite_check_and_unscale_``, one call per device and dtype."""
    assert TORCH_FUSED is not None
    found_inf: DeviceResults = {}
    for device, per_dtype in groups.items():
        device_inv = inv_scale.to(device, non_blocking=True)
        found = torch.zeros((), dtype=torch.float32, device=device)
        try:
            if device.type in _WITHOUT_CHECK_OP:
                raise NotImplementedError(device.type)
            for grads in per_dtype.values():  # the dispatcher refuses before touching any gradient
                TORCH_FUSED(grads, found, device_inv)
        except NotImplementedError:
            _WITHOUT_CHECK_OP.add(device.type)
            kernel = KERNELS.get(device.type, foreach_kernel)
            found = check_and_unscale_({device: per_dtype}, device_inv, True, kernel)[0][device]
        found_inf[device] = found
    return found_inf


def _max(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Largest of 0-dim tensors, nan if any is nan."""
    return tensors[0] if len(tensors) == 1 else torch.stack(tensors).max()


def combine_max(tensors: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The largest of 0-dim tensors from any devices, on ``device`` (nan if any is nan; 0.0 if none)."""
    moved = [t if t.device == device else t.to(device, non_blocking=True) for t in tensors]
    return _max(moved) if moved else torch.zeros((), dtype=torch.float32, device=device)


# -- the scale update -----------------------------------------------------------------------------------

# Device types where torch's ``_amp_update_scale_`` has no kernel (found at the first call): the same rule
# then runs as tensor ops, which give the same bits (tests/scaling/test_devices.py).
_WITHOUT_UPDATE_OP: set[str] = set()


def update_scale_(
    scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    found_inf: torch.Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
) -> None:
    """torch.amp.GradScaler's update, in place and without a host sync: torch's own dispatcher op.

    ``scale`` (float32, 0-dim) and ``growth_tracker`` (int32, 0-dim) on one device; ``found_inf`` (float32,
    0-dim) non-zero when a step overflowed::

        if found_inf:  scale *= backoff_factor;  growth_tracker = 0
        elif growth_tracker + 1 == growth_interval:
            growth_tracker = 0
            if isfinite(scale * growth_factor):  scale *= growth_factor
        else:  growth_tracker += 1

    Each product is computed in float64 and rounded once to float32, as in torch's kernels.
    """
    args = (scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval)
    if scale.device.type not in _WITHOUT_UPDATE_OP:
        try:
            torch._amp_update_scale_(*args)
            return
        except NotImplementedError:
            _WITHOUT_UPDATE_OP.add(scale.device.type)
    update_scale_with_tensor_ops_(*args)


def update_scale_with_tensor_ops_(
    scale: torch.Tensor,
    tracker: torch.Tensor,
    found_inf: torch.Tensor,
    growth: float,
    backoff: float,
    interval: int,
) -> None:
    """:func:`update_scale_` written with public tensor ops, for devices without torch's kernel."""
    found = found_inf != 0
    successful = (tracker + 1) * ~found
    grow = successful == interval
    grown = times(scale, growth)
    grown = torch.where(torch.isfinite(grown), grown, scale)
    scale.copy_(torch.where(found, times(scale, backoff), torch.where(grow, grown, scale)))
    tracker.copy_(successful.masked_fill_(grow, 0))


def times(scale: torch.Tensor, factor: float) -> torch.Tensor:
    """``scale * factor`` rounded once to float32, as torch's kernel computes it (in float64, then rounded).

    A float32 product of two float32 numbers is already the correctly rounded exact product, so when
    ``factor`` is exact in float32 (2.0, 0.5, ...) the float64 round trip is skipped: same bits, fewer ops.
    """
    if struct.unpack("f", struct.pack("f", factor))[0] == factor:
        return scale * factor
    return (scale.to(wide_float(scale.device)) * factor).float()


# -- the fused-optimizer protocol ----------------------------------------------------------------------
#
# Optimizers that unscale and skip inside their own kernel (``Adam(fused=True)`` and the like) set
# ``_step_supports_amp_scaling = True`` and read two attributes during ``step()``: ``grad_scale`` (divide the
# gradients by it; None if they are already unscaled) and ``found_inf`` (skip the update where it is
# non-zero). That is torch.optim's protocol, so these two public names are the only ones mixprec writes on an
# optimizer, and only for the duration of the call: whatever was there before is restored.

_PROTOCOL = ("grad_scale", "found_inf")
_MISSING = object()


def supports_fused_scaling(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` handles ``grad_scale``/``found_inf`` itself.

    Raises:
        TypeError: for an optimizer on torch's older protocol (a ``grad_scaler`` argument to ``step``), which
            calls private methods of torch's own GradScaler; it would otherwise step on scaled gradients.
    """
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        return False
    if _takes_grad_scaler(getattr(optimizer.step, "__func__", optimizer.step)):
        raise TypeError(
            f"{type(optimizer).__name__}.step() takes a grad_scaler argument: torch's deprecated protocol, "
            "which relies on torch.amp.GradScaler internals and is not supported by mixprec.GradScaler. "
            "Read optimizer.grad_scale and optimizer.found_inf in step() instead (what torch.optim does)."
        )
    return True


# Whether a step function takes ``grad_scaler`` (weakly keyed: a closure may hold its optimizer).
_TAKES_GRAD_SCALER: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def _takes_grad_scaler(step: Callable[..., Any]) -> bool:
    """Whether ``step`` has a ``grad_scaler`` parameter; cached, as ``inspect.signature`` is slow."""
    try:
        return _TAKES_GRAD_SCALER[step]
    except (KeyError, TypeError):
        takes = "grad_scaler" in inspect.signature(step).parameters
    try:
        _TAKES_GRAD_SCALER[step] = takes
    except TypeError:  # not weakly referenceable or not hashable: asked again next time
        pass
    return takes


def run_fused_step(
    optimizer: torch.optim.Optimizer,
    grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """Call ``optimizer.step(*args, **kwargs)`` with the protocol attributes set, then restore them."""
    saved = {name: optimizer.__dict__.get(name, _MISSING) for name in _PROTOCOL}
    optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
    optimizer.found_inf = found_inf  # type: ignore[attr-defined]
    try:
        return optimizer.step(*args, **kwargs)
    finally:
        for name, value in saved.items():
            if value is _MISSING:
                delattr(optimizer, name)
            else:
                setattr(optimizer, name, value)
