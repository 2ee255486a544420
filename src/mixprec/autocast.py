"""`mixprec.autocast`: run a region's ops in the precision a :class:`~mixprec.Policy` gives them.

The public region and its queries. How the engine works (one TorchFunctionMode per thread, the cast
cache, the op handlers) is described in :mod:`mixprec._engine`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from mixprec._engine import _AutocastMode, _Frame, _state
from mixprec._module_overrides import _hooks, _install_module_hooks, _remove_module_hooks
from mixprec.policy.policy import DEFAULT_DTYPES, Policy, _family

__all__ = ["autocast", "get_autocast_dtype", "is_autocast_enabled"]

F = TypeVar("F", bound=Callable[..., Any])


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
