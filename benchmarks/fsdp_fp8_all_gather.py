"""Bytes FSDP2 all-gathers per step, fp8 against bf16 and fp32, and the all-reduces the fp8 scales cost.

Starts ``--nproc`` CPU processes (gloo, FileStore in a temporary directory). Each trains the same MLP
(``--layers`` fp8 ``Linear(width, width)`` with bias, each layer its own ``fully_shard`` group, AdamW) in
every mode, the modes interleaved step by step so a busy machine slows them alike:

- ``fp32``: FSDP2's own all-gather of fp32 parameters;
- ``bf16``: FSDP2's own bf16 all-gather (``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=fp32)``);
- ``fp8-bf16``: ``Float8Config(enable_fsdp_float8_all_gather=True)`` under that policy, scales
  precomputed after each step (:func:`mixprec.float8.fsdp.precompute_float8_dynamic_scale_for_fsdp`);
- ``fp8-lazy``: the same without the precompute (each all-gather reduces its weight's amax).

Per mode and rank: the bytes this rank puts into FSDP2's all-gathers per step (counted in a custom
``AllGather``, FSDP2's public hook), the number of all-gathers and of all-reduces per step, and the median
step time with its interquartile range. On a CPU the fp8 matmuls are an emulation and gloo copies through
the host, so the times say nothing about a GPU; the bytes are what this measures.

    python benchmarks/fsdp_fp8_all_gather.py --threads 1 --json benchmarks/fsdp_fp8_all_gather.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from mixprec.float8 import Float8Config, convert_to_float8_training
from mixprec.float8.fsdp import precompute_float8_dynamic_scale_for_fsdp

MODES = ("fp32", "bf16", "fp8-bf16", "fp8-lazy")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nproc", type=int, default=2, help="gloo processes (default 2)")
    parser.add_argument("--width", type=int, default=512, help="Linear width (default 512)")
    parser.add_argument("--layers", type=int, default=4, help="Linear layers (default 4)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per mode (default 20)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    parser.add_argument("--json", help="write the results here")
    return parser.parse_args()


class Mode:
    """One mode's sharded model, optimizer and counters on this rank."""

    def __init__(self, name: str, args: argparse.Namespace) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

        sent = self.sent = []

        class CountingAllGather(DefaultAllGather):
            def __call__(self, output_tensor, input_tensor, group, async_op=False):
                sent.append(input_tensor.numel() * input_tensor.element_size())
                return super().__call__(output_tensor, input_tensor, group, async_op)

        torch.manual_seed(0)
        self.name, self.reduces, self.times = name, 0, []
        self.model = nn.Sequential(*(nn.Linear(args.width, args.width) for _ in range(args.layers)))
        config = Float8Config(enable_fsdp_float8_all_gather=name.startswith("fp8"))
        convert_to_float8_training(self.model, config=config)
        policy = MixedPrecisionPolicy()
        if name != "fp32":
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in self.model:
            fully_shard(layer, mp_policy=policy)
            layer.set_custom_all_gather(CountingAllGather())
        fully_shard(self.model, mp_policy=policy)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.precompute = name == "fp8-bf16"
        if self.precompute:
            precompute_float8_dynamic_scale_for_fsdp(self.model)

    def step(self, x: torch.Tensor, timed: bool) -> None:
        real_all_reduce = dist.all_reduce

        def counted(*args, **kwargs):
            self.reduces += 1
            return real_all_reduce(*args, **kwargs)

        self.sent.clear()
        self.reduces = 0
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce = counted
        try:
            self.optimizer.zero_grad()
            self.model(x).float().square().mean().backward()
            self.optimizer.step()
            if self.precompute:
                precompute_float8_dynamic_scale_for_fsdp(self.model)
        finally:
            dist.all_reduce = real_all_reduce
        if timed:
            self.times.append(time.perf_counter() - start)

    def row(self) -> dict:
        q1, median, q3 = statistics.quantiles(self.times, n=4) if len(self.times) > 1 else self.times * 3
        return {
            "mode": self.name,
            "bytes_per_step": sum(self.sent),
            "all_gathers_per_step": len(self.sent),
            "all_reduces_per_step": self.reduces,
            "step_s_median": median,
            "step_s_iqr": [q1, q3],
        }


def worker(rank: int, args: argparse.Namespace, store: str, out: str) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=args.nproc)
    modes = [Mode(name, args) for name in MODES]
    for step in range(args.steps + 1):  # the first step of each mode is untimed (lazy init)
        x = torch.randn(32, args.width, generator=torch.Generator().manual_seed(100 * step + rank))
        for mode in modes:
            mode.step(x, timed=step > 0)
    torch.save([mode.row() for mode in modes], Path(out) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(args, str(Path(tmp) / "store"), tmp), nprocs=args.nproc, join=True)
        ranks = [torch.load(Path(tmp) / f"rank{r}.pt") for r in range(args.nproc)]
    bf16 = {r: next(row for row in rows if row["mode"] == "bf16") for r, rows in enumerate(ranks)}
    print(f"{args.nproc} gloo ranks, {args.layers} x Linear({args.width}, {args.width}), {args.steps} steps")
    print("rank | mode | bytes/step | vs bf16 | all-gathers | all-reduces | step s median (IQR)")
    for rank, rows in enumerate(ranks):
        for row in rows:
            row["vs_bf16"] = row["bytes_per_step"] / bf16[rank]["bytes_per_step"]
            q1, q3 = row["step_s_iqr"]
            print(
                f"{rank} | {row['mode']} | {row['bytes_per_step']} | {row['vs_bf16']:.4f} | "
                f"{row['all_gathers_per_step']} | {row['all_reduces_per_step']} | "
                f"{row['step_s_median']:.4f} ({q1:.4f}-{q3:.4f})"
            )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"args": vars(args), "ranks": ranks}, handle, indent=1)


if __name__ == "__main__":
    main()
