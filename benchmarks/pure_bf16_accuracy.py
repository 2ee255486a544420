"""Held-out loss and metric of the pure-bf16 optimizer paths against fp32 state, on the bench's workloads.

Each (workload, path, seed) trains in this process from the same seed, data and batch order (the bench's
own ``build``), AdamW at the betas given (torch's default (0.9, 0.999) unless ``--beta2``), and is scored on
the workload's held-out set. Paths:

==================  ==========================================================================
fp32                torch AdamW on fp32 weights (the reference)
kahan-fp32state     bf16 weights, Kahan buffer, Adam state in fp32 (``state_dtype=torch.float32``)
bf16-true+kahan     ``initialize(..., "bf16-true", weight_update="kahan")``: the default state (bf16
                    exp_avg; exp_avg_sq fp32 at beta2 0.999, bf16 where it can move)
bf16-true+sr        the same with ``weight_update="stochastic"``
optimi-kahan        torch-optimi ``AdamW(kahan_sum=True)``: bf16 state at any beta2
==================  ==========================================================================

The table gives mean and standard deviation over all seeds run (the run-to-run noise the paths are compared
within) and the per-seed values. Usage::

    python benchmarks/pure_bf16_accuracy.py --workloads cnn,lm --seeds 0,1,2 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import types

import torch

from mixprec import CompensatedOptimizer, MixedPrecisionOptimizer, initialize
from mixprec.bench.workloads import WORKLOADS

PATHS = ("fp32", "kahan-fp32state", "bf16-true+kahan", "bf16-true+sr", "optimi-kahan")


def prepare(path: str, model: torch.nn.Module, optimizer: torch.optim.AdamW):
    """The model and optimizer of ``path``, from the workload's fp32 model and torch AdamW."""
    if path == "fp32":
        return model, optimizer
    if path in ("bf16-true+kahan", "bf16-true+sr"):
        update = "kahan" if path.endswith("kahan") else "stochastic"
        return initialize(model, optimizer, "bf16-true", weight_update=update)
    model.to(torch.bfloat16)
    if path == "kahan-fp32state":
        inner = CompensatedOptimizer(optimizer, "kahan", state_dtype=torch.float32)
        return model, MixedPrecisionOptimizer(inner, scaler=1.0, master_weights=False)
    import optimi

    group = optimizer.param_groups[0]
    return model, optimi.AdamW(
        model.parameters(), lr=group["lr"], betas=group["betas"], weight_decay=group["weight_decay"],
        kahan_sum=True,
    )  # fmt: skip


def run(name: str, data, path: str, seed: int, steps: int, beta2: float | None) -> dict:
    spec = WORKLOADS[name]
    preset = spec.presets["quick"]
    work = spec.build(data, preset, seed, steps, torch.device("cpu"))
    if beta2 is not None:
        for group in work.optimizer.param_groups:
            group["betas"] = (group["betas"][0], beta2)
    model, opt = prepare(path, work.model, work.optimizer)
    low = path != "fp32"
    scheduler = work.make_scheduler(opt) if work.make_scheduler else None

    def forward(x: torch.Tensor) -> torch.Tensor:
        return model(x.bfloat16() if low and x.is_floating_point() else x)

    start = time.process_time()
    for _ in range(steps):
        x, y = next(work.batches)
        opt.zero_grad()
        loss = work.loss_fn(forward(x).float(), y)
        opt.backward(loss) if hasattr(opt, "backward") else loss.backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()
    with torch.no_grad():
        held_out, metric = work.evaluate(forward)
    seconds = time.process_time() - start
    return {
        "workload": name,
        "path": path,
        "seed": seed,
        "loss": held_out,
        "metric": metric,
        "cpu_s": seconds,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", default="cnn,lm")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--steps", default="cnn=300,lm=150", help="steps per workload, NAME=N[,NAME=N]")
    parser.add_argument("--beta2", type=float, default=0.999, help="AdamW's beta2 (0 keeps the workload's)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="write every run to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    steps = {k: int(v) for k, v in (item.split("=") for item in args.steps.split(","))}
    beta2 = args.beta2 or None
    runs = []
    for name in args.workloads.split(","):
        for seed in map(int, args.seeds.split(",")):
            job = types.SimpleNamespace(seed=seed, images=None, data=None)
            data = WORKLOADS[name].load(WORKLOADS[name].presets["quick"], job)
            for path in args.paths.split(","):
                runs.append(run(name, data, path, seed, steps[name], beta2))
                print(json.dumps(runs[-1]), flush=True)
    print_table(runs, args)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"args": vars(args), "runs": runs}, out, indent=1)


def print_table(runs: list[dict], args: argparse.Namespace) -> None:
    print(f"AdamW betas (0.9, {args.beta2 or 'workload'}), seeds {args.seeds}; held-out loss and metric")
    print(f"{'workload':8} {'path':16} {'loss mean':>9} {'sd':>7} {'metric mean':>11} {'sd':>7}  per seed")
    for name in args.workloads.split(","):
        for path in args.paths.split(","):
            mine = [r for r in runs if r["workload"] == name and r["path"] == path]
            losses, metrics = [r["loss"] for r in mine], [r["metric"] for r in mine]
            sd = statistics.stdev if len(mine) > 1 else (lambda _: 0.0)
            seeds = " ".join(f"{m:.4f}" for m in metrics)
            print(
                f"{name:8} {path:16} {statistics.mean(losses):9.4f} {sd(losses):7.4f} "
                f"{statistics.mean(metrics):11.4f} {sd(metrics):7.4f}  {seeds}"
            )


if __name__ == "__main__":
    main()
