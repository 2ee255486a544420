"""Run in a fresh venv holding only torch, the built wheel and its declared dependencies.

It imports mixprec from the installed wheel (never from src/) and trains the README's loop for a few steps,
so a missing file in the wheel or an undeclared import fails CI.
"""

import pathlib

import torch
from torch import nn

import mixprec

here = pathlib.Path(mixprec.__file__).resolve()
assert "site-packages" in here.parts, f"mixprec imported from {here}, not from the installed wheel"
assert (here.parent / "py.typed").is_file(), "py.typed is missing from the wheel"

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
scaler = mixprec.GradScaler()
x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
losses = []
for _ in range(20):
    optimizer.zero_grad()
    with mixprec.autocast("cpu", dtype=torch.bfloat16):
        loss = nn.functional.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    losses.append(loss.item())
assert losses[-1] < losses[0], losses
print(f"mixprec {mixprec.__version__} from {here.parent}: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
