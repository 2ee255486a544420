"""LightningModules with manual optimization, trained by Lightning's real Trainer on CPU.

``Manual``: one optimizer and a StepLR scheduler stepped in ``training_step``; ``Gan``: a generator and a
discriminator, two optimizers, ``training_step`` returning None. ``python _tiny_lightning_manual.py OUT``
trains both with Lightning's own precision (``16-mixed`` with an inf batch, ``bf16-mixed``) in a process
that never imports mixprec, and saves what the tests compare to OUT.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from tests.integrations import _tiny_lightning as tiny

INF_BATCH = 5  # 0-based


class Manual(tiny.Tiny):
    """Tiny, optimized by hand: ``manual_backward``, ``opt.step()``, ``sch.step()`` each batch."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        opt, sch = self.optimizers(), self.lr_schedulers()
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.losses.append(loss.detach().float().clone())
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        sch.step()
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)]


class Gan(tiny.L.LightningModule):
    """A generator (noise -> features) and a discriminator; the usual two-optimizer step returning None.

    Lightning runs the whole step in one autocast region, across both optimizer steps: torch.autocast would
    serve the discriminator's pre-step cast to the generator's loss; mixprec casts afresh after a step, as
    ``cache_enabled=False`` (the oracle for it; D sees real and fake in one call, so no cast is reused
    before the step either)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.gen = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, tiny.FEATURES))
        self.disc = nn.Sequential(nn.Linear(tiny.FEATURES, 32), nn.GELU(), nn.Linear(32, 1))
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt_g, opt_d = self.optimizers()
        real, _ = batch
        z = torch.randn(real.shape[0], 4, generator=torch.Generator().manual_seed(batch_idx))
        bce = nn.functional.binary_cross_entropy_with_logits
        fake = self.gen(z)
        ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)
        loss_d = bce(self.disc(torch.cat([real, fake.detach()])).float(), torch.cat([ones, zeros]))
        opt_d.zero_grad()
        self.manual_backward(loss_d)
        opt_d.step()
        loss_g = bce(self.disc(fake).float(), ones)
        opt_g.zero_grad()
        self.manual_backward(loss_g)
        opt_g.step()
        self.losses += [loss_d.detach().float().clone(), loss_g.detach().float().clone()]

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.gen.parameters(), lr=1e-3), torch.optim.Adam(
            self.disc.parameters(), lr=1e-3
        )


def make(cls: type) -> Any:
    torch.manual_seed(0)
    return cls()


def native(precision: str, cache_enabled: bool = True) -> Any:
    """Lightning's own MixedPrecision plugin (named, since on CPU ``precision="16-mixed"`` becomes bf16),
    its torch.autocast with ``cache_enabled`` as given."""
    from lightning.pytorch.plugins import MixedPrecision

    class Native(MixedPrecision):
        def forward_context(self) -> Any:
            dtype = torch.bfloat16 if self.precision == "bf16-mixed" else torch.float16
            return torch.autocast(self.device, dtype=dtype, cache_enabled=cache_enabled)

    return Native(precision, "cpu")


def fit(model: Any, plugin: Any, callbacks: Any = ()) -> Any:
    """Fit ``model`` on tiny.loader, with an inf input in batch INF_BATCH where the plugin has a scaler
    (without one the inf would only turn every weight into nan); return the trainer."""
    trainer = tiny.trainer(max_steps=-1, max_epochs=1, plugins=[plugin], callbacks=list(callbacks))
    trainer.fit(model, tiny.loader(inf_batches=(INF_BATCH,) if plugin.scaler is not None else ()))
    return trainer


def result(model: Any, trainer: Any) -> dict[str, Any]:
    """Losses, weights, the scale and, for Manual, the scheduler's step count and LR."""
    out = tiny.result(model)
    scaler = trainer.precision_plugin.scaler
    out["scale"] = None if scaler is None else float(scaler.get_scale())
    schedulers = trainer.lr_scheduler_configs
    if schedulers:
        out["scheduler_steps"] = schedulers[0].scheduler.last_epoch
        out["lr"] = trainer.optimizers[0].param_groups[0]["lr"]
    return out


if __name__ == "__main__":
    torch.set_num_threads(1)
    runs = {}
    for name, cls, precision, cache in (
        ("manual-16", Manual, "16-mixed", True),
        ("gan-16", Gan, "16-mixed", False),
        ("gan-bf16", Gan, "bf16-mixed", False),
        ("gan-bf16-cached", Gan, "bf16-mixed", True),
    ):
        model = make(cls)
        runs[name] = result(model, fit(model, native(precision, cache)))
    torch.save(runs, sys.argv[1])
