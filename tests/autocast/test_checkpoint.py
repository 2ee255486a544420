"""Activation checkpointing inside a mixprec region recomputes in the forward's dtypes."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointError

import mixprec
from mixprec import Policy


def block() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8), nn.LayerNorm(8))


@pytest.mark.parametrize(
    "policy", [None, Policy.for_device("cpu").with_ops(fp32=["gelu"])], ids=["default", "edited"]
)
def test_gradients_equal_the_uncheckpointed_run(policy: Policy | None) -> None:
    model, twin = block(), block()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2), requires_grad=True)
    with mixprec.autocast("cpu", policy=policy):
        out = mixprec.checkpoint(model, x)
    out.float().sum().backward()
    with mixprec.autocast("cpu", policy=policy):
        ref = twin(x)
    ref.float().sum().backward()
    assert out.dtype == ref.dtype == torch.bfloat16
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)


@pytest.mark.parametrize("reentrant", [False, True])
def test_torch_checkpoint_in_a_region_equals_torch_autocast(reentrant: bool) -> None:
    """A region is torch's autocast state, so torch's own checkpoint replays it on recompute."""
    grads = []
    for region in (mixprec.autocast("cpu"), torch.autocast("cpu", dtype=torch.bfloat16)):
        model = block()
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2), requires_grad=True)
        with region:
            out = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=reentrant)
        out.float().sum().backward()
        grads.append([p.grad for p in model.parameters()] + [x.grad])
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


def test_edited_policy_with_torch_checkpoint_needs_mixprec_checkpoint() -> None:
    """torch's recompute re-enters torch.autocast only: an edited op is recomputed in torch's dtype and
    the non-reentrant checkpoint says so loudly; mixprec.checkpoint replays the policy."""
    policy = Policy.for_device("cpu").with_ops(fp32=["linear"])
    x = torch.randn(4, 8, requires_grad=True)
    with mixprec.autocast("cpu", policy=policy):
        out = torch.utils.checkpoint.checkpoint(block(), x, use_reentrant=False)
    with pytest.raises(CheckpointError, match="different metadata"):
        out.float().sum().backward()


def test_outside_a_region_it_is_torch_checkpoint() -> None:
    model, twin = block(), copy.deepcopy(block())
    x = torch.randn(4, 8)
    mixprec.checkpoint(model, x).sum().backward()
    twin(x).sum().backward()
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)


def test_reentrant_is_refused() -> None:
    with pytest.raises(ValueError, match="use_reentrant=False only"):
        mixprec.checkpoint(block(), torch.randn(2, 8), use_reentrant=True)


class _Blocks(nn.Module):
    """Checkpoints each block from inside its own forward, as HF models do."""

    def __init__(self, **checkpoint_kwargs: object) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(block() for _ in range(2))
        self.kwargs = checkpoint_kwargs

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            h = torch.utils.checkpoint.checkpoint(b, h, **self.kwargs) if self.kwargs else b(h)
        return h


def test_context_fn_replays_an_edited_policy_and_a_named_pin() -> None:
    policy = Policy.for_device("cpu").with_ops(lower=["layer_norm"]).with_modules({"blocks.1": torch.float32})
    grads = []
    for kwargs in ({}, {"use_reentrant": False, "context_fn": mixprec.autocast_context_fn}):
        model = _Blocks(**kwargs)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2), requires_grad=True)
        with mixprec.autocast("cpu", policy=policy):
            out = model(x)
        out.float().sum().backward()
        grads.append([p.grad for p in model.parameters()] + [x.grad])
    assert out.dtype == torch.float32  # blocks.1 pinned: its layer_norm ran in fp32
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)
