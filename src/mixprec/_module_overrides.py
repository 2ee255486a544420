"""Module overrides for the autocast engine: which module is running, and its rules while it runs.

Global forward pre/post hooks, installed only while a region whose policy has module overrides is
active. Qualified names are relative to the first module called in the region (the root).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mixprec._engine import _ModuleScope, _rebuild, _state
from mixprec.policy.policy import Policy


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
