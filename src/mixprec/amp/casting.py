"""Casting a model for O2/O3, all or nothing: never touches modules kept in fp32, refuses overflow.

:func:`cast_model` casts each module's own floating-point parameters and buffers, skipping kept modules
(BatchNorm under ``keep_batchnorm_fp32``) and everything inside them, so a kept fp32 value is never rounded
through the half type and back. Before anything changes it checks that no finite value becomes inf in the
half type (an fp16 running_var of 7e4 would), and it returns an undo that puts the original tensors back.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

__all__ = ["KEPT_FP32", "cast_model", "cast_plan", "cast_with_undo"]

KEPT_FP32 = (nn.modules.batchnorm._BatchNorm,)  # BatchNorm1d/2d/3d, SyncBatchNorm, lazy variants


def cast_plan(model: nn.Module, dtype: torch.dtype, keep_batchnorm_fp32: bool) -> list[tuple[str, nn.Module]]:
    """The ``(name, module)`` pairs whose own tensors a cast changes; validates first.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: a finite value would overflow to inf in ``dtype`` (names the tensor, its largest |x|).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    kept: set[int] = set()
    plan = []
    for name, module in model.named_modules():
        if id(module) in kept:
            continue
        if keep_batchnorm_fp32 and isinstance(module, KEPT_FP32):
            kept.update(id(m) for m in module.modules())
            continue
        own = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        for tensor_name, tensor in own:
            if tensor.is_floating_point() and tensor.dtype != dtype:
                _check_range(f"{name}.{tensor_name}" if name else tensor_name, tensor, dtype)
        plan.append((name, module))
    return plan


def _check_range(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> None:
    with torch.no_grad():
        overflow = torch.isinf(tensor.to(dtype)) & torch.isfinite(tensor)
        if overflow.any():
            largest = tensor[overflow].abs().max().item()
            raise ValueError(
                f"casting {name!r} to {dtype} would turn finite values (|x| up to {largest:.6g}) into inf; "
                f"keep that module in fp32 or choose bfloat16"
            )


def cast_model(model: nn.Module, dtype: torch.dtype, keep_batchnorm_fp32: bool = True) -> nn.Module:
    """Cast floating params and buffers to ``dtype`` in place, except modules kept in fp32; returns ``model``.

    Parameters stay the same objects (their data is replaced), so an optimizer built on them still holds them.

    Raises:
        TypeError, ValueError: see ``cast_plan``; nothing is changed then.
    """
    cast_with_undo(model, dtype, keep_batchnorm_fp32)
    return model


def cast_with_undo(model: nn.Module, dtype: torch.dtype, keep_batchnorm_fp32: bool) -> Callable[[], None]:
    """:func:`cast_model`, returning an undo that puts every original tensor back."""
    plan = cast_plan(model, dtype, keep_batchnorm_fp32)
    saved = []
    for _, module in plan:
        params = {k: (p.data, p.grad) for k, p in module._parameters.items() if p is not None}
        saved.append((module, params, dict(module._buffers)))

    def convert(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() else t

    for _, module in plan:
        module._apply(convert, recurse=False)

    def undo() -> None:
        for module, params, buffers in saved:
            for k, (data, grad) in params.items():
                param = module._parameters[k]
                assert param is not None, "only set parameters were saved"
                param.data, param.grad = data, grad
            module._buffers.update(buffers)

    return undo
