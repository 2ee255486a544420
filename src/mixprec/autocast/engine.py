"""The engine under :class:`mixprec.autocast`: per-thread region state and the deviation mode.

How it works. A mixprec region *is* torch's autocast state: entering it enters ``torch.autocast`` for
the region's device and compute dtype, so torch's own ``Autocast*`` kernels cast every op on torch's
lists, at the ATen level, exactly as under ``torch.autocast``. Everything written for torch.autocast
sees a region (``torch.is_autocast_enabled()``, ``torch.autocast(enabled=False)`` islands,
``torch.amp.custom_fwd``, checkpoint recomputation, fused eval paths, ``torch.compile``).

What a policy changes relative to torch's lists (ops moved to another list, ops given as callables, a
policy built on the other device family's lists) are its *deviations*
(:attr:`ResolvedPolicy.deviations`). Only when a region has deviations is a
:class:`torch.overrides.TorchFunctionMode` pushed: it sees Python-level calls, and for a deviating op
casts the inputs as the policy says and runs the op with torch's autocast switched off around that one
call (so torch's kernel cannot undo the policy). A deviating op called with ``out=``, or inside a
``torch.autocast(enabled=False)`` island, runs untouched, as torch would run it.

Region state (frames, the mode, the pin scopes) is per thread and restored on exit.
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

from mixprec._tree import map_tensors
from mixprec.policy import ops as _ops
from mixprec.policy.policy import BANNED, PASSTHROUGH, ResolvedPolicy

_FLOAT64 = torch.float64
_FP32 = torch.float32


@dataclass
class _Frame:
    """One entered mixprec region on this thread."""

    device_type: str
    enabled: bool
    rules: ResolvedPolicy | None
    cache_enabled: bool
    saved_rules: ResolvedPolicy | None = None  # the mode's rules on entry, restored on exit
    pushed_mode: bool = False
    holds_pins: bool = False
    cleared_cache: bool = False


@dataclass
class _PinScope:
    """A pinned module while it runs: what to restore when it returns."""

    module: nn.Module
    device_type: str
    saved_enabled: bool
    saved_dtype: torch.dtype
    saved_rules: ResolvedPolicy | None
    output_dtype: torch.dtype | None
    cleared_cache: bool = False


class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.frames: list[_Frame] = []
        self.mode: _DeviationMode | None = None
        self.cache: dict[tuple[int, torch.dtype, bool], tuple[torch.Tensor, int, torch.Tensor]] = {}
        self.names: dict[int, str] = {}
        self.scopes: list[_PinScope] = []
        self.depth = 0


_state = _ThreadState()


def current_rules() -> ResolvedPolicy | None:
    """The rules in force on this thread right now (a pinned module's included), or None."""
    mode = _state.mode
    if mode is not None:
        return mode.rules
    frames = _state.frames
    return frames[-1].rules if frames and frames[-1].enabled else None


# --------------------------------------------------------------------------- casts
def _cast_tensor(t: torch.Tensor, dtype: torch.dtype, device_type: str, cache: bool) -> torch.Tensor:
    if t.dtype is dtype or not t.is_floating_point() or t.dtype is _FLOAT64 or t.device.type != device_type:
        return t
    if cache and t.requires_grad and t.is_leaf and t.dtype is _FP32:
        key = (id(t), dtype, torch.is_grad_enabled())
        hit = _state.cache.get(key)
        version = t._version
        # The entry keeps the source alive (its id cannot be reused) and checks the version, so an
        # in-place update is seen.
        if hit is not None and hit[0] is t and hit[1] == version:
            return hit[2]
        cast = t.to(dtype)
        _state.cache[key] = (t, version, cast)
        return cast
    return t.to(dtype)


def cast_floating(value: Any, dtype: torch.dtype, device_type: str, cache: bool = False, memo=None) -> Any:
    """Cast the eligible floating tensors in ``value`` (nested lists/tuples/dicts) to ``dtype``.

    Eligible: floating, not float64, on ``device_type`` (torch.autocast's rule). One tensor passed
    twice stays one tensor (``query is key`` decides code paths; torch casts a shared input once too).
    """
    memo = {} if memo is None else memo
    return map_tensors(value, lambda tensor: _cast_tensor(tensor, dtype, device_type, cache), memo=memo)


def _eligible_dtypes(value: Any, device_type: str, out: set[torch.dtype]) -> None:
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() and value.dtype is not _FLOAT64 and value.device.type == device_type:
            out.add(value.dtype)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _eligible_dtypes(v, device_type, out)


# --------------------------------------------------------------------------- deviation handlers
def _native_off(device_type: str, func: Callable, args: tuple, kwargs: dict) -> Any:
    """Run ``func`` with torch's autocast off for ``device_type`` (the policy decided its dtypes)."""
    torch.set_autocast_enabled(device_type, False)
    try:
        return func(*args, **kwargs)
    finally:
        torch.set_autocast_enabled(device_type, True)


def _run_cast(dtype: torch.dtype, mode: _DeviationMode, func: Callable, args: tuple, kwargs: dict) -> Any:
    dev, cache = mode.device_type, torch.is_autocast_cache_enabled()
    memo: dict[int, Any] = {}
    args = cast_floating(args, dtype, dev, cache, memo)
    kwargs = cast_floating(kwargs, dtype, dev, cache, memo)
    return _native_off(dev, func, args, kwargs)


def _run_lower(mode: _DeviationMode, func: Callable, args: tuple, kwargs: dict) -> Any:
    return _run_cast(torch.get_autocast_dtype(mode.device_type), mode, func, args, kwargs)


def _run_fp32(mode: _DeviationMode, func: Callable, args: tuple, kwargs: dict) -> Any:
    if kwargs.get("dtype") is not None:  # the caller chose the dtype: torch's set_opt_dtype keeps it
        return _native_off(mode.device_type, func, args, kwargs)
    return _run_cast(_FP32, mode, func, args, kwargs)


def _run_promote(mode: _DeviationMode, func: Callable, args: tuple, kwargs: dict) -> Any:
    found: set[torch.dtype] = set()
    _eligible_dtypes((args, tuple(kwargs.values())), mode.device_type, found)
    if len(found) < 2:
        return _native_off(mode.device_type, func, args, kwargs)
    return _run_cast(functools.reduce(torch.promote_types, found), mode, func, args, kwargs)


def _run_none(mode: _DeviationMode, func: Callable, args: tuple, kwargs: dict) -> Any:
    return _native_off(mode.device_type, func, args, kwargs)


def _run_banned(mode: _DeviationMode, func: Callable, args: tuple, kwargs: dict) -> Any:
    found: set[torch.dtype] = set()
    _eligible_dtypes((args, tuple(kwargs.values())), mode.device_type, found)
    if not found:  # banned only where autocast applies: floating tensors on the region's device
        return func(*args, **kwargs)
    name = getattr(func, "__name__", repr(func))
    raise RuntimeError(
        f"{name} is unsafe to autocast on {mode.device_type!r} (as with torch.autocast): its backward "
        "is numerically unstable in low precision. Use binary_cross_entropy_with_logits / BCEWithLogitsLoss, "
        f"or take it off the banned list with policy.with_ops(fp32=[{name!r}]) to run it in float32."
    )


_HANDLERS: dict[str, Callable[..., Any]] = {
    BANNED: _run_banned,
    PASSTHROUGH: _run_none,
    _ops.LOWER: _run_lower,
    _ops.FP32: _run_fp32,
    _ops.FP32_SET_OPT_DTYPE: _run_fp32,
    _ops.FP32_APPEND_DTYPE: _run_fp32,
    _ops.PROMOTE: _run_promote,
}


def _handler_for(func: Callable, rules: ResolvedPolicy) -> Callable[..., Any] | None:
    deviations = rules.deviations
    category = deviations.by_callable.get(func) if deviations.by_callable else None
    if category is None:
        name = getattr(func, "__name__", None)
        if name is not None:
            category = deviations.by_name.get(name)
            if category is None:
                category = deviations.by_name.get(_ops.ALIASES.get(name, name))
    return None if category is None else _HANDLERS[category]


class _DeviationMode(TorchFunctionMode):
    """Per-thread mode, pushed only while a region with deviations is active on the thread."""

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.device_type = device_type
        self.rules: ResolvedPolicy | None = None
        self._tables: dict[ResolvedPolicy, dict[Callable, Callable | None]] = {}
        self.table: dict[Callable, Callable | None] = {}

    def set_rules(self, rules: ResolvedPolicy | None) -> None:
        self.rules = rules
        if rules is None or not rules.deviations:
            self.table = {}
        else:
            self.device_type = rules.device_type
            self.table = self._tables.setdefault(rules, {})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        table = self.table
        if not table and (self.rules is None or not self.rules.deviations):
            return func(*args, **kwargs)
        try:
            handler = table[func]
        except KeyError:
            handler = table[func] = _handler_for(func, self.rules)  # type: ignore[arg-type]
        except TypeError:  # an unhashable callable: resolve without memoising
            handler = _handler_for(func, self.rules)  # type: ignore[arg-type]
        if (
            handler is None
            or kwargs.get("out") is not None
            or not torch.is_autocast_enabled(self.device_type)
        ):
            return func(*args, **kwargs)  # torch runs out= calls, and calls in an island, as given
        return handler(self, func, args, kwargs)
