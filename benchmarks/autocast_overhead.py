"""Training-step time under mixprec.autocast vs torch.autocast vs fp32 (a measurement, not a test).

Two models: a 3-layer transformer encoder (d=256, 4 heads, seq 128, batch 8: matmul-bound, where
bf16 pays) and a tiny MLP (64 wide, batch 32: overhead-bound, where a Python engine costs most).
A step is forward under the region, loss, backward and an AdamW step. The modes are interleaved
round by round so that machine noise hits them alike; we report medians, the interquartile range and
ratios of one run. Also: the per-op cost of one small ``linear`` (64x64 weight, batch 32, grad on)
under each region, including a policy that edits another op (the deviation mode is pushed), and with
``--compile`` the compiled transformer step under torch.autocast and mixprec.autocast.

    python benchmarks/autocast_overhead.py [--rounds 30] [--steps 5] [--dtype bf16] [--compile]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
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


def make_step(model: nn.Module, x: torch.Tensor, region, compile_: bool = False):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def forward(x: torch.Tensor) -> torch.Tensor:
        with region():
            out = model(x)
            return out.float().pow(2).mean()

    forward_fn = torch.compile(forward) if compile_ else forward

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        forward_fn(x).backward()
        opt.step()

    return step


def _regions(dtype: torch.dtype) -> dict:
    edited = mixprec.Policy.for_device("cpu").with_ops(fp32=["cumsum"])  # an op the models never call
    return {
        "fp32": contextlib.nullcontext,
        "torch.autocast": lambda: torch.autocast("cpu", dtype=dtype),
        "mixprec.autocast": lambda: mixprec.autocast("cpu", dtype=dtype),
        "mixprec (edited policy)": lambda: mixprec.autocast("cpu", dtype=dtype, policy=edited),
    }


def _summary(values: list[float]) -> dict[str, float]:
    q = statistics.quantiles(values, n=4)
    return {"median": statistics.median(values), "q1": q[0], "q3": q[2]}


def measure(build, dtype: torch.dtype, rounds: int, steps: int, compile_: bool = False) -> dict:
    regions = _regions(dtype)
    if compile_:
        regions = {k: regions[k] for k in ("torch.autocast", "mixprec.autocast")}
    torch.manual_seed(0)
    model, x = build()
    steppers = {}
    for name, region in regions.items():
        torch.manual_seed(0)
        m, _ = build()
        m.load_state_dict(model.state_dict())
        steppers[name] = make_step(m, x, region, compile_)
        for _ in range(3):  # warm-up: allocator, kernels, the mode's lookup tables
            steppers[name]()
    times: dict[str, list[float]] = {name: [] for name in regions}
    for _ in range(rounds):
        for name, step in steppers.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            times[name].append((time.perf_counter() - t0) / steps * 1e3)
    return {name: _summary(v) for name, v in times.items()}


def per_op(dtype: torch.dtype, rounds: int, calls: int = 200) -> dict:
    """Microseconds per call of F.linear (64x64 weight, batch 32, grad on) under each region."""
    lin, x = nn.Linear(64, 64), torch.randn(32, 64)
    regions = _regions(dtype)
    times: dict[str, list[float]] = {name: [] for name in regions}
    for _ in range(rounds):
        for name, region in regions.items():
            with region():
                lin(x)
                t0 = time.perf_counter()
                for _ in range(calls):
                    lin(x)
                times[name].append((time.perf_counter() - t0) / calls * 1e6)
    return {name: _summary(v) for name, v in times.items()}


def _fmt(d: dict) -> str:
    return f"{d['median']:.3f} [{d['q1']:.3f}-{d['q3']:.3f}]"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--steps", type=int, default=5, help="steps per timed round")
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--compile", action="store_true", help="also time the compiled transformer step")
    parser.add_argument("--json", help="write the figures to this JSON file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    print(
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads, dtype {args.dtype}; median [q1-q3] in ms per step"
    )
    results: dict[str, dict] = {}
    for name, build, rounds, steps in (
        ("transformer d256x3", transformer, args.rounds, args.steps),
        ("tiny MLP 64", tiny_mlp, args.rounds * 4, args.steps * 10),
    ):
        med = results[name] = measure(build, dtype, rounds, steps)
        ratio = med["mixprec.autocast"]["median"] / med["torch.autocast"]["median"]
        edited = med["mixprec (edited policy)"]["median"] / med["torch.autocast"]["median"]
        print(
            f"{name}: mixprec/torch {ratio:.3f}, edited-policy/torch {edited:.3f}, "
            f"bf16 speedup (mixprec) {med['fp32']['median'] / med['mixprec.autocast']['median']:.2f}x"
        )
        for region, d in med.items():
            print(f"    {region:<26}{_fmt(d)}")
    ops = results["per-op linear (us)"] = per_op(dtype, args.rounds)
    print("per call of a 64x64 linear, batch 32, grad on (us):")
    for region, d in ops.items():
        print(f"    {region:<26}{_fmt(d)}")
    if args.compile:
        med = results["compiled transformer"] = measure(
            transformer, dtype, max(args.rounds // 3, 3), args.steps, True
        )
        ratio = med["mixprec.autocast"]["median"] / med["torch.autocast"]["median"]
        print(f"compiled transformer: mixprec/torch {ratio:.3f}")
        for region, d in med.items():
            print(f"    {region:<26}{_fmt(d)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"torch": torch.__version__, "threads": torch.get_num_threads(), **results}, f, indent=1
            )


if __name__ == "__main__":
    main()
