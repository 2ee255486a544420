"""A tiny classifier trained by a plain ``lightning.fabric.Fabric`` loop on CPU.

``python _tiny_fabric.py OUT`` trains with Fabric's own ``precision="bf16-mixed"`` and with its own
``MixedPrecision("16-mixed")`` plugin (an inf batch included) in a process that never imports mixprec, and
saves the per-step losses, the final weights and the scale to OUT.
"""

from __future__ import annotations

import sys
from typing import Any

import lightning as L
import torch
from torch import nn

BATCH, STEPS, FEATURES, CLASSES, INF_BATCH = 8, 20, 16, 4, 6


def loader(inf: bool) -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(STEPS * BATCH, FEATURES, generator=generator)
    y = torch.randint(0, CLASSES, (STEPS * BATCH,), generator=generator)
    if inf:
        x[INF_BATCH * BATCH, 3] = float("inf")
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)


def train(fabric: L.Fabric, inf: bool = False) -> dict[str, Any]:
    """STEPS steps of AdamW; returns losses, weights after each step, the final state and the scale."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, CLASSES))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    losses, weights = [], []
    for x, y in loader(inf):
        loss = nn.functional.cross_entropy(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach().float().clone())
        weights.append(model.module[0].weight.detach().clone())
    scaler = fabric._precision.scaler
    return {
        "losses": torch.stack(losses),
        "weights": weights,
        "state": {k: v.detach().clone() for k, v in model.module.state_dict().items()},
        "scale": None if scaler is None else float(scaler.get_scale()),
    }


def fabric(**kwargs: Any) -> L.Fabric:
    return L.Fabric(accelerator="cpu", devices=1, **kwargs)


if __name__ == "__main__":
    from lightning.fabric.plugins import MixedPrecision

    torch.set_num_threads(1)
    runs = {
        "bf16": train(fabric(precision="bf16-mixed")),
        "16": train(fabric(plugins=[MixedPrecision("16-mixed", "cpu")]), inf=True),
    }
    torch.save(runs, sys.argv[1])
