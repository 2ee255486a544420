"""Which gradients a pass reads: an optimizer's parameters, grouped by device and dtype.

Sparse gradients contribute their values, complex ones their real and imaginary parts (a view), FSDP2's
DTensor ones this rank's shard: every group is a list of plain real tensors that the check kernels
(unscale.py) read and multiply in place.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator
from typing import Any

import torch

__all__ = ["FP16_MESSAGE", "GradGroups", "check_optimizer", "collect_grads", "params_of"]

GradGroups = dict[torch.device, dict[torch.dtype, list[torch.Tensor]]]

FP16_MESSAGE = (
    "Attempting to unscale FP16 gradients. (mixprec: fp16 gradients usually mean fp16 parameters without "
    "fp32 master weights, where the optimizer update itself loses precision; keep the parameters in fp32 or "
    "use mixprec.MixedPrecisionOptimizer, or pass GradScaler(allow_fp16_grads=True) to unscale them anyway.)"
)


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
    grads = [param.grad for param in params if param.grad is not None]
    if not grads:
        return {}
    if any(grad.is_sparse or type(grad) is not torch.Tensor for grad in grads):
        return _collect_each(params, allow_fp16)
    nullable: list[torch.Tensor | None] = list(grads)  # the op's signature allows None entries
    grouped = torch._C._group_tensors_by_device_and_dtype([nullable], False)
    if any(dtype.is_complex for _, dtype in grouped):
        return _collect_each(params, allow_fp16)
    if not allow_fp16 and any(dtype == torch.float16 for _, dtype in grouped):
        raise ValueError(FP16_MESSAGE)
    groups: GradGroups = defaultdict(dict)
    for (device, dtype), (lists, _) in grouped.items():
        groups[device][dtype] = [grad for grad in lists[0] if grad is not None]  # none are None
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
