"""A tiny MLP trained by a plain Accelerate loop on CPU.

Shared by the tests and by the oracle: ``python _tiny_accelerate.py OUT`` trains with Accelerate's own
``mixed_precision="bf16"`` in a process that never imports mixprec, and saves the per-step losses and the
final weights to OUT.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from accelerate import Accelerator
from torch import nn

BATCH, STEPS, FEATURES, CLASSES = 8, 20, 16, 4


def make_model() -> nn.Module:
    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(FEATURES, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 32), nn.ReLU())
    return nn.Sequential(body, nn.Linear(32, CLASSES))


def loader(inf_batches: tuple[int, ...] = ()) -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(STEPS * BATCH, FEATURES, generator=generator)
    y = torch.randint(0, CLASSES, (STEPS * BATCH,), generator=generator)
    for index in inf_batches:
        x[index * BATCH, 3] = float("inf")
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)


def train(
    accelerator: Accelerator, inf_batches: tuple[int, ...] = (), fused: bool = False, after_step: Any = None
):
    """The loop from Accelerate's docs; returns (model, optimizer, scheduler, per-step losses)."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / STEPS)
    model, optimizer, data, scheduler = accelerator.prepare(model, optimizer, loader(inf_batches), scheduler)
    losses = []
    for x, y in data:
        loss = nn.functional.cross_entropy(model(x), y)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 10.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.detach().clone())
        if after_step is not None:
            after_step(model, (x, y), loss)
    return model, optimizer, scheduler, torch.stack(losses)


def result(model: nn.Module, losses: torch.Tensor) -> dict[str, Any]:
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


if __name__ == "__main__":
    torch.set_num_threads(1)
    model, _, _, losses = train(Accelerator(mixed_precision="bf16", cpu=True))
    torch.save(result(model, losses), sys.argv[1])
