"""The one walker over nested tensors: what a model takes and returns (tensors in lists, tuples, dicts).

The scaler multiplies every tensor of a loss structure (``GradScaler.scale``), the autocast engine casts the
inputs of an op or a pinned module, the O0-O3 forward casts a model's inputs and outputs. All three walk the
same containers the same way, here.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["map_tensors"]


def map_tensors(
    value: Any,
    fn: Callable[[torch.Tensor], torch.Tensor],
    *,
    strict: bool = False,
    memo: dict[int, torch.Tensor] | None = None,
) -> Any:
    """``value`` with ``fn`` applied to each tensor, keeping the containers.

    Lists, tuples and namedtuples keep their type, dicts their type and keys; a container whose items all
    come back unchanged is returned itself (code downstream may test identity). With ``memo``, one tensor
    met twice is mapped once and both places get the same result (``query is key`` decides code paths).

    Args:
        value: a tensor, or lists/tuples/dicts of them, nested.
        fn: applied to every tensor.
        strict: False (default): anything else is returned as it is. True (torch's GradScaler.scale):
            other iterables come back as a lazy ``map``, and any other leaf raises.
        memo: results by ``id`` of the tensor, shared across calls that must agree.

    Raises:
        ValueError: with ``strict``, for a leaf that is not a tensor (torch's error type), naming its type.
    """
    if isinstance(value, torch.Tensor):
        if memo is None:
            return fn(value)
        if id(value) not in memo:
            memo[id(value)] = fn(value)
        return memo[id(value)]

    def walk(item: Any) -> Any:
        return map_tensors(item, fn, strict=strict, memo=memo)

    if isinstance(value, dict):
        mapped = {key: walk(item) for key, item in value.items()}
        if all(mapped[key] is item for key, item in value.items()):
            return value
        result = copy.copy(value)
        for key, item in mapped.items():  # item by item: some dict types refuse update() (HF ModelOutput)
            result[key] = item
        return result
    if isinstance(value, (list, tuple)):
        items = [walk(item) for item in value]
        if all(a is b for a, b in zip(items, value, strict=True)):
            return value
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if not strict:
        return value
    if isinstance(value, Iterable) and not isinstance(value, (str, bytes)):
        return map(walk, value)
    raise ValueError(
        "outputs must be a Tensor or an iterable of Tensors (lists, tuples, dicts, nested), "
        f"got {type(value).__name__}: {value!r:.80}"
    )
