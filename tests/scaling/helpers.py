"""Shared test helpers: float32 reference arithmetic and a guard that fails on host syncs."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import numpy as np
import torch

SYNCING_METHODS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")


@contextlib.contextmanager
def no_host_sync() -> Iterator[None]:
    """Fail if code inside reads a tensor value on the host (the CPU stand-in for a device sync)."""
    saved = {name: getattr(torch.Tensor, name) for name in SYNCING_METHODS}

    def refuse(name: str):
        def method(self, *args, **kwargs):
            raise AssertionError(f"host sync: Tensor.{name}() called")

        return method

    try:
        for name in SYNCING_METHODS:
            setattr(torch.Tensor, name, refuse(name))
        yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


def f32(value: float) -> float:
    """Round to float32, as the scale tensor stores it."""
    return float(np.float32(value))


def found(flag: bool | float) -> torch.Tensor:
    """A found_inf tensor as the scaler builds it."""
    return torch.tensor(float(flag))


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (nan payloads and -0.0 included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_sparse:
        a, b = a.coalesce(), b.coalesce()
        return torch.equal(a.indices(), b.indices()) and bits_equal(a.values(), b.values())
    view = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
    return torch.equal(a.detach().view(view[a.dtype]), b.detach().view(view[b.dtype]))


def model_and_optimizer(optimizer=torch.optim.SGD, **kwargs):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    return model, optimizer(model.parameters(), lr=0.1, **kwargs)


def backward(scaler, model, poison=None):
    model.zero_grad()
    scaler.scale(model(torch.ones(4, 3)).square().mean()).backward()
    if poison is not None:
        model.weight.grad[0, 0] = poison


def snapshot(model, optimizer):
    params = [p.detach().clone() for p in model.parameters()]
    state = copy.deepcopy(optimizer.state_dict()["state"])
    return params, state


def assert_untouched(before, model, optimizer):
    params, state = before
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters(), strict=True))
    assert repr(optimizer.state_dict()["state"]) == repr(state)
