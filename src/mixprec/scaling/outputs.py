"""Apply a function to every tensor of a nested output: tensors, lists, tuples, namedtuples, dicts."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["map_tensors"]


def map_tensors(outputs: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``fn`` applied to each tensor in ``outputs``, keeping the containers.

    Lists, tuples and namedtuples keep their type; dicts keep type and keys (torch's GradScaler maps over
    the keys instead); other iterables come back as a lazy ``map``, as in torch.

    Raises:
        ValueError: for a leaf that is not a tensor (torch's error type), naming its type.
    """
    if isinstance(outputs, torch.Tensor):
        return fn(outputs)
    if isinstance(outputs, dict):
        mapped = copy.copy(outputs)
        for key, value in outputs.items():
            mapped[key] = map_tensors(value, fn)
        return mapped
    if isinstance(outputs, tuple) and hasattr(outputs, "_fields"):
        return type(outputs)(*(map_tensors(value, fn) for value in outputs))
    if isinstance(outputs, (list, tuple)):
        return type(outputs)(map_tensors(value, fn) for value in outputs)
    if isinstance(outputs, Iterable) and not isinstance(outputs, (str, bytes)):
        return map(lambda value: map_tensors(value, fn), outputs)
    raise ValueError(
        "outputs must be a Tensor or an iterable of Tensors (lists, tuples, dicts, nested), "
        f"got {type(outputs).__name__}: {outputs!r:.80}"
    )
