"""The precision planner against uniform nvfp4 and two hand rules, by held-out loss after training.

Two tasks: ``digits`` (scikit-learn's bundled 8x8 digits, flattened, a 4-layer ReLU MLP whose third layer is
fed one channel 300x the others, its weight column divided by 300: the outlier case) and ``lm`` (the bench's
character-level GPT, ``mixprec.bench`` workload ``lm`` at its ``tiny`` size, Python stdlib sources). Per
task and seed: train ``--warmup`` steps under bf16 autocast, plan on two training batches
(``mixprec.inspect.plan_precision``, formats nvfp4 / mxfp8 / bf16, ``--budget``, cost ``b200-peak``), then
from that same state train ``--steps`` more steps under each assignment, bf16 autocast around all of them:

* ``bf16``: every linear in bf16;  ``nvfp4``: every linear nvfp4 (the full recipe: SR, RHT, 2-D weights);
* ``plan``: the planner's formats;
* ``first-last``: the first and last linear layers (and, widening inward, more) in bf16, the rest nvfp4,
  widened until its GEMM cost (the plan's cost model) is the closest to the plan's;
* ``size``: the smallest layers (by N x K, as torchtitan's ``auto_filter_small_kn``) in bf16, the rest
  nvfp4, at the cost closest to the plan's.

The hand rules are matched on cost, not on the share of FLOPs below bf16: the plan mixes 8- and 4-bit
formats, and a rule at the plan's share in nvfp4 alone would be cheaper than the plan.

Reports held-out loss, the gap to bf16, the plan's measured divergence against the budget, and planning CPU
time against one training step (process time; the machine is shared with other jobs, so wall time is
not used). GEMMs are emulated on a CPU (exact, slow): the loss is the figure that counts here.

Usage::

    python benchmarks/plan_precision.py --threads 1 --json benchmarks/plan_precision.json
    python benchmarks/plan_precision.py --tasks digits --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from mixprec.bench import data as datasets
from mixprec.bench.workloads import WORKLOADS
from mixprec.inspect import PrecisionPlan, plan_precision
from mixprec.inspect.demo import OutlierMLP

FMT = ("nvfp4", "mxfp8", "bf16")


def _digits(seed: int):
    split = datasets.sklearn_digits(seed)
    torch.manual_seed(seed)
    model = OutlierMLP()
    g = torch.Generator().manual_seed(seed)

    def batches():
        while True:
            idx = torch.randint(0, len(split.y_train), (64,), generator=g)
            yield split.x_train[idx], split.y_train[idx]

    def evaluate(m: nn.Module) -> float:
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
            return F.cross_entropy(m(split.x_test).float(), split.y_test).item()

    return model, batches(), evaluate, 2e-3


def _lm(seed: int):
    spec = WORKLOADS["lm"]
    preset = spec.presets["tiny"]
    preset = replace(preset, params={**preset.params, "batch": 8, "eval_windows": 32})
    corpus = datasets.text_corpus(preset.params["corpus_bytes"])
    work = spec.build(corpus, preset, seed, 1, torch.device("cpu"))

    def evaluate(m: nn.Module) -> float:
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
            return work.evaluate(m)[0]

    return work.model, work.batches, evaluate, preset.params["lr"]


TASKS = {"digits": _digits, "lm": _lm}


def loss_fn(model: nn.Module, batch) -> torch.Tensor:
    logits = model(batch[0]).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[1].reshape(-1))


def _train(model: nn.Module, batches: list, lr: float) -> float:
    """Train on ``batches`` under bf16 autocast; returns the median CPU seconds per step."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    times = []
    for batch in batches:
        start = time.process_time()
        with torch.autocast("cpu", torch.bfloat16):
            loss = loss_fn(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        times.append(time.process_time() - start)
    return statistics.median(times)


def _cost(plan: PrecisionPlan, formats: dict[str, str]) -> float:
    """GEMM cost of ``formats`` over all-bf16 in the plan's cost model (b200-peak: nvfp4 0.25, mxfp8 0.5)."""
    total = sum(plan.layers[f]["cost"][fmt] for f, fmt in formats.items())
    return total / sum(info["cost"]["bf16"] for info in plan.layers.values())


def _matched(plan: PrecisionPlan, order: list[str]) -> dict[str, str]:
    """nvfp4 everywhere but a prefix of ``order`` in bf16: the prefix whose cost is closest to the plan's."""
    best = None
    for keep in range(len(order) + 1):
        formats = {f: ("bf16" if f in order[:keep] else "nvfp4") for f in plan.formats}
        gap = abs(_cost(plan, formats) - plan.relative_cost())
        if best is None or gap < best[0] - 1e-12:
            best = (gap, formats)
    return best[1]


def _assignments(plan: PrecisionPlan) -> dict[str, dict[str, str]]:
    names = list(plan.formats)
    inward = [n for pair in zip(names, reversed(names), strict=True) for n in pair]
    inward = list(dict.fromkeys(inward))
    by_size = sorted(names, key=lambda n: plan.layers[n]["shape"][1] * plan.layers[n]["shape"][2])
    return {
        "bf16": dict.fromkeys(names, "bf16"),
        "nvfp4": dict.fromkeys(names, "nvfp4"),
        "plan": dict(plan.formats),
        "first-last": _matched(plan, inward),
        "size": _matched(plan, by_size),
    }


def run(task: str, seed: int, args: argparse.Namespace) -> dict:
    model, stream, evaluate, lr = TASKS[task](seed)
    _train(model, [next(stream) for _ in range(args.warmup)], lr)
    planning = [next(stream) for _ in range(2)]
    plan = plan_precision(
        model, planning, loss_fn, formats=FMT, budget=args.budget, cost="b200-peak", seed=seed
    )
    print(plan.table(), flush=True)
    data = [next(stream) for _ in range(args.steps)]
    out = {"task": task, "seed": seed, "plan": json.loads(plan.to_json()), "runs": {}}
    for name, formats in _assignments(plan).items():
        trained = copy.deepcopy(model)
        torch.manual_seed(seed)
        PrecisionPlan(formats, plan.layers, plan.reasons, plan.budget, plan.measured).apply(trained)
        step = _train(trained, data, lr)
        share = sum(plan.flop_share(f) for f, fmt in formats.items() if fmt != "bf16")
        cost = _cost(plan, formats)
        out["runs"][name] = {"loss": evaluate(trained), "low_share": share, "cost": cost, "step_s": step}
        out["runs"][name]["formats"] = formats
        print(
            f"{task} seed {seed} {name:<10} held-out loss {out['runs'][name]['loss']:.4f} "
            f"low-bit FLOPs {share:.0%} cost {cost:.2f} step {step * 1e3:.1f} ms",
            flush=True,
        )
    runs = out["runs"]
    differ = {
        rule: {
            f: (fmt, runs[rule]["formats"][f])
            for f, fmt in plan.formats.items()
            if fmt != runs[rule]["formats"][f]
        }
        for rule in ("first-last", "size")
    }
    print(f"{task} seed {seed}: where the plan differs from each hand rule, layer: (plan, rule): {differ}")
    out["differs"] = differ
    out["plan_seconds"], out["step_seconds"] = plan.seconds, out["runs"]["bf16"]["step_s"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--budget", type=float, default=0.1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = [run(task, seed, args) for task in args.tasks for seed in args.seeds]
    print(f"\n{'task':<7} {'seed':>4} {'run':<10} {'held-out':>9} {'vs bf16':>8} {'low-bit':>8} {'cost':>5}")
    for r in results:
        base = r["runs"]["bf16"]["loss"]
        for name, v in r["runs"].items():
            print(
                f"{r['task']:<7} {r['seed']:>4} {name:<10} {v['loss']:>9.4f} {v['loss'] / base - 1:>+8.1%} "
                f"{v['low_share']:>8.0%} {v['cost']:>5.2f}"
            )
        m = r["plan"]["measured"]
        print(
            f"        plan measured loss divergence {m['loss']:.3g} / score {m['score']:.3g} "
            f"(budget {r['plan']['budget']:g}); planning {r['plan_seconds']:.1f} s CPU = "
            f"{r['plan_seconds'] / r['step_seconds']:.0f} bf16 training steps"
        )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"args": vars(args), "results": results}, handle, indent=1)


if __name__ == "__main__":
    main()
