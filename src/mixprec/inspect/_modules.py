"""Which module is running: per-module forward hooks that keep a stack of qualified names.

The hooks go on the inspected model's own modules (never the global registries) and only for as long as
a diagnostic runs; they ignore calls from other threads, so a model shared with another thread is only
observed on the diagnostic's thread.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from mixprec.inspect._restore import Handles, tensors_in

#: ``loss_fn(model, batch) -> scalar tensor``: the loss every report and the planner take.
LossFn = Callable[[nn.Module, Any], torch.Tensor]

#: Label for ops that run outside every module of the model (in ``loss_fn``, or in user code).
OUTSIDE = "(outside the model)"


def display_name(name: str) -> str:
    """A module's qualified name for messages: the root module has the empty name."""
    return name if name else "(root module)"


class ModuleTracker:
    """The stack of modules whose forward is running on this thread, by qualified name.

    Args:
        model: the model whose modules are tracked; names are as in ``model.named_modules()``.
        handles: where the hook handles go, so the caller removes them.
    """

    def __init__(self, model: nn.Module, handles: Handles) -> None:
        self._thread = threading.get_ident()
        self.stack: list[str] = []
        for name, module in model.named_modules():
            handles.add(module.register_forward_pre_hook(self._pre_hook(name)))
            handles.add(module.register_forward_hook(self._post_hook(name), always_call=True))

    @property
    def current(self) -> str:
        """The innermost running module's name, or :data:`OUTSIDE`."""
        return self.stack[-1] if self.stack else OUTSIDE

    def _pre_hook(self, name: str):
        def hook(module: nn.Module, args: Any) -> None:
            if threading.get_ident() == self._thread:
                self.stack.append(name)

        return hook

    def _post_hook(self, name: str):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if threading.get_ident() == self._thread and self.stack and self.stack[-1] == name:
                self.stack.pop()

        return hook


def check_model(model: object) -> nn.Module:
    """``model`` itself, after checking it is an ``nn.Module``."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}: {model!r:.60}")
    return model


def call_model(model: nn.Module, inputs: Any) -> Any:
    """``model(inputs)`` for a tensor, ``model(*inputs)`` for a tuple/list, ``model(**inputs)`` for a dict."""
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def device_type_of(model: nn.Module, inputs: Any) -> str:
    """The device family of the model's first parameter or buffer, else of its first input, else cpu."""
    for tensor in (*model.parameters(), *model.buffers(), *tensors_in(inputs)):
        return tensor.device.type
    return "cpu"


#: How a loss of the output and a target is written in the one dialect (the usual torch-style mistake).
_WRAPPER = "for a loss of the output: lambda model, batch: F.cross_entropy(model(batch[0]), batch[1])"


class LossInputError(TypeError, ValueError):
    """A ``loss_fn`` or ``batches`` that does not fit ``loss_fn(model, batch) -> scalar tensor``: a TypeError
    (the wrong callable or container) and a ValueError (bad input, which ``mixprec plan`` reports as a usage
    error with exit code 2)."""


def describe(value: Any) -> str:
    """A short description of a value for messages: a tensor's shape and dtype, a container's length."""
    if isinstance(value, torch.Tensor):
        return f"Tensor of shape {tuple(value.shape)} ({str(value.dtype).removeprefix('torch.')})"
    if isinstance(value, (list, tuple, dict)):
        items = ", ".join(describe(v) for v in list(value.values() if isinstance(value, dict) else value)[:3])
        more = ", ..." if len(value) > 3 else ""
        return f"{type(value).__name__} of {len(value)} [{items}{more}]"
    if isinstance(value, nn.Module):
        return f"{type(value).__name__} (an nn.Module)"
    return f"{type(value).__name__} {value!r:.40}"


def check_loss(loss: Any) -> torch.Tensor:
    """``loss`` itself, after checking it is a one-element tensor that requires grad.

    Raises:
        ValueError: naming what ``loss_fn(model, batch)`` returned instead.
    """
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        tensor = isinstance(loss, torch.Tensor)
        got = f"{tuple(loss.shape)}: reduce it, e.g. .mean()" if tensor else describe(loss)
        raise ValueError(f"loss_fn(model, batch) must return a one-element tensor, got {got}")
    if not loss.requires_grad:
        raise ValueError("loss_fn returned a tensor that does not require grad; nothing to backpropagate")
    return loss


def call_loss(loss_fn: LossFn, model: nn.Module, batch: Any, api: str) -> torch.Tensor:
    """``loss_fn(model, batch)``, checked by :func:`check_loss`: the first call mixprec makes to the
    user's loss (the reference pass), where a loss written for another signature fails.

    Raises:
        LossInputError: (a TypeError and a ValueError) when ``loss_fn`` raises (chained ``from`` the
            original error), stating the signature mixprec calls, ``loss_fn(model, batch) -> scalar
            tensor``, and what it passed; ``api`` names the caller. Out-of-memory passes through as is.
        ValueError: as :func:`check_loss`.
    """
    try:
        loss = loss_fn(model, batch)
    except torch.OutOfMemoryError:
        raise
    except Exception as error:
        raise LossInputError(
            f"{api}: loss_fn raised {type(error).__name__}: {error}; mixprec calls it as "
            f"loss_fn(model, batch) -> scalar tensor, here with model={describe(model)} and "
            f"batch={describe(batch)} ({_WRAPPER})"
        ) from error
    return check_loss(loss)


def model_loss(loss_fn: object, api: str) -> LossFn:
    """``loss_fn``, checked to be the one dialect: ``loss_fn(model, batch) -> scalar tensor``, as the planner
    takes.

    Raises:
        TypeError: for a ``loss_fn`` that is not callable, or that takes one required positional argument
            (a loss of the model's output: the message shows the wrapper); ``api`` names the caller.
    """
    if not callable(loss_fn):
        raise TypeError(
            f"{api}: loss_fn must be callable loss_fn(model, batch) -> scalar tensor, got {loss_fn!r:.60}"
        )
    if _required_positional(loss_fn) != 1:
        return loss_fn
    raise TypeError(
        f"{api}: loss_fn takes one required argument, {loss_fn!r:.60}; it must be loss_fn(model, batch) -> "
        "loss, as plan_precision takes (for a loss of the output: lambda model, x: criterion(model(x), y))"
    )


def _required_positional(fn: Callable[..., Any]) -> int | None:
    """How many positional arguments ``fn`` needs (None when Python cannot read its signature or it takes
    ``*args``)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_POSITIONAL for p in parameters):
        return None
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(1 for p in parameters if p.kind in positional and p.default is inspect.Parameter.empty)
