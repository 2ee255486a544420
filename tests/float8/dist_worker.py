"""One gloo rank of the fp8 DDP scenario (run by test_distributed.py): delayed scaling, amax agreed per step.

python dist_worker.py RANK WORLD_SIZE OUT_DIR
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from mixprec.float8 import Float8Config, Float8Linear, convert_to_float8_training, sync_float8_amax_history


def main(rank: int, world: int, out: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out / 'store'}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    convert_to_float8_training(model, config=Float8Config(scaling="delayed", amax_history_len=4))
    ddp = DistributedDataParallel(model, broadcast_buffers=False)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    layers = [m for m in model.modules() if isinstance(m, Float8Linear)]
    calls = []
    real_all_reduce = dist.all_reduce

    def counted(*args, **kwargs):
        calls.append(1)
        return real_all_reduce(*args, **kwargs)

    record = {"local": [], "synced": [], "scales": [], "collectives": [], "reduced": []}
    for step in range(3):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(8, 16, generator=g) * (1 + 9 * rank)  # rank 1's inputs are 10x larger
        optimizer.zero_grad()
        ddp(x).pow(2).mean().backward()
        record["local"].append(torch.stack([m.amax_history[:, 0].clone() for m in layers]))
        record["scales"].append(torch.stack([m.fp8_stats[1].clone() for m in layers]))
        calls.clear()
        dist.all_reduce = counted
        try:
            record["reduced"].append(sync_float8_amax_history(ddp))
        finally:
            dist.all_reduce = real_all_reduce
        record["collectives"].append(len(calls))
        record["synced"].append(torch.stack([m.amax_history.clone() for m in layers]))
        optimizer.step()
    torch.save(record, out / f"rank{rank}.pt")
    # DDP sits in reference cycles that keep gloo's process group alive into interpreter shutdown, where
    # torch (2.13) can abort ("terminate called without an active exception"): free it first, as
    # tests/distributed/dist_scenarios.py does.
    del ddp, optimizer, model, layers
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
