"""Step time and memory of each precision path, side by side with its best peer, at several model widths.

Paths (all AdamW with the same hyperparameters, on an MLP of ``depth`` Linear-LayerNorm-ReLU blocks):

==================  ==========================================================================
fp32                torch AdamW, fp32 weights (the baseline)
bf16                weights cast to bf16, torch AdamW (its state bf16 too): loses small updates
optimi-kahan        torch-optimi ``AdamW(kahan_sum=True)`` on bf16 weights: the peer for pure bf16
bf16-true+kahan     ``mixprec.initialize(model, AdamW, "bf16-true", weight_update="kahan")``
kahan-nocheck       bf16-true+kahan with ``loss_scale=None``: no inf/nan check before the step (as optimi)
bf16-true+sr        the same with ``weight_update="stochastic"``
O1                  ``initialize(..., "O1")``: fp32 weights, mixprec autocast, dynamic loss scale
O2                  ``initialize(..., "O2")``: bf16 model, fp32 masters, dynamic loss scale
==================  ==========================================================================

Every (path, width) runs in a fresh process, ``--rounds`` times, interleaved (round 1 runs every path once,
then round 2, ...), so drift on a shared machine spreads over all paths. One process times ``--steps``
training steps after ``--warmup`` and reports their median; the table gives the median over rounds and the
interquartile range (IQR) of the per-round medians. ``step ms`` is CPU time of the process per training
step (forward, backward, optimizer step; ``time.process_time``), which other load on a shared machine
disturbs far less than the wall clock (also printed, ``wall ms``); with ``--threads 1`` (default) the two
agree on an idle machine. ``tensors`` counts the distinct storages alive after a
step: parameters, buffers, gradients, optimizer state, masters (and their gradients), Kahan buffers; exact
and reproducible. ``peak`` is the process's peak RSS growth over training (includes transients).

Usage::

    python benchmarks/precision_paths.py --widths 256,512,1024 --rounds 5 --json precision_paths.json
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

PATHS = ("fp32", "bf16", "optimi-kahan", "bf16-true+kahan", "kahan-nocheck", "bf16-true+sr", "O1", "O2")
MIB = 2**20


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
    tensors = [*model.parameters(), *model.buffers(), *grads, *masters, *_tensors_in(optimizer.state_dict())]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.numel()}
    return sum(storages.values())


def build(path: str, width: int, depth: int, lr: float, betas: tuple[float, float], wd: float):
    torch.manual_seed(0)
    blocks = [m for _ in range(depth) for m in (nn.Linear(width, width), nn.LayerNorm(width), nn.ReLU())]
    model = nn.Sequential(*blocks, nn.Linear(width, 10))
    if path in ("bf16", "optimi-kahan"):
        model.to(torch.bfloat16)
    if path == "optimi-kahan":
        import optimi

        return model, optimi.AdamW(model.parameters(), lr=lr, betas=betas, weight_decay=wd, kahan_sum=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, weight_decay=wd)
    if path in ("fp32", "bf16"):
        return model, optimizer
    from mixprec import initialize

    update = {"bf16-true+kahan": "kahan", "kahan-nocheck": "kahan", "bf16-true+sr": "stochastic"}
    if path in update:
        scale = {"loss_scale": None} if path == "kahan-nocheck" else {}
        return initialize(model, optimizer, "bf16-true", weight_update=update[path], **scale)
    return initialize(model, optimizer, path)


def worker(args: argparse.Namespace) -> dict:
    """One (path, width) in this fresh process."""
    torch.set_num_threads(args.threads)
    x = torch.randn(args.batch, args.width)
    y = torch.randint(0, 10, (args.batch,))
    if args.path in ("bf16", "optimi-kahan"):
        x = x.bfloat16()
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    model, optimizer = build(args.path, args.width, args.depth, args.lr, (0.9, args.beta2), args.wd)
    times, cpu_times = [], []
    for step in range(args.warmup + args.steps):
        start, cpu_start = time.perf_counter(), time.process_time()
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x).float(), y)
        optimizer.backward(loss) if hasattr(optimizer, "backward") else loss.backward()
        optimizer.step()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
            cpu_times.append(time.process_time() - cpu_start)
    params = sum(p.numel() for p in model.parameters())
    return {
        "path": args.path,
        "width": args.width,
        "params": params,
        "wall_ms": statistics.median(times) * 1e3,
        "step_ms": statistics.median(cpu_times) * 1e3,
        "tensor_bytes": tensor_bytes(model, optimizer),
        "peak_mib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - baseline) / 1024,
    }


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def summarize(runs: list[dict]) -> list[dict]:
    rows = []
    for width in sorted({r["width"] for r in runs}):
        for path in PATHS:
            mine = [r for r in runs if r["width"] == width and r["path"] == path]
            if not mine:
                continue
            q1, median, q3 = _quartiles([r["step_ms"] for r in mine])
            rows.append(
                {
                    "width": width,
                    "path": path,
                    "params": mine[0]["params"],
                    "step_ms": median,
                    "step_iqr_ms": q3 - q1,
                    "wall_ms": statistics.median(r["wall_ms"] for r in mine),
                    "tensor_mib": mine[0]["tensor_bytes"] / MIB,
                    "bytes_per_param": mine[0]["tensor_bytes"] / mine[0]["params"],
                    "peak_mib": statistics.median(r["peak_mib"] for r in mine),
                    "rounds": len(mine),
                }
            )
    return rows


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    print(
        f"AdamW lr {args.lr} betas (0.9, {args.beta2}) wd {args.wd}, depth {args.depth}, batch {args.batch}, "
        f"{args.threads} threads; CPU ms per step: median of {args.steps} steps per process, "
        f"median and IQR over {args.rounds} interleaved rounds"
    )
    header = (
        f"{'width':>5} {'path':16} {'params':>7} {'step ms':>8} {'IQR':>6} {'wall ms':>8} {'tensors MiB':>11}"
    )
    print(header + f" {'B/param':>7} {'peak MiB':>8} {'ms vs optimi':>12} {'MiB vs optimi':>13}")
    for row in rows:
        peer = next(r for r in rows if r["width"] == row["width"] and r["path"] == "optimi-kahan")
        print(
            f"{row['width']:>5} {row['path']:16} {row['params'] / 1e6:6.2f}M {row['step_ms']:8.2f} "
            f"{row['step_iqr_ms']:6.2f} {row['wall_ms']:8.2f} {row['tensor_mib']:11.1f} "
            f"{row['bytes_per_param']:7.2f} "
            f"{row['peak_mib']:8.1f} {row['step_ms'] / peer['step_ms']:12.2f} "
            f"{row['tensor_mib'] / peer['tensor_mib']:13.2f}"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--widths", default="256,512,1024")
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--beta2", type=float, default=0.99)
    parser.add_argument("--wd", type=float, default=0.01)
    parser.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated subset of {list(PATHS)}")
    parser.add_argument("--json", help="write the rows and every run to this file")
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--width", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.path:
        print(json.dumps(worker(args)))
        return
    paths = args.paths.split(",")
    unknown = sorted(set(paths) - set(PATHS))
    if unknown:
        parser.error(f"unknown paths {unknown}; accepted: {list(PATHS)}")
    if "optimi-kahan" not in paths:
        parser.error("the table compares every path with optimi-kahan: keep it in --paths")
    shared = [f"--{k}={getattr(args, k)}" for k in ("depth", "batch", "steps", "warmup", "threads", "lr")]
    shared += [f"--beta2={args.beta2}", f"--wd={args.wd}"]
    runs = []
    for _ in range(args.rounds):
        for width in map(int, args.widths.split(",")):
            for path in paths:
                command = [sys.executable, __file__, *shared, f"--path={path}", f"--width={width}"]
                done = subprocess.run(command, capture_output=True, text=True, check=True)
                runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    rows = summarize(runs)
    print_table(rows, args)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"args": vars(args), "rows": rows, "runs": runs}, out, indent=1)


if __name__ == "__main__":
    main()
