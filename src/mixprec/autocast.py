"""`mixprec.autocast`: run a region's ops in the precision a :class:`~mixprec.Policy` gives them.

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
from typing import Any, TypeVar

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from mixprec.policy import ops as _ops
from mixprec.policy.conditions import LOWER_RESULT, Condition
from mixprec.policy.policy import BANNED, DEFAULT_DTYPES, PASSTHROUGH, Policy, ResolvedPolicy, _family

__all__ = ["autocast", "custom_bwd", "custom_fwd", "get_autocast_dtype", "is_autocast_enabled"]

F = TypeVar("F", bound=Callable[..., Any])
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


# --------------------------------------------------------------------------- module overrides
def _module_pre_hook(module: nn.Module, args: tuple) -> None:
    mode = _state.mode
    if mode is None or not _state.frames or mode.rules is None:
        _state.module_depth += 1
        return
    if _state.module_depth == 0:
        # The outermost module called in the region is the root that qualified names are relative to.
        _state.module_names = {id(m): name for name, m in module.named_modules()}
    _state.module_depth += 1
    policy = mode.rules.policy
    override = policy.module_override(module, _state.module_names.get(id(module), ""))
    if override is None:
        return
    frame = _state.frames[-1]
    if isinstance(override, Policy):
        new_rules, output = override.resolve(frame.device_type), override.output_dtype
    else:
        new_rules, output = policy.resolve(frame.device_type, override), None
    _state.module_scopes.append(_ModuleScope(module, mode.rules, output))
    mode.set_rules(new_rules)


def _module_post_hook(module: nn.Module, args: tuple, output: Any) -> Any:
    _state.module_depth = max(0, _state.module_depth - 1)
    scopes = _state.module_scopes
    if not scopes or scopes[-1].module is not module:
        return None
    scope = scopes.pop()
    mode = _state.mode
    if mode is not None:
        mode.set_rules(scope.saved_rules)
    if scope.output_dtype is None:
        return None
    return _cast_floating(output, scope.output_dtype)


def _cast_floating(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, (list, tuple)):
        return _rebuild(value, [_cast_floating(v, dtype) for v in value])
    if isinstance(value, dict):
        return {k: _cast_floating(v, dtype) for k, v in value.items()}
    return value


# --------------------------------------------------------------------------- the public region
class autocast:
    """Context manager and decorator: run ops in the precision the policy gives them.

    Drop-in for ``torch.autocast`` with the same signature and defaults, plus ``policy``.

    Args:
        device_type: "cpu" or "cuda" (a ``torch.device`` or "cuda:0" is accepted too).
        dtype: the low-precision dtype; default: the policy's compute dtype, else bfloat16 on CPU
            and float16 on CUDA.
        enabled: False makes the region a no-op (and disables autocast inside an enabled region).
        cache_enabled: cache casts of fp32 leaf parameters for the region (default True).
        policy: a :class:`Policy`, a preset name ("bf16-mixed", "conservative", ...) or a
            ``"params=...,compute=..."`` string. Default: ``Policy.for_device(device_type, dtype)``.

    Raises:
        ValueError: for an unsupported device type or dtype (e.g. float64, int8): unlike torch,
            mixprec does not silently disable itself.
    """

    def __init__(
        self,
        device_type: str,
        dtype: torch.dtype | None = None,
        enabled: bool = True,
        cache_enabled: bool | None = None,
        *,
        policy: Policy | str | None = None,
    ) -> None:
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}: {enabled!r}")
        self.device_type = _family(device_type)
        self.enabled = enabled
        self.cache_enabled = True if cache_enabled is None else bool(cache_enabled)
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}: {dtype!r}")
        if isinstance(policy, str):
            policy = Policy.parse(policy)
        elif policy is not None and not isinstance(policy, Policy):
            raise TypeError(f"policy must be a Policy or a str, got {type(policy).__name__}")
        if policy is None:
            policy = Policy.for_device(self.device_type, dtype)
        elif dtype is not None and policy.compute_dtype is not None and policy.compute_dtype != dtype:
            raise ValueError(
                f"dtype={dtype} conflicts with the policy's compute dtype {policy.compute_dtype}; "
                "give one of them"
            )
        self.policy = policy
        # Resolving now validates the dtype for the device before any region is entered.
        self._rules = policy.resolve(self.device_type, dtype)
        self.fast_dtype = self._rules.compute_dtype

    @classmethod
    def current(cls) -> autocast | None:
        """A region that re-enters the autocast state in force right now on this thread, or None.

        It carries the rules active at this point (a module override included), so code recomputed
        later, e.g. by activation checkpointing during backward, runs in the same dtypes.
        """
        mode, frames = _state.mode, _state.frames
        if not frames:
            return None
        frame = frames[-1]
        region = cls.__new__(cls)
        rules = mode.rules if mode is not None and mode.rules is not None else frame.rules
        region.device_type, region.enabled, region.cache_enabled = frame.device_type, frame.enabled, False
        region.policy, region._rules = rules.policy, rules  # type: ignore[union-attr]
        region.fast_dtype = rules.compute_dtype  # type: ignore[union-attr]
        return region

    def __enter__(self) -> autocast:
        frame = _Frame(self.device_type, self.enabled, self._rules, self.cache_enabled)
        frames = _state.frames
        frames.append(frame)
        mode = _state.mode
        if mode is None and self.enabled:
            mode = _state.mode = _AutocastMode()
            mode.__enter__()
            if self._rules.policy.module_overrides:
                _install_module_hooks()
        if mode is not None:
            if self.enabled and self._rules.policy.module_overrides and not _hooks:
                _install_module_hooks()
            frame.saved = (mode.rules, mode.device_type, mode.cache_enabled)
            mode.activate(frame)
        return self

    def __exit__(self, *exc: object) -> None:
        frames = _state.frames
        frame = frames.pop()
        mode = _state.mode
        if mode is None:
            return
        if not any(f.enabled for f in frames):
            mode.__exit__(None, None, None)
            _state.mode = None
            _state.cache.clear()
            _state.module_scopes.clear()
            _state.module_depth = 0
            _remove_module_hooks()
        elif frame.saved is not None:
            rules, mode.device_type, mode.cache_enabled = frame.saved
            mode.set_rules(rules)
        else:  # the mode was pushed inside this region's lifetime by a nested one: nothing to restore
            mode.activate(frames[-1])

    def __call__(self, func: F) -> F:
        @functools.wraps(func)
        def decorated(*args: Any, **kwargs: Any) -> Any:
            with self:
                return func(*args, **kwargs)

        return decorated  # type: ignore[return-value]

    def __repr__(self) -> str:
        return (
            f"mixprec.autocast({self.device_type!r}, dtype={self.fast_dtype}, enabled={self.enabled}, "
            f"policy='{self.policy}')"
        )


_hooks: list[Any] = []


def _install_module_hooks() -> None:
    if _hooks:
        return
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    _hooks.append(register_module_forward_pre_hook(_module_pre_hook))
    _hooks.append(register_module_forward_hook(_module_post_hook, always_call=True))


def _remove_module_hooks() -> None:
    while _hooks:
        _hooks.pop().remove()


# --------------------------------------------------------------------------- queries
def _innermost(device_type: str) -> _Frame | None:
    family = _family(device_type)
    for frame in reversed(_state.frames):
        if frame.device_type == family:
            return frame
    return None


def is_autocast_enabled(device_type: str = "cpu") -> bool:
    """Whether a mixprec autocast region is enabled for ``device_type`` on this thread."""
    frame = _innermost(device_type)
    return frame is not None and frame.enabled


def get_autocast_dtype(device_type: str = "cpu") -> torch.dtype:
    """The compute dtype of the innermost region on ``device_type`` (the device default outside one)."""
    frame = _innermost(device_type)
    if frame is None or frame.rules is None:
        return DEFAULT_DTYPES[_family(device_type)]
    return frame.rules.compute_dtype


# --------------------------------------------------------------------------- custom autograd functions
def custom_fwd(
    fwd: Callable | None = None, *, device_type: str | None = None, cast_inputs: torch.dtype | None = None
) -> Callable:
    """Decorate ``forward`` of a ``torch.autograd.Function`` (as ``torch.amp.custom_fwd``).

    Inside an enabled mixprec region: with ``cast_inputs``, floating tensors on the device are cast to
    it and ``forward`` runs with autocast disabled; without, ``forward`` runs under the current region
    and ``custom_bwd`` replays that state in ``backward``. Outside a region it is a no-op.

    Args:
        device_type: the device family; default: that of the innermost active region.
        cast_inputs: dtype to cast incoming floating tensors to, or None.
    """
    if fwd is None:
        return functools.partial(custom_fwd, device_type=device_type, cast_inputs=cast_inputs)

    @functools.wraps(fwd)
    def decorate_fwd(ctx: Any, *args: Any, **kwargs: Any) -> Any:
        frame = (
            _state.frames[-1]
            if device_type is None and _state.frames
            else (_innermost(device_type) if device_type is not None else None)
        )
        active = frame is not None and frame.enabled
        ctx._mixprec_autocast = (frame.device_type, frame.rules) if active else None  # type: ignore[union-attr]
        if not active or cast_inputs is None:
            return fwd(ctx, *args, **kwargs)
        ctx._mixprec_autocast = None
        family = frame.device_type  # type: ignore[union-attr]
        with autocast(family, enabled=False):
            args = tuple(_cast_inputs(a, cast_inputs, family) for a in args)
            kwargs = {k: _cast_inputs(v, cast_inputs, family) for k, v in kwargs.items()}
            return fwd(ctx, *args, **kwargs)

    return decorate_fwd


def _cast_inputs(value: Any, dtype: torch.dtype, device_type: str) -> Any:
    if isinstance(value, torch.Tensor):
        eligible = value.is_floating_point() and value.device.type == device_type and value.dtype != _FLOAT64
        return value.to(dtype) if eligible else value
    if isinstance(value, (list, tuple)):
        return _rebuild(value, [_cast_inputs(v, dtype, device_type) for v in value])
    if isinstance(value, dict):
        return {k: _cast_inputs(v, dtype, device_type) for k, v in value.items()}
    return value


def custom_bwd(bwd: Callable | None = None, *, device_type: str | None = None) -> Callable:
    """Decorate ``backward`` of a ``torch.autograd.Function``: run it under the forward's autocast state."""
    if bwd is None:
        return functools.partial(custom_bwd, device_type=device_type)

    @functools.wraps(bwd)
    def decorate_bwd(ctx: Any, *args: Any, **kwargs: Any) -> Any:
        saved = getattr(ctx, "_mixprec_autocast", None)
        if saved is None:
            family = device_type or (_state.frames[-1].device_type if _state.frames else "cpu")
            with autocast(family, enabled=False):
                return bwd(ctx, *args, **kwargs)
        family, rules = saved
        with autocast(family, policy=rules.policy, dtype=rules.compute_dtype):
            return bwd(ctx, *args, **kwargs)

    return decorate_bwd
