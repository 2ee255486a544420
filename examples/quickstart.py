"""The five-line change: mixprec.autocast + mixprec.GradScaler around an ordinary training loop.

Trains a small MLP on scikit-learn's bundled digits (no download) in fp32 and in mixed precision
from the same seed, and prints both test accuracies.

    python examples/quickstart.py [--epochs 20] [--dtype bf16|fp16]
"""

from __future__ import annotations

import argparse

import torch
from sklearn.datasets import load_digits
from torch import nn

import mixprec


def data() -> tuple[torch.Tensor, ...]:
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    return x[:1400], y[:1400], x[1400:], y[1400:]


def train(dtype: torch.dtype | None, epochs: int) -> float:
    torch.manual_seed(0)
    x_train, y_train, x_test, y_test = data()
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    scaler = mixprec.GradScaler(enabled=dtype == torch.float16)  # bf16 has fp32's range: no scaling needed
    for _ in range(epochs):
        for i in range(0, len(x_train), 64):
            xb, yb = x_train[i : i + 64], y_train[i : i + 64]
            optimizer.zero_grad()
            with mixprec.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                loss = nn.functional.cross_entropy(model(xb), yb)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
    with torch.no_grad():
        return (model(x_test).argmax(1) == y_test).float().mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    fp32, mixed = train(None, args.epochs), train(dtype, args.epochs)
    print(f"test accuracy: fp32 {fp32:.4f}, mixprec {args.dtype} {mixed:.4f}")


if __name__ == "__main__":
    main()
