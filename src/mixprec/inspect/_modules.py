"""Which module is running: per-module forward hooks that keep a stack of qualified names.

The hooks go on the inspected model's own modules (never the global registries) and only for as long as
a diagnostic runs; they ignore calls from other threads, so a model shared with another thread is only
observed on the diagnostic's thread.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn

from mixprec.inspect._restore import Handles, tensors_in

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


def check_loss(loss: Any) -> torch.Tensor:
    """``loss`` itself, after checking it is a one-element tensor that requires grad."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(f"loss_fn must return a one-element tensor, got {shape}")
    if not loss.requires_grad:
        raise ValueError("loss_fn returned a tensor that does not require grad; nothing to backpropagate")
    return loss
