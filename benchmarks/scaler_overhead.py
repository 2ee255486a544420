"""Cost of loss scaling per iteration: mixprec.GradScaler against torch.amp.GradScaler's fused kernels.

Times each phase of an iteration -- scale(loss), unscale_(optimizer), step(optimizer), update() -- on ~200
gradient tensors holding ~8M values, for both scalers, interleaved so that a busy machine slows both alike.
Gradients are refreshed (untimed) before every iteration. Prints the median per phase, the total, the
scaler's own share (everything but step(), which is mostly the optimizer's arithmetic) and the ratios
mixprec / torch.

    python benchmarks/scaler_overhead.py --repeats 50
    python benchmarks/scaler_overhead.py --optimizer adam-fused --no-unscale --dtype bfloat16
    python benchmarks/scaler_overhead.py --clock cpu --threads 1 --json scaler.json
    python benchmarks/scaler_overhead.py --optimizer adamw-fused --no-unscale --no-underflow-restart
    python benchmarks/scaler_overhead.py --optimizer adamw-fused --no-unscale --underflow-check-interval 1
    python benchmarks/scaler_overhead.py --kernels --clock cpu --threads 1 --values 4e5

``--kernels`` times the candidate check passes of a fused step alone, interleaved: torch's check op (found_inf
only), mixprec's amax-measuring CPU kernel (per-tensor ``aminmax``), and one ``_foreach_norm(inf)`` plus a
reduction (found_inf and amax from one multi-tensor call).

``--clock cpu`` times with the process's CPU time instead of the wall clock: on a shared machine a
preempted phase then costs what it computed, not how long it waited. The spread printed is the
interquartile range. The last line is the per-iteration ratio of the two totals (each iteration of one
scaler against the other's in the same round), its median and interquartile range.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

import mixprec.scaling

PHASES = ("scale", "unscale_", "step", "update")
OPTIMIZERS: dict[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]] = {
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=True),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-3, foreach=True),
    "adam-fused": lambda params: torch.optim.Adam(params, lr=1e-3, fused=True),
    "adamw-fused": lambda params: torch.optim.AdamW(params, lr=1e-3, fused=True),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=30, help="timed iterations per scaler (default 30)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed iterations first (default 3)")
    parser.add_argument("--tensors", type=int, default=200, help="number of gradient tensors (default 200)")
    parser.add_argument("--values", type=float, default=8e6, help="total gradient values (default 8e6)")
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="sgd")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="parameter dtype")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    parser.add_argument(
        "--clock", choices=["wall", "cpu"], default="wall", help="perf_counter or process_time"
    )
    parser.add_argument("--json", help="write the samples and medians here")
    parser.add_argument(
        "--no-underflow-restart",
        action="store_true",
        help="mixprec's DynamicScale(underflow_restart=False): torch's rule exactly, no amax to measure",
    )
    parser.add_argument(
        "--underflow-check-interval",
        type=int,
        default=None,
        help="DynamicScale(underflow_check_interval=K): fused steps measure amax every K-th update "
        "(default: the rule's default)",
    )
    parser.add_argument("--kernels", action="store_true", help="time the check passes alone (see above)")
    parser.add_argument(
        "--no-unscale",
        action="store_true",
        help="skip the explicit unscale_() and let step() check (fused optimizers unscale in their kernel)",
    )
    return parser.parse_args()


def make_setup(args: argparse.Namespace, seed: int = 0):
    """Parameters, their scaled gradients (kept to refresh from) and an optimizer."""
    generator = torch.Generator().manual_seed(seed)
    weights = torch.rand(args.tensors, generator=generator) + 0.05
    sizes = (weights / weights.sum() * args.values).long().clamp_min(1).tolist()
    dtype = getattr(torch, args.dtype)
    params = [torch.nn.Parameter(torch.randn(n, generator=generator).to(dtype)) for n in sizes]
    grads = [(torch.randn(n, generator=generator) * 2.0**16).to(dtype) for n in sizes]
    return params, grads, OPTIMIZERS[args.optimizer](params)


CLOCK = {"wall": time.perf_counter, "cpu": time.process_time}
now = time.perf_counter


def time_iteration(scaler, params, grads, optimizer, loss: torch.Tensor, unscale: bool) -> dict[str, float]:
    with torch.no_grad():
        for param, grad in zip(params, grads, strict=True):
            if param.grad is None:
                param.grad = grad.clone()
            else:
                param.grad.copy_(grad)
    times = {}
    start = now()
    scaler.scale(loss)
    times["scale"] = now()
    if unscale:
        scaler.unscale_(optimizer)
    times["unscale_"] = now()
    scaler.step(optimizer)
    times["step"] = now()
    scaler.update()
    times["update"] = now()
    previous, out = start, {}
    for phase in PHASES:
        out[phase], previous = times[phase] - previous, times[phase]
    return out


def measure(args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    """Seconds per phase per iteration, for each scaler; the two alternate going first."""
    rule_args = {"underflow_restart": not args.no_underflow_restart}
    if args.underflow_check_interval is not None:
        rule_args["underflow_check_interval"] = args.underflow_check_interval
    scalers = {
        "torch": torch.amp.GradScaler("cpu", growth_interval=10**9),
        "mixprec": mixprec.scaling.GradScaler(
            "cpu", rule=mixprec.DynamicScale(growth_interval=10**9, **rule_args)
        ),
    }
    setups = {name: make_setup(args) for name in scalers}
    loss = torch.tensor(1.5)
    samples: dict[str, dict[str, list[float]]] = {name: {p: [] for p in PHASES} for name in scalers}
    for iteration in range(args.warmup + args.repeats):
        order = list(scalers) if iteration % 2 == 0 else list(reversed(scalers))
        for name in order:
            result = time_iteration(scalers[name], *setups[name], loss, not args.no_unscale)
            if iteration >= args.warmup:
                for phase, seconds in result.items():
                    samples[name][phase].append(seconds)
    return samples


def _iqr(values: list[float]) -> str:
    q = statistics.quantiles(values, n=4)
    return f"{q[0]:.3f}-{q[2]:.3f}"


def report(samples: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, float]]:
    print(
        f"{'median ms':<12}"
        + "".join(f"{phase:>10}" for phase in (*PHASES, "total", "scaler"))
        + "  scaler IQR"
    )
    summary: dict[str, dict[str, float]] = {}
    for name, phases in samples.items():
        ms = {phase: [v * 1e3 for v in phases[phase]] for phase in PHASES}
        medians = [statistics.median(ms[phase]) for phase in PHASES]
        total = [sum(row) for row in zip(*ms.values(), strict=True)]
        # Everything but step(), which is mostly the optimizer's own arithmetic.
        own = [sum(row) for row in zip(*(ms[p] for p in PHASES if p != "step"), strict=True)]
        summary[name] = {**dict(zip(PHASES, medians, strict=True)), "total": statistics.median(total),
                         "scaler": statistics.median(own)}  # fmt: skip
        row = "".join(f"{m:>10.3f}" for m in (*medians, summary[name]["total"], summary[name]["scaler"]))
        print(f"{name:<12}{row}  {_iqr(own)}")
    ratio_total = summary["mixprec"]["total"] / summary["torch"]["total"]
    ratio_scaler = summary["mixprec"]["scaler"] / summary["torch"]["scaler"]
    print(f"ratio mixprec / torch: total {ratio_total:.2f}x, scale+unscale_+update {ratio_scaler:.2f}x")
    totals = {name: [sum(row) for row in zip(*samples[name].values(), strict=True)] for name in samples}
    paired = [m / t for m, t in zip(totals["mixprec"], totals["torch"], strict=True)]
    q = statistics.quantiles(paired, n=4)
    print(f"per-iteration total ratio: median {statistics.median(paired):.3f}x, IQR {q[0]:.3f}-{q[2]:.3f}")
    summary["ratio"] = {
        "total": ratio_total,
        "scaler": ratio_scaler,
        "paired_median": statistics.median(paired),
        "paired_iqr": [q[0], q[2]],
    }
    return summary


def measure_kernels(args: argparse.Namespace) -> dict[str, list[float]]:
    """Seconds per check pass over the same gradients, the candidates interleaved in every round."""
    grads = make_setup(args)[1]
    one = torch.ones(())

    def torch_op() -> None:
        torch._amp_foreach_non_finite_check_and_unscale_(grads, torch.zeros(()), one)

    def foreach_norm() -> None:
        amax = torch.stack(torch._foreach_norm(grads, float("inf"))).max()
        (~torch.isfinite(amax)).float()

    candidates = {
        "torch check op": torch_op,
        "aminmax per tensor": lambda: mixprec.scaling.unscale.per_tensor_kernel(grads, None),
        "_foreach_norm(inf)": foreach_norm,
    }
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    for iteration in range(args.warmup + args.repeats):
        for name, run in candidates.items():
            start = now()
            run()
            if iteration >= args.warmup:
                samples[name].append(now() - start)
    for name, values in samples.items():
        ms = [v * 1e3 for v in values]
        print(f"{name:<22}{statistics.median(ms):>9.3f} ms  IQR {_iqr(ms)}")
    return samples


def main() -> None:
    global now
    args = parse_args()
    now = CLOCK[args.clock]
    if args.threads:
        torch.set_num_threads(args.threads)
    values = sum(p.numel() for p in make_setup(args)[0])
    print(f"{args.tensors} tensors, {values / 1e6:.2f}M values, {args.dtype}, optimizer={args.optimizer}, "
          f"threads={torch.get_num_threads()}, repeats={args.repeats}")  # fmt: skip
    if args.kernels:
        kernel_samples = measure_kernels(args)
        if args.json:
            with open(args.json, "w") as handle:
                json.dump({"args": vars(args), "samples_s": kernel_samples}, handle, indent=1)
        return
    samples = measure(args)
    summary = report(samples)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"args": vars(args), "summary": summary, "samples_s": samples}, handle, indent=1)


if __name__ == "__main__":
    main()
