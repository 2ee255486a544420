"""Data-parallel mixed-precision training on the CPU: DDP + mixprec.autocast + mixprec.GradScaler.

    torchrun --nproc_per_node 2 examples/ddp_train.py [--steps 300] [--dtype bfloat16] [--master-weights]
    python examples/ddp_train.py --steps 50            # one process works too

A small MLP learns sklearn's 8x8 digits. Every rank trains on its own slice of each batch; DDP averages the
gradients; the scaler agrees with the other ranks before skipping a step (one all-reduce of found_inf). With
``--master-weights`` the model itself is half precision and ``mixprec.MixedPrecisionOptimizer`` keeps fp32
master weights. Rank 0 prints the test accuracy and whether every rank ended with bit-identical parameters.
"""

from __future__ import annotations

import argparse
import gc
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.nn.parallel import DistributedDataParallel as DDP

import mixprec
from mixprec.distributed import replicas_identical

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def load_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Digits scaled to [0, 1]; the same shuffled 80/20 split on every rank."""
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[order], y[order]
    cut = int(0.8 * len(x))
    return x[:cut], y[:cut], x[cut:], y[cut:]


def train(args: argparse.Namespace, rank: int, world_size: int) -> None:
    dtype = DTYPES[args.dtype]
    x_train, y_train, x_test, y_test = load_data()
    torch.manual_seed(0)  # the same initial weights everywhere (DDP also broadcasts rank 0's)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    if args.master_weights:
        model = model.to(dtype)
    model = DDP(model) if world_size > 1 else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if args.master_weights:
        optimizer = mixprec.MixedPrecisionOptimizer(optimizer)  # its own GradScaler, synced the same way
        scaler = optimizer.scaler
    else:
        scaler = mixprec.GradScaler()  # sync="auto": agrees with the other ranks before skipping

    batches = torch.Generator().manual_seed(1)
    for step in range(args.steps):
        batch = torch.randint(len(x_train), (args.batch,), generator=batches)
        mine = batch[rank::world_size]
        xs, ys = x_train[mine], y_train[mine]
        with mixprec.autocast("cpu", dtype=dtype):
            loss = F.cross_entropy(model(xs.to(dtype) if args.master_weights else xs).float(), ys)
        if args.master_weights:
            optimizer.backward(loss)
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        optimizer.zero_grad()
        if rank == 0 and (step % 100 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {loss.item():.4f}  scale {scaler.get_scale():g}", flush=True)

    with torch.no_grad(), mixprec.autocast("cpu", dtype=dtype):
        inputs = x_test.to(dtype) if args.master_weights else x_test
        accuracy = (model(inputs).argmax(1) == y_test).float().mean().item()
    identical = replicas_identical(model)
    if rank == 0:
        print(f"ranks {world_size}  skipped steps {scaler.skipped_steps}  test accuracy {accuracy:.3f}")
        print(f"replicas identical: {identical}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=64, help="global batch, split across the ranks")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float16")
    parser.add_argument("--master-weights", action="store_true")
    args = parser.parse_args()

    torch.set_num_threads(1)
    if "RANK" not in os.environ:  # not started by torchrun: one process, no process group
        train(args, rank=0, world_size=1)
        return
    dist.init_process_group("gloo")
    train(args, dist.get_rank(), dist.get_world_size())
    # DDP sits in reference cycles that keep gloo's process group alive into interpreter shutdown, where
    # torch (2.13) can abort with "terminate called without an active exception": free them first.
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
