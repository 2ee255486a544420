"""Small models built to fail in known places: the examples behind ``mixprec inspect`` and the tests.

Every model is a :class:`DemoNet` (``blocks.0`` ... ``blocks.3``, each ``fc`` + ``act``, then ``head``)
with deterministic weights; the builders change one module so that float16 breaks exactly there.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

WIDTH = 32


class Block(nn.Module):
    """``act(fc(x))``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


class DemoNet(nn.Module):
    """Four :class:`Block` s and a linear head to one output."""

    def __init__(self, width: int = WIDTH, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _fc(model: DemoNet, index: int) -> nn.Linear:
    """The linear layer of block ``index`` (typed: ModuleList indexing gives a plain Module)."""
    block = model.blocks[index]
    assert isinstance(block, Block)
    return block.fc


def healthy_model(seed: int = 0) -> DemoNet:
    """Default-initialised weights: finite everywhere in float16."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        return DemoNet()
    finally:
        torch.random.set_rng_state(generator_state)


def demo_inputs(batch: int = 8, seed: int = 1) -> torch.Tensor:
    """A fixed batch of standard-normal inputs."""
    return torch.randn(batch, WIDTH, generator=torch.Generator().manual_seed(seed))


def forward_overflow_model() -> DemoNet:
    """``blocks.2.fc`` has weights of 30000: its outputs exceed float16's 65504 in the forward pass."""
    model = healthy_model()
    with torch.no_grad():
        _fc(model, 2).weight.fill_(30000.0)
    return model


def backward_overflow_model() -> DemoNet:
    """Finite forward in float16, but ``blocks.1.fc``'s input gradient overflows under a loss scale of 2^12.

    ``blocks.0`` outputs 1e-6 everywhere, so ``blocks.1.fc`` (weights of 30000) gives moderate outputs in
    forward; in backward its weights multiply the gradient flowing in by 30000 per element.
    """
    model = healthy_model()
    with torch.no_grad():
        _fc(model, 0).weight.zero_()
        _fc(model, 0).bias.fill_(1e-6)
        _fc(model, 1).weight.fill_(30000.0)
        _fc(model, 1).bias.zero_()
    return model


def scaled_loss(scale: float) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    """``loss_fn(model, x) = scale * mean(model(x)^2)`` in float32 (a loss multiplied by a loss scale)."""

    def loss_fn(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x).float().square().mean() * scale

    return loss_fn


def tiny_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A loss with gradients of 1e-10 to 4e-5: mostly subnormal or zero in float16 unless scaled."""
    return model(x).float().square().mean() * 1e-4


class OutlierMLP(nn.Module):
    """A 64 -> 128 -> 128 -> 128 -> 10 ReLU MLP whose third layer ``fc3`` is fed one input channel 300x the
    others (its weight column divided by 300, so the fp32 function is unchanged): one outlier feature sets
    every per-tensor or per-row scale of that layer's input. The planner's and the low-bit report's case
    of a layer a 4-bit format hurts."""

    def __init__(self, features: int = 64, hidden: int = 128, classes: int = 10) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(features, hidden), nn.Linear(hidden, hidden)
        self.fc3, self.head = nn.Linear(hidden, hidden), nn.Linear(hidden, classes)
        gain = torch.ones(hidden)
        gain[0] = 300.0
        self.gain: torch.Tensor
        self.register_buffer("gain", gain)
        with torch.no_grad():
            self.fc3.weight[:, 0] /= 300.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.fc2(torch.relu(self.fc1(x.flatten(1))))) * self.gain
        return self.head(torch.relu(self.fc3(x)))
