"""Module pins (``Policy.with_modules``): a module runs in its own dtype while it runs.

A pinned module switches torch's autocast state for its forward: pinned to float32 it runs with
autocast off and its floating inputs (positional and keyword) cast up to float32 on entry, as HF's
``_keep_in_fp32_modules`` and apex's fp32 BatchNorm mean it; pinned to a low dtype it runs autocast in
that dtype; pinned to a Policy it runs that policy's rules and its outputs are cast to the policy's
``output_dtype``. torch.amp.custom_fwd/custom_bwd inside a pinned module therefore record, and replay in
backward, the pinned state.

Which module is which: qualified names are relative to the first module called in the region (the
root). Process-wide forward hooks find the root, and the pinned modules get per-module hooks; both read
only the calling thread's state. All of it is the process-wide state of :data:`HOOKS`, its one owner.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from mixprec.autocast.engine import _PinScope, _state, cast_floating
from mixprec.policy.policy import Policy


class _ProcessHooks:
    """The autocast engine's process-wide state: the hooks torch calls for every module and optimizer.

    Everything else the engine keeps is per thread (``engine._state``). This object holds, under one lock:

    - ``users``: how many regions with module pins are open, in any thread;
    - the root hooks (torch's global module forward pre/post hooks): installed when ``users`` goes from 0
      to 1, removed when it returns to 0, so one thread's region never removes hooks another relies on;
    - ``armed``: every user module given pin hooks, with those hooks (weakly keyed: a module that is
      garbage-collected drops out). A module is armed the first time a region with pins runs it, and
      keeps its two hooks afterwards: a recompute under ``torch.utils.checkpoint`` replays a region from
      inside the root, where the root hook cannot arm it again. The hooks act only while the calling
      thread's region pins the module; :meth:`disarm` removes them all (no region with pins may be open);
    - one optimizer step post-hook, installed by the first region and kept for the process (torch offers
      no per-thread hook): after a step inside a region it drops that thread's cast cache, so the next
      forward sees the new weights; outside a mixprec region it does nothing.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.users = 0
        self.root_handles: list[Any] = []
        self.armed: weakref.WeakKeyDictionary[nn.Module, list[Any]] = weakref.WeakKeyDictionary()
        self.optimizer_handle: Any = None

    def acquire(self) -> None:
        """Count one more region with pins; install the root hooks for the first."""
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        with self.lock:
            self.users += 1
            if self.users == 1:
                self.root_handles.append(register_module_forward_pre_hook(_root_pre_hook))  # type: ignore[arg-type]
                self.root_handles.append(register_module_forward_hook(_root_post_hook, always_call=True))

    def release(self) -> None:
        """Count one region fewer; with the last, remove the root hooks."""
        with self.lock:
            self.users -= 1
            if self.users == 0:
                while self.root_handles:
                    self.root_handles.pop().remove()

    def disarm(self) -> None:
        """Remove every module's pin hooks, e.g. before pickling a model or handing it elsewhere.

        Raises:
            RuntimeError: while a region with pins is open in any thread (it relies on them).
        """
        with self.lock:
            if self.users:
                raise RuntimeError(f"{self.users} region(s) with module pins are open; exit them first")
            for handles in list(self.armed.values()):
                for handle in handles:
                    handle.remove()
            self.armed.clear()

    def arm(self, module: nn.Module) -> bool:
        """Give ``module`` its pin hooks unless it has them; whether this call added them."""
        with self.lock:
            if module in self.armed:
                return False
            self.armed[module] = [
                module.register_forward_pre_hook(_pin_pre_hook, with_kwargs=True),
                module.register_forward_hook(_pin_post_hook, always_call=True),
            ]
            return True

    def watch_optimizers(self) -> None:
        """Install (once) the optimizer-step hook."""
        if self.optimizer_handle is not None:
            return
        with self.lock:
            if self.optimizer_handle is None:
                self.optimizer_handle = register_optimizer_step_post_hook(_after_optimizer_step)


#: The one owner of the engine's process-wide state.
HOOKS = _ProcessHooks()


def has_policy_pins(policy: Policy) -> bool:
    """Whether a pin gives a module a whole Policy (whose op rules the deviation mode must apply)."""
    return any(isinstance(value, Policy) for _, value in policy.module_overrides)


def _after_optimizer_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    """An optimizer step inside a mixprec region: from here to the region's exit every use of a weight
    casts afresh, bitwise as ``cache_enabled=False`` would (a second use of one cached cast sums its
    gradients in the low dtype before the cast back; separate casts sum them in fp32).

    torch's cast cache cannot drop single tensors, so it is cleared and switched off for the rest of the
    region (torch.autocast's exit restores the flag); casts before the step stay cached, as torch does.
    Threads without a mixprec frame, plain torch.autocast users, keep torch's behaviour.
    """
    if _state.frames:
        torch.clear_autocast_cache()
        torch.set_autocast_cache_enabled(False)
        _state.cache.clear()


def _region() -> Any:
    frames = _state.frames
    if not frames or not frames[-1].enabled or frames[-1].rules is None:
        return None
    return frames[-1]


def _root_pre_hook(module: nn.Module, args: tuple) -> tuple | None:
    frame = _region()
    if frame is None:
        return None
    _state.depth += 1
    if _state.depth > 1:
        return None
    _state.names = {id(m): name for name, m in module.named_modules()}
    if not _arm(module, frame.rules.policy):
        return None
    # The root was armed just now: torch has already listed this call's hooks, so pin it here.
    pinned = _pin_pre_hook(module, args, {})
    return None if pinned is None else pinned[0]


def _root_post_hook(module: nn.Module, args: tuple, output: Any) -> None:
    if _region() is not None:
        _state.depth = max(0, _state.depth - 1)


def _arm(root: nn.Module, policy: Policy) -> bool:
    """Give every module of ``root`` the policy pins the per-module hooks (once per module).

    Returns whether ``root`` itself was armed by this call.
    """
    root_armed = False
    if not policy.module_overrides:
        return False
    for name, module in root.named_modules():
        if module not in HOOKS.armed and policy.module_override(module, name) is not None:
            added = HOOKS.arm(module)
            root_armed = root_armed or (added and module is root)
    return root_armed


def _pin_pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    frame = _region()
    if frame is None:
        return None
    dev = frame.device_type
    if not torch.is_autocast_enabled(dev) and not _state.scopes:  # an island: torch.autocast(enabled=False)
        return None
    override = frame.rules.policy.module_override(module, _state.names.get(id(module), ""))
    if override is None:
        return None
    mode = _state.mode
    scope = _PinScope(
        module,
        dev,
        torch.is_autocast_enabled(dev),
        torch.get_autocast_dtype(dev),
        mode.rules if mode is not None else None,
        override.output_dtype if isinstance(override, Policy) else None,
    )
    _state.scopes.append(scope)
    rules = (
        override.resolve(dev) if isinstance(override, Policy) else frame.rules.policy.resolve(dev, override)
    )
    dtype = rules.compute_dtype
    if mode is not None:
        mode.set_rules(None if dtype is torch.float32 else rules)
    if dtype is torch.float32:
        torch.set_autocast_enabled(dev, False)
        return cast_floating(args, torch.float32, dev), cast_floating(kwargs, torch.float32, dev)
    if scope.saved_enabled and dtype != scope.saved_dtype:
        torch.clear_autocast_cache()  # torch's cache is keyed by tensor only, not by dtype
        scope.cleared_cache = True
    torch.set_autocast_enabled(dev, True)
    torch.set_autocast_dtype(dev, dtype)
    return None


def _pin_post_hook(module: nn.Module, args: tuple, output: Any) -> Any:
    scopes = _state.scopes
    if not scopes or scopes[-1].module is not module:
        return None
    scope = scopes.pop()
    torch.set_autocast_enabled(scope.device_type, scope.saved_enabled)
    torch.set_autocast_dtype(scope.device_type, scope.saved_dtype)
    if scope.cleared_cache:
        torch.clear_autocast_cache()
    mode = _state.mode
    if mode is not None:
        mode.set_rules(scope.saved_rules)
    if scope.output_dtype is None:
        return None
    return cast_floating(output, scope.output_dtype, scope.device_type)
