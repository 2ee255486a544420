"""One gloo rank of the lowbit DDP / FSDP2 scenarios (run by test_lowbit_distributed.py).

python lowbit_dist_worker.py RANK WORLD_SIZE OUT_DIR WRAPPER   (WRAPPER: ddp or fsdp2)
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from mixprec.lowbit import convert_to_lowbit_training

RECIPE, STEPS = "nvfp4", 2


def model_for(rank: int) -> nn.Module:
    """The same initial model on every rank; stochastic rounding draws from a per-rank generator."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))
    return convert_to_lowbit_training(model, RECIPE, generator=torch.Generator().manual_seed(7 + rank))


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(16, 32, generator=torch.Generator().manual_seed(100 * step + rank)) * (1 + 3 * rank)


def main(rank: int, world: int, out: Path, wrapper: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out / 'store'}", rank=rank, world_size=world)
    model = model_for(rank)
    if wrapper == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in (model[0], model[2]):
            fully_shard(layer)
        wrapped = fully_shard(model)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.05)
    for step in range(STEPS):
        optimizer.zero_grad()
        wrapped(batch(step, rank)).square().mean().backward()
        optimizer.step()
    params = [p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in model.parameters()]
    torch.save([p.clone() for p in params], out / f"{wrapper}{rank}.pt")
    del wrapped, optimizer, model  # free gloo's references before shutdown (see tests/float8/dist_worker.py)
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4])
