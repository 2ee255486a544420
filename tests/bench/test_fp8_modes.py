"""The bench's fp8 modes swap the model's Linear layers and train under bf16 autocast."""

from __future__ import annotations

import torch
from torch import nn

from mixprec.bench import MODES
from mixprec.float8 import Float8Linear


def test_fp8_modes_swap_linears_and_train() -> None:
    for name, scaling in (("fp8-dynamic", "dynamic"), ("fp8-delayed", "delayed")):
        torch.manual_seed(0)
        mode = MODES[name].create("cpu")
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        mode.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        assert all(isinstance(m, Float8Linear) for m in (model[0], model[2]))
        assert model[0].config.scaling == scaling
        x, y = torch.randn(8, 16), torch.randn(8, 4)
        before = model[0].weight.detach().clone()
        losses = [float(mode.train_step(x, y, lambda o, t: (o.float() - t).pow(2).mean())) for _ in range(3)]
        assert all(torch.isfinite(torch.tensor(losses)))
        assert not torch.equal(before, model[0].weight)  # the optimizer steps the swapped module's weight
        assert losses[-1] < losses[0]
