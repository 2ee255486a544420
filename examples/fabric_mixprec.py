"""Lightning Fabric with mixprec: a pinned module and fp16 loss scaling with a skipped step, in a plain
Fabric loop.

python examples/fabric_mixprec.py

A small classifier on synthetic data, 40 steps on CPU in float16; batch 10 holds an inf, so one step is
skipped. Prints the loss before and after, the scaler's counters and the matmul dtypes.
"""

import torch
from lightning.fabric import Fabric
from torch import nn

import mixprec
from mixprec.inspect import trace_dtypes
from mixprec.integrations.fabric import MixprecPrecision


def data(steps: int = 40, batch: int = 32) -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(steps * batch, 20, generator=generator)
    y = (x[:, :3] * torch.tensor([1.0, -2.0, 0.5])).argmax(dim=1)  # a learnable rule
    x[10 * batch, 0] = float("inf")  # one bad sample in batch 10
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch)


def mean_loss(model: nn.Module, loader: torch.utils.data.DataLoader) -> float:
    with torch.no_grad():
        losses = [nn.functional.cross_entropy(model(x).float(), y) for x, y in loader]
    return torch.stack([loss for loss in losses if torch.isfinite(loss)]).mean().item()


def main() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 3))
    policy = mixprec.Policy.preset("16-mixed").with_modules({"4": torch.float32})  # the head in fp32
    plugin = MixprecPrecision("16-mixed", policy=policy, scaler=mixprec.GradScaler(hysteresis=2))
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    wrapped, optimizer = fabric.setup(model, optimizer)
    loader = data()
    before = mean_loss(model, loader)
    for x, y in loader:
        loss = nn.functional.cross_entropy(wrapped(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    print(f"loss {before:.4f} -> {mean_loss(model, loader):.4f}")
    print(f"loss_scale {plugin.scaler.get_scale():g}, skipped_steps {plugin.scaler.skipped_steps}")
    with trace_dtypes(model) as trace:
        wrapped(x)
    for name in ("0", "4"):
        print(f"module {name} matmuls ran in {next(iter(trace.counts[name]['linear']))}")


if __name__ == "__main__":
    main()
