"""Accelerate with mixprec: the loop from Accelerate's docs, with one changed line (the constructor).

python examples/accelerate_mixprec.py

A small classifier on synthetic data, 40 steps on CPU in float16 with mixprec.GradScaler(hysteresis=2) and
a fused AdamW; batch 10 holds an inf, so its step is skipped (the LR schedule waits for it) and explained.
"""

import torch
from torch import nn

import mixprec
from mixprec.integrations.accelerate import MixprecAccelerator


def data(steps: int = 40, batch: int = 32) -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(steps * batch, 20, generator=generator)
    y = (x[:, :3] * torch.tensor([1.0, -2.0, 0.5])).argmax(dim=1)  # a learnable rule
    x[10 * batch, 0] = float("inf")  # one bad sample in batch 10
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch)


def main() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, total_iters=40)
    policy = mixprec.Policy.preset("16-mixed").with_modules({"4": torch.float32})  # the head in fp32

    accelerator = MixprecAccelerator(cpu=True, policy=policy, scaler=mixprec.GradScaler(hysteresis=2))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, data(), scheduler)
    losses = []
    for x, y in loader:
        with accelerator.autocast():  # needed only for pins by name (see MixprecAccelerator.prepare_model)
            loss = nn.functional.cross_entropy(model(x), y)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        accelerator.diagnose_step(
            model, x, loss, loss_fn=lambda m, batch, y=y: nn.functional.cross_entropy(m(batch), y)
        )
        losses.append(loss.item())

    scaler = accelerator.mixprec_scaler
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    print(f"skipped_steps {scaler.skipped_steps}, loss_scale {scaler.get_scale():g}")
    print(f"scheduler steps {scheduler.scheduler.last_epoch} of {len(losses)}")
    print("diagnosis:", *accelerator.mixprec_diagnoses)


if __name__ == "__main__":
    main()
