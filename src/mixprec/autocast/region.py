"""`mixprec.autocast`: a torch.autocast region that applies an editable :class:`~mixprec.Policy`.

The region is a subclass of ``torch.autocast`` and *is* torch's autocast state while it runs; the
engine (:mod:`mixprec.autocast.engine`) adds what a policy changes. See docs/architecture.md for why.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from mixprec.autocast import pins
from mixprec.autocast.engine import _DeviationMode, _Frame, _state
from mixprec.policy.names import as_dtype, has_catalogue
from mixprec.policy.policy import DEFAULT_DTYPES, Policy, ResolvedPolicy, _family, check_policy

__all__ = ["autocast", "get_autocast_dtype", "is_autocast_enabled"]


def _settings(
    device_type: object, dtype: object, enabled: object, policy: object, cache_enabled: object = None
) -> tuple[str, bool, Policy, ResolvedPolicy | None]:
    """Validate a region's arguments: (device family, enabled, policy, rules or None when disabled)."""
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}: {enabled!r}")
    if dtype is not None:
        dtype = as_dtype(dtype, "dtype")  # type: ignore[arg-type]  # as_dtype checks the type
    if cache_enabled is not None and not isinstance(cache_enabled, bool):
        raise TypeError(
            f"cache_enabled must be a bool or None, got {type(cache_enabled).__name__}: {cache_enabled!r}"
        )
    family = _family(device_type)
    policy = check_policy(policy)
    lists = family if has_catalogue(family) else None  # elsewhere: torch's own lists and dtype rules
    if not enabled:
        return family, False, policy or Policy(device_type=lists), None
    if policy is None:
        policy = Policy.for_device(family, dtype) if lists else Policy()
    elif dtype is not None and policy.compute_dtype is not None and policy.compute_dtype != dtype:
        raise ValueError(
            f"dtype={dtype} conflicts with the policy's compute dtype {policy.compute_dtype}; "
            "give one of them"
        )
    return family, True, policy, policy.resolve(family, dtype)  # resolving validates the dtype


def _native_dtype(rules: ResolvedPolicy | None) -> torch.dtype | None:
    """The dtype torch's own autocast runs in for these rules, or None when it stays off (a disabled
    region, or an fp32 compute dtype: a pin, which torch would refuse with a warning)."""
    if rules is None or (rules.compute_dtype is torch.float32 and has_catalogue(rules.device_type)):
        return None
    return rules.compute_dtype  # elsewhere torch's own dtype rules decide (it warns and turns off)


def _needs_engine(rules: ResolvedPolicy | None) -> bool:
    """Whether a region needs more than torch's own autocast state (deviations or module pins)."""
    return rules is not None and bool(rules.deviations or rules.policy.module_overrides)


class autocast(torch.amp.autocast_mode.autocast):
    """Context manager and decorator: ``torch.autocast`` driven by a :class:`~mixprec.Policy`.

    Drop-in for ``torch.autocast`` with the same signature and defaults, plus ``policy``. Inside an
    enabled region ``torch.is_autocast_enabled(device_type)`` is True and torch's own autocast kernels
    cast the ops on torch's lists; what the policy changes (ops moved between lists, modules pinned to
    a dtype) is applied on top. With the default policy a region is exactly ``torch.autocast``.

    Beyond torch.autocast: a nested region of another dtype never gets a cast cached by the outer one,
    and after an optimizer step inside a region every later use of a weight casts afresh until the
    region exits (bitwise as ``cache_enabled=False``), so the next forward sees new weights.

    Args:
        device_type: "cpu" or "cuda" (a ``torch.device`` or "cuda:0" is accepted too), or any other
            type torch.autocast takes ("mps", "xpu", "hpu", "xla", ...): there the region is torch's
            autocast state alone, with torch's dtype rules and warnings, and only an unedited policy.
        dtype: the low-precision dtype, a ``torch.dtype`` or a name such as "bf16", "fp16", "half"
            (the names :meth:`mixprec.Policy.parse` takes); default: the policy's compute dtype, else
            bfloat16 on CPU and float16 on CUDA. Any dtype is accepted when ``enabled=False`` (as torch).
        enabled: False makes the region a no-op (and disables autocast inside an enabled region).
        cache_enabled: cache casts of fp32 leaf parameters in the region (default True, as torch).
        policy: a :class:`~mixprec.Policy`, a preset name ("bf16-mixed", "conservative", ...) or a
            ``"params=...,compute=..."`` string. Default: ``Policy.for_device(device_type, dtype)``.

    Raises:
        TypeError: for a non-bool ``enabled``, a ``dtype`` that is neither a dtype nor a str, or a policy of
            another type.
        ValueError: for a device type torch.autocast does not take, an unknown dtype name (the message
            lists the accepted ones), an unsupported dtype in an enabled
            region on "cpu"/"cuda" (e.g. float64, int8: unlike torch, mixprec does not silently disable
            itself there), or a policy with op edits or module pins on a device without a catalogue.
    """

    def __new__(
        cls,
        device_type: str | torch.device,
        dtype: torch.dtype | str | None = None,
        enabled: bool = True,
        cache_enabled: bool | None = None,
        *,
        policy: Policy | str | None = None,
    ) -> Any:
        if not torch.compiler.is_compiling():
            return super().__new__(cls)
        # Traced by torch.compile: a region that needs no engine is torch.autocast itself, which dynamo
        # traces natively (graph breaks inside included). One that needs the engine cannot be traced.
        family, _, policy, rules = _settings(device_type, dtype, enabled, policy, cache_enabled)
        if _needs_engine(rules):
            raise RuntimeError(
                f"torch.compile cannot trace a mixprec.autocast region whose policy changes torch's op "
                f"lists or pins modules ({policy}); enter the region outside the compiled function "
                "(with mixprec.autocast(...): compiled_model(x)): the compiled code then follows it"
            )
        native = _native_dtype(rules)
        on = native is not None
        return torch.amp.autocast(family, dtype=native, enabled=on, cache_enabled=cache_enabled)

    def __init__(
        self,
        device_type: str | torch.device,
        dtype: torch.dtype | str | None = None,
        enabled: bool = True,
        cache_enabled: bool | None = None,
        *,
        policy: Policy | str | None = None,
    ) -> None:
        family, enabled, policy, rules = _settings(device_type, dtype, enabled, policy, cache_enabled)
        compute = rules.compute_dtype if rules is not None else None  # a disabled region keeps torch's
        native = _native_dtype(rules)
        super().__init__(family, dtype=native, enabled=native is not None, cache_enabled=cache_enabled)
        # torch disables a "cuda" region without CUDA (with its warning): so does mixprec.
        self.enabled = enabled and (self._enabled or native is None)
        self.device_type = family
        self.policy: Policy = policy
        self._rules = rules if self.enabled else None
        self.fast_dtype = compute if self.enabled and compute is not None else self.fast_dtype
        self.cache_enabled = self._cache_enabled
        # torch's saved state and the entering thread, per entry: re-entrant
        self._entries: list[tuple[Any, Any, Any, int]] = []
        self._replay_names: dict[int, str] | None = None  # a replayed region keeps its root's names

    @classmethod
    def current(cls) -> autocast | None:
        """A region that re-enters the mixprec state in force now on this thread, or None.

        It carries the rules active at this point (a pinned module's included), so code recomputed
        later, e.g. by activation checkpointing during backward, runs in the same dtypes.
        """
        frames = _state.frames
        if not frames:
            return None
        frame = frames[-1]
        mode = _state.mode
        rules = mode.rules if mode is not None and mode.rules is not None else frame.rules
        if rules is None or not frame.enabled:
            return cls(frame.device_type, enabled=False)
        region = cls(frame.device_type, dtype=rules.compute_dtype, policy=rules.policy)
        region._replay_names = dict(_state.names) if _state.depth else None
        return region

    def __enter__(self) -> autocast:  # type: ignore[override]
        dev = self.device_type
        outer_dtype, outer_on = torch.get_autocast_dtype(dev), torch.is_autocast_enabled(dev)
        # (a region inside a pinned or disabled part still shares torch's cache with the outer region)
        super().__enter__()
        self._entries.append((self.prev, self.prev_fastdtype, self.prev_cache_enabled, threading.get_ident()))
        frame = _Frame(dev, self.enabled, self._rules, self._cache_enabled)
        # torch keys its cast cache by tensor only: a nested region of another dtype must not be served
        # the outer region's casts (torch raises "expected ... same dtype" there).
        if self.enabled and outer_dtype != self.fast_dtype and (outer_on or _state.frames):
            torch.clear_autocast_cache()
            frame.cleared_cache = True
        if self._replay_names is not None and not _state.frames:
            # A recompute: qualified names stay those of the original root, not the first module called.
            _state.names, _state.depth = dict(self._replay_names), 1
        _state.frames.append(frame)
        rules = self._rules
        mode = _state.mode
        if rules is not None and (rules.deviations or pins.has_policy_pins(rules.policy)) and mode is None:
            mode = _state.mode = _DeviationMode(dev)
            mode.__enter__()
            frame.pushed_mode = True
        if mode is not None:
            frame.saved_rules = mode.rules
            mode.set_rules(rules)
        if rules is not None and rules.policy.module_overrides:
            pins.HOOKS.acquire()
            frame.holds_pins = True
        pins.HOOKS.watch_optimizers()
        return self

    def __exit__(self, *exc: object) -> None:  # type: ignore[override]
        self._check_same_thread()
        frame = _state.frames.pop()
        mode = _state.mode
        if frame.pushed_mode and mode is not None:
            mode.__exit__(None, None, None)
            _state.mode = None
        elif mode is not None:
            mode.set_rules(frame.saved_rules)
        if frame.holds_pins:
            pins.HOOKS.release()
        if not _state.frames:
            _state.cache.clear()
            _state.names.clear()
            _state.depth = 0
        if frame.cleared_cache:
            torch.clear_autocast_cache()
        self.prev, self.prev_fastdtype, self.prev_cache_enabled, _ = self._entries.pop()
        super().__exit__(*exc)

    def _check_same_thread(self) -> None:
        """RuntimeError, changing nothing, unless this thread entered the region and has not exited it.

        A region's state (mixprec's frames and torch's autocast state alike) belongs to the thread that
        entered it; another thread cannot restore it.
        """
        if not self._entries:
            raise RuntimeError(f"{self!r} exited without being entered")
        entered, here = self._entries[-1][3], threading.get_ident()
        if entered != here or not _state.frames:
            raise RuntimeError(
                f"{self!r} was entered in thread {entered} and exited in thread {here}: a region's state "
                "(torch's autocast state too) belongs to the thread that entered it, so enter and exit it "
                "in the same thread (one region per thread, each inside its own thread's code)"
            )

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
    """Whether a mixprec region is enabled for ``device_type`` on this thread (torch's own state is
    ``torch.is_autocast_enabled``, which a mixprec region sets too)."""
    frame = _innermost(device_type)
    return frame is not None and frame.enabled


def get_autocast_dtype(device_type: str = "cpu") -> torch.dtype:
    """The compute dtype of the innermost mixprec region on ``device_type`` (the device default outside)."""
    frame = _innermost(device_type)
    if frame is None or frame.rules is None:
        family = _family(device_type)
        return DEFAULT_DTYPES[family] if has_catalogue(family) else torch.get_autocast_dtype(family)
    return frame.rules.compute_dtype
