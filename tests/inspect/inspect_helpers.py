"""Snapshots of everything a diagnostic must leave as it found it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.modules.module as module_globals
from torch import nn

GLOBAL_REGISTRIES = (
    "_global_forward_hooks",
    "_global_forward_pre_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
    "_global_forward_hooks_always_called",
    "_global_forward_hooks_with_kwargs",
    "_global_module_registration_hooks",
    "_global_parameter_registration_hooks",
    "_global_buffer_registration_hooks",
)
MODULE_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_forward_hooks_always_called",
    "_forward_hooks_with_kwargs",
    "_forward_pre_hooks_with_kwargs",
    "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
)


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@dataclass
class Snapshot:
    state: dict[str, bytes]
    grads: list[tuple[torch.Tensor | None, bytes | None]]
    training: list[bool]
    hooks: list[dict[str, int]]
    param_hooks: list[Any]
    registries: dict[str, int]
    rng: torch.Tensor
    modes: int


def snapshot(model: nn.Module) -> Snapshot:
    return Snapshot(
        state={k: _bits(v) for k, v in model.state_dict().items()},
        grads=[(p.grad, None if p.grad is None else _bits(p.grad)) for p in model.parameters()],
        training=[m.training for m in model.modules()],
        hooks=[{name: len(getattr(m, name)) for name in MODULE_HOOK_DICTS} for m in model.modules()],
        param_hooks=[p._backward_hooks for p in model.parameters()],
        registries={name: len(getattr(module_globals, name)) for name in GLOBAL_REGISTRIES},
        rng=torch.random.get_rng_state(),
        modes=torch._C._len_torch_function_stack(),
    )


def assert_restored(model: nn.Module, before: Snapshot) -> None:
    after = snapshot(model)
    assert after.state == before.state, "parameters or buffers changed"
    for (grad_before, bits_before), p in zip(before.grads, model.parameters(), strict=True):
        assert p.grad is grad_before, "a .grad was replaced"
        assert (None if p.grad is None else _bits(p.grad)) == bits_before, "a .grad changed"
    assert after.training == before.training
    assert after.hooks == before.hooks, "module hooks left behind"
    assert [bool(h) for h in after.param_hooks] == [bool(h) for h in before.param_hooks]
    assert after.registries == before.registries, "global hook registries changed"
    assert torch.equal(after.rng, before.rng), "the RNG state moved"
    assert after.modes == before.modes, "a torch function mode was left on the stack"


def assert_no_hooks(model: nn.Module) -> None:
    for m in model.modules():
        for name in MODULE_HOOK_DICTS[:6]:
            assert not getattr(m, name), f"{type(m).__name__}.{name} is not empty"
    for name in GLOBAL_REGISTRIES:
        assert not getattr(module_globals, name), f"torch.nn.modules.module.{name} is not empty"
    assert torch._C._len_torch_function_stack() == 0
