"""`find_nonfinite`: the module and op where a mixed-precision run first produced inf or nan."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mixprec.autocast import autocast
from mixprec.inspect._modules import (
    LossFn,
    ModuleTracker,
    call_loss,
    call_model,
    check_model,
    device_type_of,
    model_loss,
)
from mixprec.inspect._restore import preserved
from mixprec.inspect._watch import Watch, all_finite, nonfinite_kind
from mixprec.inspect.nonfinite_report import NonfiniteReport
from mixprec.policy import Policy

__all__ = ["NonfiniteReport", "find_nonfinite"]


def find_nonfinite(
    model: nn.Module,
    inputs: Any,
    *,
    loss_fn: LossFn | None = None,
    dtype: torch.dtype | str | None = None,
    device_type: str | None = None,
    policy: Policy | str | None = None,
) -> NonfiniteReport | None:
    """Run one forward (and, with ``loss_fn``, one backward) under mixprec.autocast; find the first inf/nan.

    The model is restored exactly afterwards: no hook left behind, parameters and buffers bitwise as
    before, every ``.grad`` the same tensor with the same values, train/eval modes and the RNG state
    unchanged.

    Args:
        model: the model to inspect (run in whatever train/eval mode it is in).
        inputs: a tensor (``model(inputs)``), a tuple or list (``model(*inputs)``) or a dict
            (``model(**inputs)``).
        loss_fn: ``loss_fn(model, batch) -> scalar tensor``, called once inside the region with ``inputs``
            as the batch; with it, a backward runs too (without it, one forward ``model(inputs)``).
        dtype: the autocast dtype (a torch dtype or a name such as "fp16", "bf16"); default: the
            policy's compute dtype, else float16.
        device_type: autocast's device type; default: that of the model's first parameter.
        policy: a :class:`~mixprec.Policy` or policy string for the region.

    Returns:
        None when every value stayed finite, else a :class:`NonfiniteReport` for the first op (in
        execution order: forward ops, then backward nodes) whose result was non-finite; or, without
        running the model, for its first parameter that already holds inf/nan, or buffer that holds nan
        (``state``; a buffer's -inf, an attention mask's, is not taken for a diverged model).

    Raises:
        TypeError: if ``model`` is not an ``nn.Module``, ``loss_fn`` not ``loss_fn(model, batch)`` (refused
            before the model runs, or when it raises: the message names what was passed), or ``policy`` of
            another type.
        ValueError: if ``loss_fn`` returns something other than a one-element tensor that requires grad.
    """
    check_model(model)
    if loss_fn is not None:
        loss_fn = model_loss(loss_fn, "find_nonfinite")
    if isinstance(policy, str):
        policy = Policy.parse(policy)
    elif policy is not None and not isinstance(policy, Policy):
        raise TypeError(f"policy must be a Policy, a policy string or None, got {type(policy).__name__}")
    if dtype is None and (policy is None or policy.compute_dtype is None):
        dtype = torch.float16
    device_type = device_type or device_type_of(model, inputs)
    region = autocast(device_type, dtype=dtype, policy=policy)
    broken = _nonfinite_state(model)
    if broken is not None:  # every op using it would be blamed on the data fed to the model
        return broken
    with preserved(model, inputs) as handles:
        watch = Watch(ModuleTracker(model, handles), handles, device_type, watch_backward=loss_fn is not None)
        try:
            with torch.set_grad_enabled(loss_fn is not None):
                with region, watch:
                    loss = None if loss_fn is None else call_loss(loss_fn, model, inputs, "find_nonfinite")
                    if loss_fn is None:
                        call_model(model, inputs)
                if loss is not None and watch.forward is None:
                    loss.backward()
            finding = watch.forward or watch.backward
            if finding is None and loss_fn is not None:
                finding = _nonfinite_param_grad(model)
        finally:
            watch.release()
    return finding


def _nonfinite_state(model: nn.Module) -> NonfiniteReport | None:
    """The first parameter of ``model`` that holds inf/nan already, else the first buffer that holds nan
    (a diverged model; a buffer may hold -inf by design, an attention mask, so its inf is left to the ops)."""
    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, tensor in named:
            if not tensor.is_floating_point() or tensor.is_meta:
                continue
            broken = not all_finite([tensor]) if kind == "parameter" else bool(torch.isnan(tensor).any())
            if broken:
                value = nonfinite_kind([tensor])
                module = name.rpartition(".")[0]
                return NonfiniteReport(module, "forward", kind, tensor.dtype, value, None, False, state=name)
    return None


def _nonfinite_param_grad(model: nn.Module) -> NonfiniteReport | None:
    """A fallback for gradients that became non-finite where no hooked node saw it (e.g. accumulation)."""
    for name, param in model.named_parameters():
        if param.grad is not None and not all_finite([param.grad]):
            module = name.rpartition(".")[0]
            kind = "nan" if bool(torch.isnan(param.grad).any()) else "inf"
            return NonfiniteReport(
                module, "backward", f"gradient of {name}", param.grad.dtype, kind, None, True
            )
    return None
