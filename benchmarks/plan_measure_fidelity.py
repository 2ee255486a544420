"""The planner's one-pass estimates (``measure="local"``) against its exact per-layer passes.

Per task and seed (the tasks, loss and warm-up training of ``benchmarks/plan_precision.py``, imported):
train ``--warmup`` steps under bf16 autocast, take ``--plan-batches`` training batches, then

* **fidelity**: one ``exhaustive=True`` plan per mode, so every (layer, format) is measured exactly and
  estimated locally; per task, the Spearman rank correlation of the loss divergences (pooled over layers
  and formats, per seed) and the median and range of estimate / exact, for the first-order Taylor
  estimate ``|<g_y, dy>|`` and with the empirical-Fisher second-order term added;
* **choice and cost**: ``--rounds`` interleaved rounds of the default (lazy) plan in each mode: whether the
  two choose the same formats, each plan's GEMM cost over all-bf16 (b200-peak) and measured loss change,
  their passes and planning CPU seconds (process time, median and IQR). ``--second-order`` plans on the
  estimate with the empirical-Fisher term (the default is the first-order one, as the library's).

Usage::

    python benchmarks/plan_measure_fidelity.py --threads 1 --tasks teacher --seeds 0 1 2 3 4 --warmup 30 \\
        --budget 0.01 --json benchmarks/plan_measure_fidelity_teacher.json
    python benchmarks/plan_measure_fidelity.py --threads 1 --tasks lm --seeds 0 1 2 --warmup 150 \\
        --budget 0.002 --json benchmarks/plan_measure_fidelity_lm.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from typing import Any

import torch
from plan_precision import FMT, TASKS, _train, loss_fn  # benchmarks/ is on sys.path when run as a script

from mixprec.plan import plan_precision
from mixprec.plan.local import LocalMeasurer

ESTIMATES = ("loss_first_order", "loss_second_order")


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):  # ties share their mean rank
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2
        i = j + 1
    return ranks


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation: Pearson's of the ranks (ties at their mean rank)."""
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else float("nan")


def _quartiles(values: list[float]) -> list[float]:
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3
    return [q[0], statistics.median(values), q[-1]]


def run(task: str, seed: int, args: argparse.Namespace) -> dict:
    model, stream, _evaluate, lr = TASKS[task](seed)
    _train(model, [next(stream) for _ in range(args.warmup)], lr)
    batches = [next(stream) for _ in range(args.plan_batches)]
    kwargs = {"formats": FMT, "budget": args.budget, "cost": "b200-peak", "seed": seed}
    full = {
        m: plan_precision(model, batches, loss_fn, exhaustive=True, measure=m, **kwargs)
        for m in ("exact", "local")
    }
    pairs = []
    for fqn, info in full["exact"].layers.items():
        for fmt, d in info["divergence"].items():
            est = full["local"].layers[fqn]["divergence"][fmt]
            if fmt != "fp32" and d["loss"] is not None and est["loss"] is not None:
                pairs.append(
                    {"layer": fqn, "format": fmt, "exact": d["loss"], **{k: est[k] for k in ESTIMATES}}
                )
    out: dict = {"task": task, "seed": seed, "pairs": pairs, "rounds": {"exact": [], "local": []}}
    for key in ESTIMATES:
        out[f"spearman_{key}"] = spearman([p["exact"] for p in pairs], [p[key] for p in pairs])
    for _ in range(args.rounds):
        for mode in ("exact", "local"):
            plan = plan_precision(model, batches, loss_fn, measure=mode, **kwargs)
            out["rounds"][mode].append(
                {
                    "seconds": plan.seconds,
                    "passes": plan.passes,
                    "formats": plan.formats,
                    "measured": plan.measured,
                    "cost": plan.relative_cost(),
                    "low_share": plan.low_precision_share(),
                }
            )
    same = [a["formats"] == b["formats"] for a, b in zip(*out["rounds"].values(), strict=True)]
    out["same_formats"] = sum(same) / len(same)
    for mode, rounds in out["rounds"].items():
        out[f"{mode}_seconds"] = _quartiles([r["seconds"] for r in rounds])
        out[f"{mode}_passes"] = statistics.median(r["passes"] for r in rounds)
    print(
        f"{task} seed {seed}: cost exact {out['rounds']['exact'][0]['cost']:.3f} "
        f"local {out['rounds']['local'][0]['cost']:.3f}; spearman 1st {out['spearman_loss_first_order']:.3f} "
        f"2nd {out['spearman_loss_second_order']:.3f}; same plan {out['same_formats']:.0%}; "
        + "; ".join(
            f"{m} {out[f'{m}_passes']:.0f} passes {out[f'{m}_seconds'][1]:.3f} s "
            f"(IQR {out[f'{m}_seconds'][0]:.3f}-{out[f'{m}_seconds'][2]:.3f})"
            for m in ("exact", "local")
        ),
        flush=True,
    )
    return out


def summary(results: list[dict]) -> dict:
    """Per task: Spearman per seed, and estimate / exact pooled over seeds (median, min, max)."""
    tasks: dict = {}
    for r in results:
        t = tasks.setdefault(r["task"], {"pairs": [], "spearman": {k: [] for k in ESTIMATES}, "same": []})
        t["pairs"] += r["pairs"]
        t["same"].append(r["same_formats"])
        for key in ESTIMATES:
            t["spearman"][key].append(r[f"spearman_{key}"])
    out = {}
    for task, t in tasks.items():
        out[task] = {"spearman": t["spearman"], "same_formats": t["same"]}
        for key in ESTIMATES:
            ratios = [p[key] / p["exact"] for p in t["pairs"] if p["exact"] > 0]
            out[task][f"ratio_{key}"] = [statistics.median(ratios), min(ratios), max(ratios)]
            print(
                f"{task}: {key} spearman {min(t['spearman'][key]):.3f}-{max(t['spearman'][key]):.3f}, "
                f"estimate/exact median {out[task][f'ratio_{key}'][0]:.3g} "
                f"(range {min(ratios):.3g}-{max(ratios):.3g}, {len(ratios)} pairs)"
            )
    return out


def _plan_on_second_order() -> None:
    """Make the local estimates steer the plan by their second-order loss term, which the planner records
    but does not use (its rows-are-independent Fisher overstates attention's layers)."""
    first_order = LocalMeasurer._divergences

    def second_order(self: LocalMeasurer, fqn: str, fmt: str) -> Any:
        d = first_order(self, fqn, fmt)
        return d if d.loss_second_order is None else dataclasses.replace(d, loss=d.loss_second_order)

    LocalMeasurer._divergences = second_order  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", nargs="+", default=["teacher"], choices=list(TASKS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--budget", type=float, default=0.01)
    parser.add_argument("--plan-batches", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--second-order", action="store_true", help="plan on the estimate with the empirical-Fisher term"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.second_order:
        _plan_on_second_order()
    results = []
    for task in args.tasks:
        for seed in args.seeds:
            results.append(run(task, seed, args))
            if args.json:  # a run stopped early leaves what it measured
                with open(args.json, "w") as handle:
                    json.dump({"args": vars(args), "results": results}, handle, indent=1)
    total = summary(results)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"args": vars(args), "summary": total, "results": results}, handle, indent=1)


if __name__ == "__main__":
    main()
