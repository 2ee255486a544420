"""Lightning with mixprec: a policy with a pinned module, fp16 loss scaling with hysteresis, diagnostics.

python examples/lightning_mixprec.py

A small classifier on synthetic data, one epoch of 40 steps on CPU in float16; batch 10 holds an inf,
so one step is skipped and explained. Prints the loss before and after, the scaler's counters and the
diagnosis.
"""

import logging

import lightning as L
import torch
from torch import nn

import mixprec
from mixprec.integrations.lightning import MixprecDiagnostics, MixprecPrecision


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(20, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU())
        self.head = nn.Linear(64, 3)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.head(self.body(x)), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def data(steps: int = 40, batch: int = 32) -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(steps * batch, 20, generator=generator)
    y = (x[:, :3] * torch.tensor([1.0, -2.0, 0.5])).argmax(dim=1)  # a learnable rule
    x[10 * batch, 0] = float("inf")  # one bad sample in batch 10
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch)


def mean_loss(model: Classifier, loader: torch.utils.data.DataLoader) -> float:
    with torch.no_grad():
        losses = [nn.functional.cross_entropy(model.head(model.body(x)), y) for x, y in loader]
    return torch.stack([loss for loss in losses if torch.isfinite(loss)]).mean().item()


def main() -> None:
    logging.getLogger("lightning").setLevel(logging.ERROR)
    torch.manual_seed(0)
    model, loader = Classifier(), data()
    policy = mixprec.Policy.preset("16-mixed").with_modules({"head": torch.float32})
    plugin = MixprecPrecision("16-mixed", policy=policy, scaler=mixprec.GradScaler(hysteresis=2))
    diagnostics = MixprecDiagnostics()
    trainer = L.Trainer(
        max_epochs=1, accelerator="cpu", plugins=[plugin], callbacks=[diagnostics], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    before = mean_loss(model, loader)
    trainer.fit(model, loader)
    print(f"loss {before:.4f} -> {mean_loss(model, loader):.4f}")
    metrics = trainer.logged_metrics
    print(f"loss_scale {metrics['loss_scale']:g}, skipped_steps {metrics['skipped_steps']:g}")
    print("diagnosis:", *diagnostics.diagnoses)


if __name__ == "__main__":
    main()
