"""Cost of agreeing on found_inf across ranks: GradScaler step time with sync vs sync=False, 2 gloo ranks.

Starts ``--nproc`` CPU processes (gloo, FileStore in a temporary directory). Each rank trains its own MLP
(parameters owned by one rank, as with ZeRO/FSDP shards: no DDP, so the only collective is the scaler's).
Per iteration, interleaved so a busy machine slows both alike, with a barrier before each timed part:

- ``step+update``: after an untimed forward/backward, ``scaler.step(optimizer); scaler.update()`` with
  ``sync="auto"`` and with ``sync=False``: the collective's own cost, ranks lined up;
- ``iteration``: forward, backward, step and update, both ways: the collective also waits for the slower rank;
- ``all_reduce``: a bare 1-element float32 ``all_reduce(MAX, async_op=True).wait()``.

Prints the median and 90th percentile per rank, in microseconds, and the median difference sync - no sync.

    python benchmarks/distributed_sync.py --steps 200
    python benchmarks/distributed_sync.py --optimizer adam-fused --width 1024
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import mixprec

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9),
    "adam-fused": lambda params: torch.optim.Adam(params, lr=1e-3, fused=True),
}
Timings = dict[str, list[float]]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nproc", type=int, default=2, help="gloo processes (default 2)")
    parser.add_argument("--steps", type=int, default=200, help="timed iterations (default 200)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed iterations first (default 20)")
    parser.add_argument("--width", type=int, default=512, help="MLP width; params ~ 2 * width**2")
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="sgd")
    return parser.parse_args()


def timed(timings: Timings, name: str, run: Callable[[], object]) -> None:
    """Line the ranks up, then time ``run`` on this rank."""
    dist.barrier()
    start = time.perf_counter()
    run()
    timings.setdefault(name, []).append((time.perf_counter() - start) * 1e6)


class Setup:
    """A rank's own model, optimizer and scaler."""

    def __init__(self, args: argparse.Namespace, sync: str | bool) -> None:
        width = args.width
        layers = [torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width)]
        self.model = torch.nn.Sequential(*layers)
        self.optimizer = OPTIMIZERS[args.optimizer](self.model.parameters())
        self.scaler = mixprec.GradScaler(sync=sync)
        self.x = torch.randn(32, width)

    def backward(self) -> None:
        self.scaler.scale(self.model(self.x).square().mean()).backward()

    def step(self) -> None:
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad()

    def iteration(self) -> None:
        self.backward()
        self.step()


def worker(rank: int, args: argparse.Namespace, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=args.nproc)
    torch.manual_seed(rank)
    setups = {"sync": Setup(args, "auto"), "no sync": Setup(args, False)}
    flag = torch.zeros(1)
    timings: Timings = {}
    for i in range(args.warmup + args.steps):
        record: Timings = timings if i >= args.warmup else {}
        for name, setup in setups.items():
            setup.backward()
            timed(record, f"step+update {name}", setup.step)
        for name, setup in setups.items():
            timed(record, f"iteration {name}", setup.iteration)
        timed(
            record,
            "all_reduce 1 element",
            lambda: dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True).wait(),
        )
    gathered: list[Timings | None] = [None] * args.nproc
    dist.all_gather_object(gathered, timings)
    if rank == 0:
        report(args, gathered)
    dist.barrier()  # gloo can abort in teardown if a rank destroys its group while a peer still talks
    dist.destroy_process_group()


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1]


def report(args: argparse.Namespace, per_rank: list[Timings | None]) -> None:
    params = 2 * (args.width**2 + args.width)
    print(
        f"{args.nproc} gloo ranks, {params / 1e6:.2f}M params per rank, {args.optimizer}, "
        f"{args.steps} timed steps; microseconds, median (p90)"
    )
    names = list(per_rank[0] or {})
    print(f"{'':26s}" + "".join(f"{f'rank {r}':>20s}" for r in range(len(per_rank))))
    for name in names:
        cells = [f"{statistics.median(t[name]):9.0f} ({percentile(t[name], 90):7.0f})" for t in per_rank if t]
        print(f"{name:26s}" + "".join(f"{c:>20s}" for c in cells))
    for what in ("step+update", "iteration"):
        extra = [
            statistics.median(t[f"{what} sync"]) - statistics.median(t[f"{what} no sync"])
            for t in per_rank
            if t
        ]
        print(f"sync - no sync, {what}: " + ", ".join(f"rank {r}: {e:+.0f} us" for r, e in enumerate(extra)))


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        store = f"file://{Path(tmp) / 'store'}"
        mp.spawn(worker, args=(args, store), nprocs=args.nproc, join=True)


if __name__ == "__main__":
    main()
