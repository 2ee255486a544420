"""Run a diagnostic on a user's model and hand it back exactly as it was.

A diagnostic runs forward (and backward) on the model the user is training. Afterwards the model must
be indistinguishable from before: parameters and buffers bitwise equal (batch norm updates its running
statistics in a training-mode forward, so buffers are snapshotted and copied back), every ``.grad``
the same tensor object with the same values (grads are set aside before backward and put back after,
so nothing accumulates into them), the random number generators where they were (dropout draws from
them), and every hook the diagnostic registered removed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle


class Handles:
    """Hook handles a diagnostic registered; :meth:`remove_all` takes every one of them off again."""

    def __init__(self) -> None:
        self._handles: list[RemovableHandle] = []

    def add(self, handle: RemovableHandle) -> None:
        self._handles.append(handle)

    def remove_all(self) -> None:
        while self._handles:
            self._handles.pop().remove()


def tensors_in(value: Any) -> list[torch.Tensor]:
    """Tensors in a (nested) tuple, list or dict, in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_in(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors_in(v)]
    return []


@contextlib.contextmanager
def preserved(model: nn.Module, inputs: Any = None) -> Iterator[Handles]:
    """Context manager: run a diagnostic on ``model``, then restore grads, buffers, RNG and remove hooks.

    Yields:
        A :class:`Handles` to register every hook the diagnostic adds.
    """
    inputs_with_grad = [t for t in tensors_in(inputs) if t.requires_grad and t.is_leaf]
    leaves = list(dict.fromkeys([*model.parameters(), *inputs_with_grad]))
    saved_grads = [t.grad for t in leaves]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    modes = [(m, m.training) for m in model.modules()]
    cpu_rng = torch.random.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    handles = Handles()
    for t in leaves:
        t.grad = None
    try:
        yield handles
    finally:
        handles.remove_all()
        for t, grad in zip(leaves, saved_grads, strict=True):
            t.grad = grad
        with torch.no_grad():
            for buffer, copy in buffers:
                buffer.copy_(copy)
        for module, training in modes:
            module.training = training
        torch.random.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
