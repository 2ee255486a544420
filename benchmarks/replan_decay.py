"""Switching to bf16 when the learning rate decays: uniform nvfp4 against nvfp4 then bf16, against bf16.

NVIDIA's NVFP4 pretraining report ("Pretraining Large Language Models with NVFP4", 2025) recovers most of
the loss gap of 4-bit training by running the last phase of the schedule (the learning-rate decay) in
bf16. This measures that on the bench's lm workload (``mixprec.bench`` workload ``lm``, character GPT on
Python stdlib sources, AdamW with linear warm-up and cosine decay to 10%), at the ``tiny`` width (d=64, 2
layers, context 32), batch 8, with :class:`mixprec.plan.ReplanSchedule` driving the
switch from a plain loop, as Fabric users would:

* ``bf16``: every linear layer plain, bf16 autocast;
* ``nvfp4``: every linear layer nvfp4 (``phases={0: "nvfp4"}``; stochastic rounding and the Hadamard
  transform on, as the recipe's default);
* ``nvfp4>bf16``: the same, with ``lr_decay="bf16"``: every layer plain from the first step whose learning
  rate is below ``--lr-fraction`` of its peak (0.2: about the last 20% of the steps).

All arms start from the same seed (same initial weights, same batches) and are interleaved step by step
(the order rotates each step), so machine load hits them alike. The figures: held-out loss (32 windows)
with the layers as trained, and with every layer plain under bf16 autocast (the weights' quality, apart
from the format the last forward ran in), each against bf16; and the share of the nvfp4 gap the switch
recovers. GEMMs are emulated on a CPU; the loss is what counts here, not time.

Usage::

    python benchmarks/replan_decay.py --threads 1 --seeds 0 1 2 --steps 400 \
        --json benchmarks/replan_decay.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
from collections.abc import Iterator
from dataclasses import replace

import torch
from torch import nn

from mixprec.bench import data as datasets
from mixprec.bench.workloads import WORKLOADS
from mixprec.lowbit import LowbitLinear
from mixprec.plan import ReplanSchedule

ARMS = ("bf16", "nvfp4", "nvfp4>bf16")


def _unplanned(model: nn.Module) -> None:
    raise AssertionError("the arms set formats by phase; nothing is planned here")


@contextlib.contextmanager
def _plain(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` with every LowbitLinear swapped for a plain nn.Linear on the same parameters, then back."""
    swapped = [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, LowbitLinear)]
    for fqn, module in swapped:
        with torch.device("meta"):
            plain = nn.Linear(module.in_features, module.out_features, bias=False)
        plain.weight, plain.bias = module.weight, module.bias
        parent, _, child = fqn.rpartition(".")
        setattr(model.get_submodule(parent), child, plain)
    try:
        yield model
    finally:
        for fqn, module in swapped:
            parent, _, child = fqn.rpartition(".")
            setattr(model.get_submodule(parent), child, module)


class Arm:
    def __init__(self, name: str, seed: int, steps: int, lr_fraction: float) -> None:
        spec = WORKLOADS["lm"]
        preset = spec.presets["tiny"]
        preset = replace(preset, params={**preset.params, "batch": 8, "eval_windows": 32})
        corpus = datasets.text_corpus(preset.params["corpus_bytes"])
        self.work = spec.build(corpus, preset, seed, steps, torch.device("cpu"))
        self.scheduler = self.work.make_scheduler(self.work.optimizer)
        self.name, self.switch = name, None
        phases = {0: "bf16" if name == "bf16" else "nvfp4"}
        decay = "bf16" if name == "nvfp4>bf16" else None
        generator = torch.Generator().manual_seed(seed)
        self.schedule = ReplanSchedule(
            _unplanned, phases=phases, lr_decay=decay, lr_fraction=lr_fraction, generator=generator
        )

    def step(self, step: int) -> None:
        work = self.work
        if self.schedule.begin_step(work.model, step, work.optimizer.param_groups[0]["lr"]) is not None:
            self.switch = step if step else self.switch
        x, y = next(work.batches)
        with torch.autocast("cpu", torch.bfloat16):
            loss = work.loss_fn(work.model(x), y)
        work.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        work.optimizer.step()
        self.scheduler.step()

    def evaluate(self) -> dict[str, float]:
        def held_out(model: nn.Module) -> float:
            with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
                return self.work.evaluate(model)[0]

        as_trained = held_out(self.work.model)
        with _plain(self.work.model) as plain:
            return {"as_trained": as_trained, "plain_bf16": held_out(plain)}


def run(seed: int, args: argparse.Namespace) -> dict:
    arms = [Arm(name, seed, args.steps, args.lr_fraction) for name in ARMS]
    for step in range(args.steps):
        for k in range(len(arms)):
            arms[(step + k) % len(arms)].step(step)
    result = {arm.name: {**arm.evaluate(), "switch_step": arm.switch} for arm in arms}
    for kind in ("as_trained", "plain_bf16"):
        ref, low, mixed = (result[a][kind] for a in ARMS)
        result[f"recovered_{kind}"] = (low - mixed) / (low - ref) if low != ref else float("nan")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--lr-fraction", type=float, default=0.2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = {}
    print(f"{'seed':>4} {'eval':<10} {'bf16':>8} {'nvfp4':>16} {'nvfp4>bf16':>16} {'recovered':>9} switch")
    for seed in args.seeds:
        r = results[seed] = run(seed, args)
        for kind in ("as_trained", "plain_bf16"):
            ref, low, mixed = (r[a][kind] for a in ARMS)
            print(
                f"{seed:>4} {kind:<10} {ref:>8.4f} {low:>8.4f} ({low / ref - 1:+.2%}) "
                f"{mixed:>8.4f} ({mixed / ref - 1:+.2%}) {r[f'recovered_{kind}']:>9.0%} "
                f"{r['nvfp4>bf16']['switch_step']}"
            )
    for kind in ("as_trained", "plain_bf16"):
        shares = [results[s][f"recovered_{kind}"] for s in args.seeds]
        print(
            f"recovered ({kind}): median {statistics.median(shares):.0%}, "
            f"per seed {', '.join(f'{x:.0%}' for x in shares)}"
        )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"args": vars(args), "results": results}, handle, indent=1)


if __name__ == "__main__":
    main()
