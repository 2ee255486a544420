"""Saved-activation bytes of a transformer block with and without low-bit saved activations, the gradient
error that costs, and the bytes the low-bit gradient hooks hand to collectives per fp32 gradient byte.

Per seed and mode (``none``, ``fp8``, ``mxfp8``), one forward/backward of ``--layers`` torch
``TransformerEncoderLayer``s (``--dim``, ``--seq``, ``--batch``, fp32). "held" is what the saved-tensor pack
hooks return, summed: for ``none`` a hook that keeps every tensor, for fp8 / mxfp8
``save_activations``' quantized bytes plus what it keeps (parameters, small and integer tensors), so the
columns compare like for like; "activations" counts the tensors that are quantized. torch has no
CPU-allocator peak counter, so no allocator figure is given. The gradient error is
``|g - g_ref| / |g_ref|`` over all parameters against the unhooked backward of the same seed; the table
gives the median and range over seeds.

The comm part runs DDP on a one-rank gloo group in this process, registers each hook and reads the bytes
its state counts (payload and the fp8 amax); the fp32 row is DDP's own all-reduce (4 bytes a value).

    python benchmarks/activation_memory.py --seeds 0,1,2,3,4 --json activation_memory.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from mixprec.distributed import LowbitCommState, lowbit_allreduce_hook
from mixprec.lowbit import save_activations

MODES = ("none", "fp8", "mxfp8")


def _model(args: argparse.Namespace, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    layer = lambda: torch.nn.TransformerEncoderLayer(  # noqa: E731
        args.dim, 4, 4 * args.dim, dropout=0.0, batch_first=True
    )
    return torch.nn.Sequential(*[layer() for _ in range(args.layers)])


def _run(
    model: torch.nn.Module, x: torch.Tensor, probe: torch.Tensor, mode: str
) -> tuple[torch.Tensor, int, int]:
    """(flat gradients, bytes the pack hooks return, bytes the quantized tensors had)."""
    model.zero_grad()
    if mode == "none":
        held = [0]

        def keep(t: torch.Tensor) -> torch.Tensor:
            held[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            out = model(x)
        total, original = held[0], 0
    else:
        with save_activations(mode) as saved:
            out = model(x)
        total, original = saved.packed_bytes + saved.kept_bytes, saved.original_bytes
    (out * probe).sum().backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()]), total, original


def activations(args: argparse.Namespace) -> dict:
    rows: dict[str, dict[str, list[float]]] = {m: {"held": [], "activations": [], "error": []} for m in MODES}
    for seed in args.seeds:
        model = _model(args, seed)
        gen = torch.Generator().manual_seed(1000 + seed)
        x = torch.randn(args.batch, args.seq, args.dim, generator=gen)
        probe = torch.randn(args.batch, args.seq, args.dim, generator=gen)
        ref, ref_held, _ = _run(model, x, probe, "none")
        rows["none"]["held"].append(ref_held)
        rows["none"]["error"].append(0.0)
        for mode in MODES[1:]:
            grads, held, original = _run(model, x, probe, mode)
            rows[mode]["held"].append(held)
            rows[mode]["activations"].append(original)
            rows[mode]["error"].append(((grads - ref).norm() / ref.norm()).item())
    return rows


def comm() -> dict[str, float]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256))
    numel = sum(p.numel() for p in model.parameters())
    out = {"fp32": 1.0}
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{Path(tmp) / 'store'}", rank=0, world_size=1)
        try:
            for fmt in ("bf16", "fp8"):
                ddp, state = DDP(model), LowbitCommState()
                ddp.register_comm_hook(state, lowbit_allreduce_hook(fmt))
                F.mse_loss(ddp(torch.randn(8, 256)), torch.zeros(8, 256)).backward()
                out[fmt] = state.bytes_sent / (4 * numel)
                model.zero_grad()
        finally:
            dist.destroy_process_group()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=lambda s: [int(v) for v in s.split(",")], default=[0, 1, 2, 3, 4])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = activations(args)
    base = statistics.median(rows["none"]["held"])
    print(
        f"{args.layers} x TransformerEncoderLayer(d={args.dim}), x ({args.batch}, {args.seq}, {args.dim}) "
        f"fp32, seeds {args.seeds}"
    )
    print(
        f"{'mode':6} {'held MiB':>9} {'vs none':>8} {'act MiB (orig)':>15} "
        f"{'grad rel err median [min, max]':>32}"
    )
    for mode in MODES:
        held = statistics.median(rows[mode]["held"])
        err = rows[mode]["error"]
        act = (
            statistics.median(rows[mode]["activations"]) / 2**20
            if rows[mode]["activations"]
            else float("nan")
        )
        print(
            f"{mode:6} {held / 2**20:9.3f} {held / base:8.3f} {act:15.3f} "
            f"{statistics.median(err):12.4f} [{min(err):.4f}, {max(err):.4f}]"
        )
    sent = comm()
    print(
        "bytes handed to collectives per fp32 gradient byte: "
        + ", ".join(f"{k} {v:.4f}" for k, v in sent.items())
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {"args": {k: v for k, v in vars(args).items() if k != "json"}, "rows": rows, "comm": sent},
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
