"""The precision planner against uniform nvfp4 and two hand rules, by held-out loss after training.

Three tasks:

* ``teacher``: a classification task whose held-out loss resolves a few percent: 64 input channels of
  lognormal scale, labels sampled from a fixed random teacher MLP's softmax (noisy, so the task cannot be
  memorised), 32768 train / 8192 held-out examples drawn from the seed; the outlier MLP
  (``mixprec.inspect.demo.OutlierMLP``: 64-128-128-128-10, its third layer fed one channel 300x the
  others, that layer's weight column divided by 300);
* ``digits``: scikit-learn's bundled 8x8 digits, flattened, the same outlier MLP. Kept for comparison: its
  360 held-out images cannot resolve a few percent (the ``fp32`` run below shows by how much rounding
  alone moves that loss);
* ``lm``: the bench's character-level GPT (``mixprec.bench`` workload ``lm`` at its ``tiny`` size, Python
  stdlib sources).

Per task and seed: train ``--warmup`` steps under bf16 autocast, plan on ``--plan-batches`` training
batches (``mixprec.plan.plan_precision``, formats nvfp4 / mxfp8 / bf16, ``--budget``, cost
``b200-peak``, optionally ``--grad-budget``, the whole plan also checked on ``--check-batches`` other
training batches), then from
that same state train ``--steps`` more steps under each assignment, bf16 autocast around all of them:

* ``bf16``: every linear in bf16;  ``fp32``: no autocast at all (the noise floor: how far rounding
  alone moves the held-out loss);  ``nvfp4``: every linear nvfp4 (the full recipe: SR, RHT, 2-D weights);
* ``plan``: the planner's formats;
* ``first-last``: the first and last linear layers (widening inward, more) in bf16, the rest in the rule's
  format, as many kept as brings the share of GEMM FLOPs below bf16 closest to the plan's;
* ``size``: the smallest layers (by N x K, as torchtitan's ``auto_filter_small_kn``) in bf16, the rest in
  the rule's format, matched to the plan's low-precision share the same way.

``--extra NAME:LAYER=FORMAT,...`` trains more assignments beside them (e.g. one layer in nvfp4, the rest
mxfp8), and ``--max-flushed`` sets the planner's forward-flush limit (1 turns it off).

Each rule runs once per ``--rule-formats`` entry (nvfp4: the NVFP4 recipe's choice; mxfp8: torchtitan's
filter is for 8-bit training), named e.g. ``size/nvfp4``. At the same share an nvfp4 rule is cheaper than a
plan that mixes 8- and 4-bit formats and an mxfp8 rule dearer; the table prints each cost.

With ``--planning-rounds R`` it trains nothing after the warm-up and times the planner instead: R
interleaved rounds of a lazy plan (the default: each layer's cheapest admissible format first) and an
``exhaustive=True`` one (every layer in every format), their passes and CPU seconds (median, IQR), and
whether they chose the same formats.

Reports held-out loss, the gap to bf16, the plan's measured divergence against the budget, and planning CPU
time against one training step (process time; the machine is shared with other jobs, so wall time is
not used). GEMMs are emulated on a CPU (exact, slow): the loss is the figure that counts here.

Usage::

    python benchmarks/plan_precision.py --threads 1 --json benchmarks/plan_precision.json
    python benchmarks/plan_precision.py --tasks teacher --seeds 0 1 2
    python benchmarks/plan_precision.py --tasks teacher lm --planning-rounds 5
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
from mixprec.inspect.demo import OutlierMLP
from mixprec.plan import PrecisionPlan, plan_precision

FMT = ("nvfp4", "mxfp8", "bf16")


def _stream(split: datasets.Split, seed: int):
    g = torch.Generator().manual_seed(seed)
    while True:
        idx = torch.randint(0, len(split.y_train), (64,), generator=g)
        yield split.x_train[idx], split.y_train[idx]


def _classify(split: datasets.Split, seed: int):
    torch.manual_seed(seed)
    model = OutlierMLP()

    def evaluate(m: nn.Module, autocast: bool = True) -> float:
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            return F.cross_entropy(m(split.x_test).float(), split.y_test).item()

    return model, _stream(split, seed), evaluate, 2e-3


def _digits(seed: int):
    return _classify(datasets.sklearn_digits(seed), seed)


def _teacher(seed: int):
    g = torch.Generator().manual_seed(1000 + seed)
    scales = torch.exp(torch.randn(64, generator=g))  # lognormal channel magnitudes: a few outliers
    teacher = [torch.randn(64, 128, generator=g) / 8, torch.randn(128, 10, generator=g) / 4]
    x = torch.randn(40960, 64, generator=g) * scales
    logits = torch.tanh((x / scales) @ teacher[0]) @ teacher[1] * 3
    y = torch.multinomial(torch.softmax(logits, 1), 1, generator=g).squeeze(1)
    split = datasets.Split(x[:32768], y[:32768], x[32768:], y[32768:], source="random teacher MLP")
    return _classify(split, seed)


def _lm(seed: int):
    spec = WORKLOADS["lm"]
    preset = spec.presets["tiny"]
    preset = replace(preset, params={**preset.params, "batch": 8, "eval_windows": 32})
    corpus = datasets.text_corpus(preset.params["corpus_bytes"])
    work = spec.build(corpus, preset, seed, 1, torch.device("cpu"))

    def evaluate(m: nn.Module, autocast: bool = True) -> float:
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            return work.evaluate(m)[0]

    return work.model, work.batches, evaluate, preset.params["lr"]


TASKS = {"teacher": _teacher, "digits": _digits, "lm": _lm}


def loss_fn(model: nn.Module, batch) -> torch.Tensor:
    logits = model(batch[0]).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[1].reshape(-1))


def _train(model: nn.Module, batches: list, lr: float, autocast: bool = True) -> float:
    """Train on ``batches`` under bf16 autocast (or none); returns the median CPU seconds per step."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    times = []
    for batch in batches:
        start = time.process_time()
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
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


def _low_share(plan: PrecisionPlan, formats: dict[str, str]) -> float:
    return sum(plan.flop_share(f) for f, fmt in formats.items() if fmt not in ("bf16", "fp32"))


def _matched(plan: PrecisionPlan, order: list[str], low: str) -> dict[str, str]:
    """``low`` everywhere but a prefix of ``order`` in bf16: the prefix whose share of GEMM FLOPs below
    bf16 is closest to the plan's (the shorter prefix on a tie)."""
    best = None
    for keep in range(len(order) + 1):
        formats = {f: ("bf16" if f in order[:keep] else low) for f in plan.formats}
        gap = abs(_low_share(plan, formats) - plan.low_precision_share())
        if best is None or gap < best[0] - 1e-12:
            best = (gap, formats)
    return best[1]


def _assignments(plan: PrecisionPlan, rule_formats: list[str]) -> dict[str, dict[str, str]]:
    names = list(plan.formats)
    inward = [n for pair in zip(names, reversed(names), strict=True) for n in pair]
    inward = list(dict.fromkeys(inward))
    by_size = sorted(names, key=lambda n: plan.layers[n]["shape"][1] * plan.layers[n]["shape"][2])
    runs = {
        "bf16": dict.fromkeys(names, "bf16"),
        "fp32": dict.fromkeys(names, "fp32"),
        "nvfp4": dict.fromkeys(names, "nvfp4"),
        "plan": dict(plan.formats),
    }
    for low in rule_formats:
        runs[f"first-last/{low}"] = _matched(plan, inward, low)
        runs[f"size/{low}"] = _matched(plan, by_size, low)
    return runs


def _extra(specs: list[str]) -> dict[str, dict[str, str]]:
    """``NAME:LAYER=FORMAT,...`` -> {NAME: {LAYER: FORMAT}}."""
    out = {}
    for spec in specs:
        name, _, pairs = spec.partition(":")
        out[name] = dict(pair.split("=", 1) for pair in pairs.split(","))
    return out


def run(task: str, seed: int, args: argparse.Namespace) -> dict:
    model, stream, evaluate, lr = TASKS[task](seed)
    _train(model, [next(stream) for _ in range(args.warmup)], lr)
    planning = [next(stream) for _ in range(args.plan_batches)]
    checks = [next(stream) for _ in range(args.check_batches)] or None
    plan = plan_precision(
        model,
        planning,
        loss_fn,
        formats=FMT,
        budget=args.budget,
        cost="b200-peak",
        grad_budget=args.grad_budget,
        max_flushed=args.max_flushed,
        check_batches=checks,
        seed=seed,
        measure=args.measure,
    )
    print(plan.table(), flush=True)
    draws = [next(stream) for _ in range(args.steps * args.repeats)]
    data = [draws[r * args.steps : (r + 1) * args.steps] for r in range(args.repeats)]
    out = {"task": task, "seed": seed, "plan": json.loads(plan.to_json()), "runs": {}, "dual": {}}
    assignments = {**_assignments(plan, args.rule_formats), **_extra(args.extra)}
    if args.dual:
        for rule in [name for name in assignments if "/" in name]:
            try:
                dual = _dual_plan(model, planning, checks, plan, assignments[rule], seed, args)
            except ValueError as exc:  # e.g. the rule's cost needs a format the flush limit rules out
                print(f"{task} seed {seed} plan@{rule}: refused: {exc}", flush=True)
                out["dual"][rule] = {"refused": str(exc)}
                continue
            assignments[f"plan@{rule}"] = dict(dual.formats)
            out["dual"][rule] = json.loads(dual.to_json())
    for name, formats in assignments.items():
        autocast = name != "fp32"
        losses, steps = [], []
        for repeat, batches in enumerate(data):  # each repeat: the same state, other training batches
            trained = copy.deepcopy(model)
            torch.manual_seed(seed + 1000 * repeat)
            PrecisionPlan(formats, plan.layers, plan.reasons, plan.budget, plan.measured).apply(trained)
            steps.append(_train(trained, batches, lr, autocast))
            losses.append(evaluate(trained, autocast))
        share, cost = _low_share(plan, formats), _cost(plan, formats)
        loss, step = statistics.mean(losses), statistics.median(steps)
        out["runs"][name] = {
            "loss": loss,
            "losses": losses,
            "low_share": share,
            "cost": cost,
            "step_s": step,
            "formats": formats,
        }
        print(
            f"{task} seed {seed} {name:<16} held-out loss {loss:.4f} "
            f"low-bit FLOPs {share:.0%} cost {cost:.2f} step {step * 1e3:.1f} ms",
            flush=True,
        )
    runs = out["runs"]
    rules = [name for name in runs if "/" in name and not name.startswith("plan@")]
    differ = {
        f"{which} vs {rule}": {
            f: (fmt, runs[rule]["formats"][f])
            for f, fmt in runs[which]["formats"].items()
            if fmt != runs[rule]["formats"][f]
        }
        for rule in rules
        for which in ("plan", f"plan@{rule}")
        if which in runs
    }
    print(f"{task} seed {seed}: where the plan differs from each hand rule, layer: (plan, rule): {differ}")
    out["differs"] = differ
    out["plan_seconds"], out["step_seconds"] = plan.seconds, out["runs"]["bf16"]["step_s"]
    return out


def _dual_plan(model, planning, checks, plan, rule, seed, args) -> PrecisionPlan:
    """The most accurate plan at a hand rule's share below bf16 and cost (``max_cost``, ``min_low_share``)."""
    dual = plan_precision(
        model,
        planning,
        loss_fn,
        formats=FMT,
        budget=None,
        max_cost=_cost(plan, rule),
        min_low_share=_low_share(plan, rule),
        cost="b200-peak",
        max_flushed=args.max_flushed,
        check_batches=checks,
        seed=seed,
    )
    print(dual.table(), flush=True)
    return dual


def _quartiles(values: list[float]) -> list[float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
    return [q[0], statistics.median(values), q[-1]]


def planning(task: str, seed: int, args: argparse.Namespace) -> dict:
    """Lazy against exhaustive measurement of one plan, interleaved: passes and CPU seconds."""
    model, stream, _evaluate, lr = TASKS[task](seed)
    _train(model, [next(stream) for _ in range(args.warmup)], lr)
    batches = [next(stream) for _ in range(args.plan_batches)]
    kwargs = {"formats": FMT, "budget": args.budget, "cost": "b200-peak", "grad_budget": args.grad_budget}
    out: dict = {"task": task, "seed": seed, "lazy": [], "exhaustive": [], "same_formats": True}
    for _ in range(args.planning_rounds):
        for mode in ("lazy", "exhaustive"):
            plan = plan_precision(
                model, batches, loss_fn, exhaustive=mode == "exhaustive", seed=seed, **kwargs
            )
            out[mode].append({"seconds": plan.seconds, "passes": plan.passes, "formats": plan.formats})
        out["same_formats"] &= out["lazy"][-1]["formats"] == out["exhaustive"][-1]["formats"]
    for mode in ("lazy", "exhaustive"):
        seconds = _quartiles([r["seconds"] for r in out[mode]])
        out[f"{mode}_seconds"], out[f"{mode}_passes"] = seconds, out[mode][-1]["passes"]
        print(
            f"{task} seed {seed} {mode:<10} {out[mode][-1]['passes']:>3} passes, planning {seconds[1]:.3f} s "
            f"CPU (IQR {seconds[0]:.3f}-{seconds[2]:.3f}), formats {out[mode][-1]['formats']}",
            flush=True,
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", nargs="+", default=["teacher", "lm"], choices=list(TASKS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--budget", type=float, default=0.01)
    parser.add_argument("--grad-budget", type=float, default=None)
    parser.add_argument("--max-flushed", type=float, default=0.15)
    parser.add_argument(
        "--extra",
        nargs="*",
        default=[],
        metavar="NAME:LAYER=FORMAT,...",
        help="more assignments to train, e.g. fc1-nvfp4:fc1=nvfp4,fc2=mxfp8,fc3=mxfp8,head=mxfp8",
    )
    parser.add_argument("--plan-batches", type=int, default=2)
    parser.add_argument("--check-batches", type=int, default=0)
    parser.add_argument("--rule-formats", nargs="+", default=["nvfp4", "mxfp8"])
    parser.add_argument("--planning-rounds", type=int, default=0)
    parser.add_argument(
        "--measure", choices=("exact", "local"), default="exact", help="the planner's measure="
    )
    parser.add_argument(
        "--repeats", type=int, default=1, help="train each assignment this many times on other batches"
    )
    parser.add_argument(
        "--dual",
        action="store_true",
        help="also plan at each hand rule's share and cost (max_cost, min_low_share) and train that plan",
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = []
    if args.planning_rounds > 0:
        results = [planning(task, seed, args) for task in args.tasks for seed in args.seeds]
        if args.json:
            with open(args.json, "w") as handle:
                json.dump({"args": vars(args), "results": results}, handle, indent=1)
        return
    for task in args.tasks:
        for seed in args.seeds:
            results.append(run(task, seed, args))
            _summary(results, args)  # so a run stopped early leaves what it measured
    _summary(results, args, show=True)


def _paired(results: list[dict]) -> dict:
    """Per hand rule, ``plan - rule`` and ``plan@rule - rule`` held-out loss over bf16's, in points, one
    pair per (seed, repeat) (each pair trained on the same batches): mean, a 95% t interval, the range and
    wins / ties / losses (a tie: under 0.05 points). Also the noise: the spread of bf16 itself over
    repeats (same state, other batches)."""
    out: dict = {}
    rules = {name for r in results for name in r["runs"] if "/" in name and not name.startswith("plan@")}
    for rule in sorted(rules):
        for which in ("plan", f"plan@{rule}"):
            diffs = []
            for r in results:
                runs = r["runs"]
                if which not in runs or rule not in runs:
                    continue
                for a, b, base in zip(
                    runs[which]["losses"], runs[rule]["losses"], runs["bf16"]["losses"], strict=True
                ):
                    diffs.append(100 * (a - b) / base)
            if diffs:
                out[f"{which} - {rule}"] = _interval(diffs)
    noise = [
        100 * (loss / statistics.mean(r["runs"]["bf16"]["losses"]) - 1)
        for r in results
        for loss in r["runs"]["bf16"]["losses"]
    ]
    out["bf16 repeat spread"] = _interval(noise) if len(noise) > 1 else None
    return out


def _interval(values: list[float]) -> dict:
    mean = statistics.mean(values)
    half = 0.0
    if len(values) > 1:
        from scipy.stats import t  # scikit-learn's dependency, so installed with the bench extras

        half = float(t.ppf(0.975, len(values) - 1)) * statistics.stdev(values) / len(values) ** 0.5
    return {
        "n": len(values),
        "mean": mean,
        "ci95": [mean - half, mean + half],
        "range": [min(values), max(values)],
        "wins_ties_losses": [
            sum(v < -0.05 for v in values),
            sum(abs(v) <= 0.05 for v in values),
            sum(v > 0.05 for v in values),
        ],
    }


def _summary(results: list[dict], args: argparse.Namespace, show: bool = False) -> None:
    if show:
        head = (
            f"{'task':<7} {'seed':>4} {'run':<16} {'held-out':>9} {'vs bf16':>8} {'low-bit':>8} {'cost':>5}"
        )
        print("\n" + head)
    for r in results if show else []:
        base = r["runs"]["bf16"]["loss"]
        for name, v in r["runs"].items():
            print(
                f"{r['task']:<7} {r['seed']:>4} {name:<16} {v['loss']:>9.4f} {v['loss'] / base - 1:>+8.2%} "
                f"{v['low_share']:>8.0%} {v['cost']:>5.2f}"
            )
        m = r["plan"]["measured"]
        print(
            f"        plan measured loss divergence {m['loss']:.3g} (budget {r['plan']['budget']:g}), "
            f"weight-gradient divergence {m['weight_grad']:.3g}; planning {r['plan_seconds']:.1f} s CPU = "
            f"{r['plan_seconds'] / r['step_seconds']:.0f} bf16 training steps"
        )
    paired = _paired(results)
    if show:
        print("\npaired held-out loss differences, points of bf16's loss (negative: the plan is better)")
        for name, v in paired.items():
            if v is not None:
                print(
                    f"  {name:<40} mean {v['mean']:+.2f} [95% {v['ci95'][0]:+.2f}, {v['ci95'][1]:+.2f}] "
                    f"range {v['range'][0]:+.2f}..{v['range'][1]:+.2f} n {v['n']} "
                    f"wins/ties/losses {v['wins_ties_losses']}"
                )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"args": vars(args), "results": results, "paired": paired}, handle, indent=1)


if __name__ == "__main__":
    main()
