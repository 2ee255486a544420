"""Memory and step time of fp32, O1, O2, O3 and pure bf16 (plain, Kahan, stochastic rounding) on one model.

Every configuration runs in a fresh subprocess, so one's allocations cannot hide in another's high-water mark.
Two memory figures, both printed:

* ``tensors``: bytes of every distinct tensor storage that training keeps alive after a step (parameters,
  buffers, gradients, optimizer state, fp32 masters and their gradients, Kahan buffers). Exact and
  reproducible, but blind to transients (activations, the compensated optimizer's per-chunk fp32 scratch).
* ``peak``: the process's peak memory during training, minus the same reading taken after imports and data
  creation (CPU: ``resource.getrusage(RUSAGE_SELF).ru_maxrss``; CUDA: ``torch.cuda.max_memory_allocated``).
  Includes transients and allocator slack; on a busy machine it is noisier than ``tensors``.

Usage::

    python benchmarks/master_memory.py                    # CPU, bf16, ~25M-parameter MLP
    python benchmarks/master_memory.py --width 1024 --steps 5
    python benchmarks/master_memory.py --device cuda      # fp16 by default there
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch
from torch import nn

CONFIGS: dict[str, tuple[str, dict] | None] = {
    "fp32": None,  # plain torch: the baseline
    "O1": ("O1", {}),
    "O2": ("O2", {}),
    "O3": ("O3", {}),
    "bf16-true": ("bf16-true", {}),
    "bf16-true+kahan": ("bf16-true", {"weight_update": "kahan"}),
    "bf16-true+stochastic": ("bf16-true", {"weight_update": "stochastic"}),
}
MIB = 2**20


def _rss_bytes(device: torch.device) -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _cuda_bytes(device: torch.device) -> int:
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device)


PEAK_READERS = {"cpu": _rss_bytes, "cuda": _cuda_bytes}


def _tensors_in(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors_in(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item)


def tensor_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the distinct storages of params, buffers, grads, optimizer state, masters and their grads."""
    masters = getattr(optimizer, "master_params", [])
    grads = [p.grad for p in [*model.parameters(), *masters] if p.grad is not None]
    tensors = [*model.parameters(), *model.buffers(), *grads, *_tensors_in(optimizer.state_dict())]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.numel()}
    return sum(storages.values())


def build(config: str, width: int, depth: int, device: torch.device, lr: float):
    from mixprec.recipes import initialize

    torch.manual_seed(0)
    layers = [nn.Linear(width, width) for _ in range(depth)]
    model = nn.Sequential(*[m for layer in layers for m in (layer, nn.LayerNorm(width), nn.ReLU())])
    model.append(nn.Linear(width, 10))
    model.to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    if CONFIGS[config] is None:
        return model, optimizer
    level, overrides = CONFIGS[config]
    return initialize(model, optimizer, level, **overrides)


def worker(args: argparse.Namespace) -> dict:
    """One configuration, in this (fresh) process."""
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    read_peak = PEAK_READERS[device.type]
    x = torch.randn(args.batch, args.width, device=device)
    y = torch.randint(0, 10, (args.batch,), device=device)
    baseline = read_peak(device)
    model, optimizer = build(args.worker, args.width, args.depth, device, args.lr)
    times = []
    for step in range(args.warmup + args.steps):
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x).float(), y)
        optimizer.backward(loss) if hasattr(optimizer, "backward") else loss.backward()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    return {
        "config": args.worker,
        "params": sum(p.numel() for p in model.parameters()),
        "weight_dtype": str(model[0].weight.dtype).removeprefix("torch."),
        "step_ms": statistics.median(times) * 1e3,
        "tensor_mib": tensor_bytes(model, optimizer) / MIB,
        "peak_mib": (read_peak(device) - baseline) / MIB,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument(
        "--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {list(CONFIGS)}"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return
    rows = []
    for config in args.configs.split(","):
        if config not in CONFIGS:
            parser.error(f"unknown config {config!r}; accepted: {list(CONFIGS)}")
        command = [
            sys.executable,
            __file__,
            *(argv if argv is not None else sys.argv[1:]),
            "--worker",
            config,
        ]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"{rows[0]['params'] / 1e6:.1f}M params, batch {args.batch}, Adam, device {args.device}, "
          f"{args.threads} threads, median of {args.steps} steps after {args.warmup} warm-up")  # fmt: skip
    print(f"{'config':22s} {'weights':>9s} {'step ms':>9s} {'tensors MiB':>12s} {'peak MiB':>9s}")
    for row in rows:
        print(
            f"{row['config']:22s} {row['weight_dtype']:>9s} {row['step_ms']:9.1f} "
            f"{row['tensor_mib']:12.1f} {row['peak_mib']:9.1f}"
        )


if __name__ == "__main__":
    main()
