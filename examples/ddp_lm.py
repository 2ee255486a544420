"""The bench's `lm` workload data-parallel: DDP + mixprec.autocast + a rank-agreeing mixprec.GradScaler.

    torchrun --standalone --nproc_per_node 2 examples/ddp_lm.py [--steps 100] [--dtype bfloat16]
    torchrun --standalone --nproc_per_node 2 examples/ddp_lm.py --dtype float16   # with loss scaling

The char-level GPT of `mixprec bench` (d=256, 4 layers, context 128) trains on Python's standard-library
sources; each rank takes its own half of every global batch and DDP averages the gradients (gloo on a
CPU, NCCL when CUDA is there). Rank 0 prints progress at least every 10 s, then the median step time,
the validation loss, the skipped steps and whether the replicas ended bit-identical. fp16 on a CPU is
slow (CPUs have no fast fp16 matmul kernel): rank 0 warns and says what to use instead.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import mixprec
from mixprec.bench.data import text_corpus
from mixprec.bench.models import CharGPT
from mixprec.distributed import replicas_identical

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def batches(ids: torch.Tensor, context: int, batch: int, seed: int) -> Iterator[tuple[torch.Tensor, ...]]:
    """Random windows of the corpus; the same sequence on every rank (each rank then takes its share)."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(len(ids) - context - 1, (batch,), generator=generator).tolist()
        window = torch.stack([ids[s : s + context + 1] for s in starts])
        yield window[:, :-1], window[:, 1:]


PROGRESS_EVERY_S = 10.0
CPU_FP16_WARNING = (
    "warning: --dtype float16 on a CPU: CPUs have no fast fp16 matmul kernel, so this runs many times "
    "slower than bfloat16 (minutes per 100 steps); use --dtype bfloat16 on a CPU, float16 on a GPU"
)


class Progress:
    """Rank 0's plain progress lines: the first step, then at least every ``PROGRESS_EVERY_S`` seconds."""

    def __init__(self, steps: int, enabled: bool) -> None:
        self.steps, self.enabled = steps, enabled
        self.started = self.last = time.perf_counter()

    def step(self, done: int) -> None:
        now = time.perf_counter()
        if not self.enabled or (done > 1 and now - self.last < PROGRESS_EVERY_S and done < self.steps):
            return
        self.last = now
        per_step = (now - self.started) / done
        left = per_step * (self.steps - done)
        print(
            f"step {done}/{self.steps}: {per_step:.2f} s/step, about {left:.0f} s left",
            file=sys.stderr,
            flush=True,
        )


def train(args: argparse.Namespace, rank: int, world_size: int, device: torch.device) -> None:
    corpus = text_corpus(args.corpus_bytes)
    torch.manual_seed(0)
    model = CharGPT(len(corpus.vocab), args.context, args.width, args.layers, heads=4).to(device)
    model = DDP(model) if world_size > 1 else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.01)
    dtype = DTYPES[args.dtype]
    if rank == 0 and device.type == "cpu" and dtype == torch.float16:
        print(CPU_FP16_WARNING, file=sys.stderr, flush=True)
    progress = Progress(args.steps, enabled=rank == 0)
    scaler = mixprec.GradScaler(enabled=dtype == torch.float16)  # sync="auto": one all-reduce of found_inf
    stream = batches(corpus.train, args.context, args.batch, seed=1)
    times = []
    for step in range(args.steps):
        inputs, targets = next(stream)
        inputs, targets = inputs[rank::world_size].to(device), targets[rank::world_size].to(device)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with mixprec.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            logits = model(inputs)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        progress.step(step + 1)
    val = corpus.val[: 16 * (args.context + 1)].view(16, args.context + 1).to(device)
    with torch.no_grad(), mixprec.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
        val_loss = F.cross_entropy(model(val[:, :-1]).float().flatten(0, 1), val[:, 1:].flatten()).item()
    identical = replicas_identical(model) if world_size > 1 else True
    if rank == 0:
        median = statistics.median(times[min(3, len(times) - 1) :]) * 1e3
        skipped = scaler.skipped_steps if scaler.is_enabled() else 0
        print(f"ranks {world_size}  dtype {args.dtype}  median step {median:.1f} ms")
        print(f"val loss {val_loss:.4f}  skipped steps {skipped}")
        print(f"replicas identical: {identical}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=16, help="global batch, split across the ranks")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--corpus-bytes", type=int, default=2_000_000)
    args = parser.parse_args()
    if "RANK" not in os.environ:  # not started by torchrun: one process, no process group
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        train(args, 0, 1, device)
        return
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    train(args, rank, world_size, torch.device("cuda") if cuda else torch.device("cpu"))
    gc.collect()  # DDP's reference cycles keep the process group alive into shutdown otherwise
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
