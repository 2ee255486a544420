"""A tiny LightningModule trained by Lightning's real Trainer on CPU.

Shared by the tests and by the oracle: ``python _tiny_lightning.py OUT`` trains with Lightning's own
``precision="bf16-mixed"`` in a process that never imports mixprec (a mixprec engine may register
process-wide kernels), and saves the per-step losses and the final weights to OUT.
"""

from __future__ import annotations

import logging
import sys
import warnings
from typing import Any

import lightning as L
import torch
from torch import nn

BATCH, STEPS, FEATURES, CLASSES = 8, 20, 16, 4

logging.getLogger("lightning").setLevel(logging.ERROR)
warnings.filterwarnings("ignore", module="lightning")


class Tiny(L.LightningModule):
    """body (Linear-GELU-LayerNorm-Linear) then head (Linear); records each step's loss."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(FEATURES, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 32))
        self.head = nn.Linear(32, CLASSES)
        self.losses: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.losses.append(loss.detach().float().clone())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def make_model() -> Tiny:
    torch.manual_seed(0)
    return Tiny()


def loader(inf_batches: tuple[int, ...] = (), batches: int = STEPS) -> torch.utils.data.DataLoader:
    """``batches`` fixed batches in order; those at the (0-based) ``inf_batches`` hold an inf input."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batches * BATCH, FEATURES, generator=generator)
    y = torch.randint(0, CLASSES, (batches * BATCH,), generator=generator)
    for index in inf_batches:
        x[index * BATCH, 3] = float("inf")
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)


def trainer(**kwargs: Any) -> L.Trainer:
    settings: dict[str, Any] = dict(
        max_steps=STEPS,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return L.Trainer(**{**settings, **kwargs})


def result(model: Tiny) -> dict[str, Any]:
    return {
        "losses": torch.stack(model.losses),
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
    }


if __name__ == "__main__":
    torch.set_num_threads(1)
    model = make_model()
    trainer(precision="bf16-mixed").fit(model, loader())
    torch.save(result(model), sys.argv[1])
