"""The bad-input battery's engine: a case table, an object fingerprint and the outcome of one case.

A :class:`Case` calls the public API with one bad input (or in a wrong order, or round-trips an object
through ``copy.deepcopy`` and pickle). :func:`run_case` sorts what happened into the issue's kinds:

- ``clear``: raised the expected type (ValueError/TypeError, RuntimeError for call order), the message names
  the argument, and the object is bitwise as it was (round-trip cases: the copies match the original);
- ``half-changed``: raised, but the object changed first;
- ``obscure``: raised something else, or a message that names nothing the user passed;
- ``silent``: did not raise at all;
- ``crash``: the interpreter died (only seen by the counting script, which runs cases in child processes).

Run ``python -m tests.reliability.count`` from the repository root for the counts.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Case", "fingerprint", "run_case"]

CLEAR, HALF, OBSCURE, SILENT, CRASH = "clear", "half-changed", "obscure", "silent", "crash"
KINDS = (CLEAR, OBSCURE, SILENT, CRASH, HALF)
BAD_INPUT = (ValueError, TypeError)
CALL_ORDER = (RuntimeError,)


def _none() -> None:
    return None


@dataclass
class Case:
    """One bad input to the public API.

    Args:
        id: unique, readable: ``"GradScaler(init_scale=1e39)"``.
        call: ``call(ctx)`` makes the bad call; ``ctx`` is what ``setup`` returned.
        names: words the error message must contain (case-insensitive): the argument, key or method.
        setup: builds the object(s) under test; default None.
        raises: the exception types that count as clear.
        target: ``target(ctx)`` is what must be unchanged by a failed call; default ``ctx``.
        owner: which part of mixprec the case exercises (for expected failures owned elsewhere).
        roundtrip: a round-trip case: ``call`` must succeed (it asserts the copies match).
        isolate: run in a child process under pytest (the call may kill the interpreter).
    """

    id: str
    call: Callable[[Any], Any]
    names: tuple[str, ...] = ()
    setup: Callable[[], Any] = _none
    raises: tuple[type[BaseException], ...] = BAD_INPUT
    target: Callable[[Any], Any] | None = None
    owner: str = "scaling"
    roundtrip: bool = False
    isolate: bool = False
    tags: tuple[str, ...] = field(default=())


@dataclass
class Outcome:
    kind: str
    detail: str


def run_case(case: Case) -> Outcome:
    """Run one case in this process and classify it (never raises for the case's own failure)."""
    ctx = case.setup()
    target = case.target or (lambda c: c)
    before = fingerprint(target(ctx))
    try:
        case.call(ctx)
    except Exception as error:  # the battery exists to see every kind
        message = f"{type(error).__name__}: {error}"
        if fingerprint(target(ctx)) != before:
            return Outcome(HALF, message)
        if case.roundtrip:
            return Outcome(OBSCURE, message)
        named = all(word.lower() in str(error).lower() for word in case.names)
        if isinstance(error, case.raises) and named:
            return Outcome(CLEAR, message)
        return Outcome(OBSCURE, message)
    if case.roundtrip:
        return Outcome(CLEAR, "round trip ok")
    return Outcome(SILENT, "no error")


# ----------------------------------------------------------------------------- fingerprint
def fingerprint(obj: Any) -> Any:
    """A comparable picture of ``obj`` and everything it holds: values, dtypes, ids of tensors.

    Tensors give their identity, dtype, shape, stride and bytes (a tensor that points outside its storage
    gives only its metadata), objects their type and ``__dict__``, containers their items.
    """
    return _fp(obj, set(), 0)


def _fp(obj: Any, seen: set[int], depth: int) -> Any:
    if depth > 40:
        return ("deep", type(obj).__name__)
    if obj is None or isinstance(obj, (bool, int, str, bytes, torch.dtype, torch.device, enum.Enum)):
        return obj
    if isinstance(obj, float):
        return ("float", repr(obj)) if math.isnan(obj) else obj
    if isinstance(obj, torch.Tensor):
        return _tensor_fp(obj)
    if isinstance(obj, torch.Generator):
        return ("Generator", id(obj), obj.get_state().numpy().tobytes())  # get_state() is a new tensor
    if id(obj) in seen:
        return ("seen", type(obj).__name__, id(obj))
    seen = seen | {id(obj)}
    if isinstance(obj, dict):
        items = [(_key(k), _fp(v, seen, depth + 1)) for k, v in obj.items()]
        return (type(obj).__name__, tuple(items))
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, tuple(_fp(v, seen, depth + 1) for v in obj))
    if isinstance(obj, (set, frozenset)):
        return (type(obj).__name__, tuple(sorted(repr(_key(v)) for v in obj)))
    state = getattr(obj, "__dict__", None)
    if (isinstance(state, dict) and not callable(obj)) or isinstance(obj, torch.nn.Module):
        return (type(obj).__name__, _fp(state, seen, depth + 1))
    return (type(obj).__name__, id(obj))


def _key(key: Any) -> Any:
    return ("tensor", id(key)) if isinstance(key, torch.Tensor) else repr(key)


def _tensor_fp(tensor: torch.Tensor) -> Any:
    meta = (id(tensor), tensor.dtype, tuple(tensor.shape), tensor.stride(), tensor.requires_grad)
    data = tensor.detach()
    if data.is_sparse:
        data = data.coalesce().values()
    if data.layout != torch.strided or data.device.type == "meta":
        return ("Tensor", meta)
    needed = (data.storage_offset() + _extent(data)) * data.element_size()
    if data.untyped_storage().nbytes() < needed:  # reading it would leave the storage: metadata only
        return ("Tensor", meta, "outside its storage")
    flat = data.cpu().contiguous().reshape(-1)
    raw = flat.view(torch.uint8) if flat.element_size() else flat
    grad = None if tensor.grad is None else _tensor_fp(tensor.grad)
    return ("Tensor", meta, raw.numpy().tobytes(), grad)


def _extent(tensor: torch.Tensor) -> int:
    if tensor.numel() == 0:
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True))
