"""Training-step time under mixprec.autocast vs torch.autocast vs fp32 (a measurement, not a test).

Two models: a 3-layer transformer encoder (d=256, 4 heads, seq 128, batch 8: matmul-bound, where
bf16 pays) and a tiny MLP (64 wide, batch 32: overhead-bound, where a Python engine costs most).
A step is forward under the region, loss, backward and an AdamW step. The modes are interleaved
round by round so that machine noise hits them alike; we report medians and ratios of one run.

    python benchmarks/autocast_overhead.py [--rounds 30] [--steps 10] [--dtype bf16]
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import time

import torch
from torch import nn

import mixprec


def transformer() -> tuple[nn.Module, torch.Tensor]:
    layer = nn.TransformerEncoderLayer(256, 4, dim_feedforward=1024, dropout=0.0, batch_first=True)
    model = nn.Sequential(nn.TransformerEncoder(layer, 3, enable_nested_tensor=False), nn.Linear(256, 256))
    return model, torch.randn(8, 128, 256)


def tiny_mlp() -> tuple[nn.Module, torch.Tensor]:
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    return model, torch.randn(32, 64)


def make_step(model: nn.Module, x: torch.Tensor, region):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with region():
            out = model(x)
            loss = out.float().pow(2).mean()
        loss.backward()
        opt.step()

    return step


def measure(build, dtype: torch.dtype, rounds: int, steps: int) -> dict[str, float]:
    regions = {
        "fp32": contextlib.nullcontext,
        "torch.autocast": lambda: torch.autocast("cpu", dtype=dtype),
        "mixprec.autocast": lambda: mixprec.autocast("cpu", dtype=dtype),
    }
    torch.manual_seed(0)
    model, x = build()
    steppers = {}
    for name, region in regions.items():
        torch.manual_seed(0)
        m, _ = build()
        m.load_state_dict(model.state_dict())
        steppers[name] = make_step(m, x, region)
        for _ in range(3):  # warm-up: allocator, kernels, the mode's lookup tables
            steppers[name]()
    times: dict[str, list[float]] = {name: [] for name in regions}
    for _ in range(rounds):
        for name, step in steppers.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            times[name].append((time.perf_counter() - t0) / steps * 1e3)
    return {name: statistics.median(v) for name, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--steps", type=int, default=5, help="steps per timed round")
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    print(
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads, dtype {args.dtype}"
    )
    print(
        f"{'model':<22}{'fp32 ms':>10}{'torch ms':>10}{'mixprec ms':>12}{'mixprec/torch':>15}{'speedup':>9}"
    )
    for name, build, rounds in (
        ("transformer d256x3", transformer, args.rounds),
        ("tiny MLP 64", tiny_mlp, args.rounds * 4),
    ):
        med = measure(build, dtype, rounds, args.steps if build is transformer else args.steps * 10)
        ratio = med["mixprec.autocast"] / med["torch.autocast"]
        speedup = med["fp32"] / med["mixprec.autocast"]
        print(
            f"{name:<22}{med['fp32']:>10.3f}{med['torch.autocast']:>10.3f}{med['mixprec.autocast']:>12.3f}"
            f"{ratio:>15.3f}{speedup:>9.2f}"
        )


if __name__ == "__main__":
    main()
