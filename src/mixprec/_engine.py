"""The autocast engine: per-thread region state, cast kernels, op handlers and the TorchFunctionMode.

How it works. Entering the outermost enabled region pushes one :class:`torch.overrides.TorchFunctionMode`
per thread; every torch function and Tensor method called in the region reaches its
``__torch_function__``. The mode looks the function up in a table (function -> handler) built
lazily from the active policy:

* "lower" ops: floating, non-float64 tensors on the region's device are cast to the compute dtype
  (fp32 leaf parameters through a per-region cache that checks the tensor version);
* "fp32" ops (and torch's fp32_set_opt_dtype / fp32_append_dtype families): cast up to float32,
  unless the caller passed ``dtype=`` explicitly;
* "promote" ops: cast every eligible tensor to the widest floating dtype among them;
* anything else runs untouched, with the mode suspended inside it. A Python-level function that
  dispatches through ``__torch_function__`` is seen as one call, so the ops inside it are not;
  where such a function contains listed ops (``torch.einsum`` -> bmm,
  ``F.multi_head_attention_forward`` -> linear/SDPA) the catalogue names it in ``COMPOSITES``.

Region state (the stack of nested regions, the cast cache, the module-override stack) is per thread
and restored on exit; backward never runs through the mode, so gradients flow in the dtypes the
forward casts recorded, as with ``torch.autocast``.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from mixprec.policy import ops as _ops
from mixprec.policy.conditions import LOWER_RESULT, Condition
from mixprec.policy.policy import BANNED, PASSTHROUGH, ResolvedPolicy

_FLOAT64 = torch.float64
_FP32 = torch.float32


@dataclass
class _Frame:
    """One entered region."""

    device_type: str
    enabled: bool
    rules: ResolvedPolicy | None
    cache_enabled: bool
    # What the mode was doing when this region was entered (a module override's rules included),
    # restored on exit: leaving a nested region must not drop an enclosing module's override.
    saved: tuple[ResolvedPolicy | None, str, bool] | None = None


@dataclass
class _ModuleScope:
    """A module whose override is active: the rules to restore when it returns."""

    module: nn.Module
    saved_rules: ResolvedPolicy | None
    output_dtype: torch.dtype | None


class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.frames: list[_Frame] = []
        self.mode: _AutocastMode | None = None
        self.cache: dict[tuple[int, torch.dtype, bool], tuple[torch.Tensor, int, torch.Tensor]] = {}
        self.module_names: dict[int, str] = {}
        self.module_scopes: list[_ModuleScope] = []
        self.module_depth = 0


_state = _ThreadState()


# --------------------------------------------------------------------------- casting kernels
def _cast_tensor(t: torch.Tensor, dtype: torch.dtype, mode: _AutocastMode) -> torch.Tensor:
    if (
        t.dtype is dtype
        or not t.is_floating_point()
        or t.dtype is _FLOAT64
        or t.device.type != mode.device_type
    ):
        return t
    if mode.cache_enabled and t.requires_grad and t.is_leaf and t.dtype is _FP32:
        key = (id(t), dtype, torch.is_grad_enabled())
        hit = _state.cache.get(key)
        version = t._version
        # The source tensor is kept in the entry, so an id cannot be reused while the entry lives;
        # the version check serves a fresh cast after an in-place update (torch serves a stale one).
        if hit is not None and hit[0] is t and hit[1] == version:
            return hit[2]
        cast = t.to(dtype)
        _state.cache[key] = (t, version, cast)
        return cast
    return t.to(dtype)


def _cast_any(value: Any, dtype: torch.dtype, mode: _AutocastMode, memo: dict[int, torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        # One input passed twice stays one tensor: code such as F.multi_head_attention_forward
        # branches on `query is key`, and torch.autocast casts a shared input once too.
        hit = memo.get(id(value))
        if hit is None:
            hit = memo[id(value)] = _cast_tensor(value, dtype, mode)
        return hit
    if isinstance(value, (list, tuple)) and value and any(isinstance(v, torch.Tensor) for v in value):
        return _rebuild(value, [_cast_any(v, dtype, mode, memo) for v in value])
    return value


def _rebuild(value: list | tuple, items: list) -> list | tuple:
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple takes fields, not an iterable
        return type(value)(*items)
    return type(value)(items)


def _cast_call(func: Callable, args: tuple, kwargs: dict, dtype: torch.dtype, mode: _AutocastMode) -> Any:
    memo: dict[int, torch.Tensor] = {}
    args = tuple(_cast_any(a, dtype, mode, memo) for a in args)
    if kwargs:
        kwargs = {k: _cast_any(v, dtype, mode, memo) for k, v in kwargs.items()}
    return func(*args, **kwargs)


def _eligible_dtypes(value: Any, device_type: str, out: set[torch.dtype]) -> None:
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() and value.dtype is not _FLOAT64 and value.device.type == device_type:
            out.add(value.dtype)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _eligible_dtypes(v, device_type, out)


# --------------------------------------------------------------------------- handlers
def _run_lower(mode: _AutocastMode, func: Callable, args: tuple, kwargs: dict) -> Any:
    return _cast_call(func, args, kwargs, mode.rules.compute_dtype, mode)  # type: ignore[union-attr]


def _run_fp32(mode: _AutocastMode, func: Callable, args: tuple, kwargs: dict) -> Any:
    if kwargs.get("dtype") is not None:  # the caller chose the dtype: torch's set_opt_dtype keeps it
        return func(*args, **kwargs)
    return _cast_call(func, args, kwargs, _FP32, mode)


def _run_promote(mode: _AutocastMode, func: Callable, args: tuple, kwargs: dict) -> Any:
    found: set[torch.dtype] = set()
    _eligible_dtypes(args, mode.device_type, found)
    _eligible_dtypes(tuple(kwargs.values()), mode.device_type, found)
    if len(found) < 2:
        return func(*args, **kwargs)
    widest = functools.reduce(torch.promote_types, found)
    return _cast_call(func, args, kwargs, widest, mode)


def _run_banned(mode: _AutocastMode, func: Callable, args: tuple, kwargs: dict) -> Any:
    found: set[torch.dtype] = set()
    _eligible_dtypes((args, tuple(kwargs.values())), mode.device_type, found)
    if not found:  # torch bans it only where autocast applies: floating tensors on the region's device
        return func(*args, **kwargs)
    name = getattr(func, "__name__", repr(func))
    raise RuntimeError(
        f"{name} is unsafe to autocast on {mode.device_type!r} (as with torch.autocast): its backward "
        "is numerically unstable in low precision. Use binary_cross_entropy_with_logits / BCEWithLogitsLoss, "
        f"or take it off the banned list with policy.with_ops(fp32=[{name!r}]) to run it in float32."
    )


def _run_lower_result(mode: _AutocastMode, func: Callable, args: tuple, kwargs: dict) -> Any:
    return _cast_any(func(*args, **kwargs), mode.rules.compute_dtype, mode, {})  # type: ignore[union-attr]


def _conditional(condition: Condition) -> Callable[..., Any]:
    def run(mode: _AutocastMode, func: Callable, args: tuple, kwargs: dict) -> Any:
        category = condition(args, kwargs)
        if category is None:
            return func(*args, **kwargs)
        return _HANDLERS[category](mode, func, args, kwargs)

    return run


_HANDLERS: dict[str, Callable[..., Any]] = {
    BANNED: _run_banned,
    LOWER_RESULT: _run_lower_result,
    _ops.LOWER: _run_lower,
    _ops.FP32: _run_fp32,
    _ops.FP32_SET_OPT_DTYPE: _run_fp32,
    _ops.FP32_APPEND_DTYPE: _run_fp32,
    _ops.PROMOTE: _run_promote,
}


def _handler_for(func: Callable, rules: ResolvedPolicy) -> Callable[..., Any] | None:
    category = rules.by_callable.get(func) if rules.by_callable else None
    if category is None:
        name = getattr(func, "__name__", None)
        if name is not None:
            condition = rules.conditions.get(name)
            if condition is not None:
                return _conditional(condition)
            category = rules.by_name.get(_ops.ALIASES.get(name, name))
    if category is not None and category != PASSTHROUGH:
        return _HANDLERS[category]
    return None


class _AutocastMode(TorchFunctionMode):
    """The per-thread mode; reads the innermost region's rules from attributes set on enter/exit."""

    def __init__(self) -> None:
        super().__init__()
        self.rules: ResolvedPolicy | None = None
        self.device_type = "cpu"
        self.cache_enabled = True
        self._tables: dict[ResolvedPolicy, dict[Callable, Callable | None]] = {}
        self.table: dict[Callable, Callable | None] = {}

    def activate(self, frame: _Frame | None) -> None:
        rules = frame.rules if frame is not None and frame.enabled else None
        self.set_rules(rules)
        if frame is not None:
            self.device_type = frame.device_type
            self.cache_enabled = frame.cache_enabled

    def set_rules(self, rules: ResolvedPolicy | None) -> None:
        self.rules = rules
        if rules is None:
            self.table = {}
        else:
            self.table = self._tables.setdefault(rules, {})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        rules = self.rules
        if rules is None:
            return func(*args, **kwargs)
        table = self.table
        try:
            handler = table[func]
        except KeyError:
            handler = table[func] = _handler_for(func, rules)
        except TypeError:  # an unhashable callable: resolve without memoising
            handler = _handler_for(func, rules)
        if handler is None:
            return func(*args, **kwargs)
        return handler(self, func, args, kwargs)
