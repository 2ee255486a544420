"""The bias of stochastic rounding on block maxima (nearest, old and new SR rule) and its effect in training.

Issue 33 item 1: with the block scale rounded to nearest, a block's largest value can land above the
element max (6 for e2m1, 448 for e4m3) and is clamped; nearest rounding balances that clamp with
round-ups, stochastic rounding kept only the clamp. The new rule (``mixprec.lowbit.quantize`` with
``stochastic=True``) gives such a block the next coarser scale. The old rule is reproduced here by running
the same code with that step switched off (:func:`old_rule`), so before and after come from one run.

Part 1, bias: ``quantize(x, fmt)`` on the issue's two tensors (64x256 with an outlier column x300 and a
row x1e-3; 96x512 whose rows span 8 binades), ``--draws`` SR draws (one quantize of that many stacked
copies); the signed mean error of the dequantized value, toward zero negative, in % of the block amax, on
each block's largest value and elsewhere, with its standard error (nearest rounding is one deterministic
draw, so it has none).

Part 2, training: nvfp4 (stochastic rounding of the gradient operands, RHT; first and last Linear in
bf16, as benchmarks/lowbit_lm.py and the bench run it) trained with the old and the new rule from the same
seed (same weights, batches and SR draws), interleaved step by step, on two workloads: ``lm`` (the bench's
character GPT at the ``tiny`` width: d=64, 2 layers, context 32, batch 8; warm-up + cosine) and
``teacher`` (benchmarks/lowbit_lm.py's noisy-teacher classification, 4-layer MLP, 8192 held-out
examples). The figure is the held-out loss of new minus old per seed, with the mean's 95% t-interval. The
steps are few (CPU emulation of every 4-bit GEMM); say so when quoting.

Usage::

    python benchmarks/sr_bias.py --seeds 0 1 2 --lm-steps 40 --teacher-steps 60 --json sr_bias.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from unittest import mock

import torch
from scipy import stats

from mixprec.bench import data as datasets
from mixprec.bench.workloads import WORKLOADS
from mixprec.lowbit import block_scales, quantize
from mixprec.lowbit.formats import get_format

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lowbit_lm  # a sibling script, not a package

_Q = sys.modules["mixprec.lowbit.quantize"]
FORMATS = ("nvfp4", "mxfp4", "mxfp8_floor")
LM_TINY = {**WORKLOADS["lm"].presets["tiny"].params, "batch": 8, "corpus_bytes": 400_000, "eval_windows": 32}


@contextlib.contextmanager
def old_rule() -> Iterator[None]:
    """quantize as before the fix: nearest block scales (clamping block maxima) and no tensor headroom."""
    scale, tensor_scale = _Q._scale, block_scales.nvfp4_tensor_scale
    with (
        mock.patch.object(_Q, "_scale", lambda *a, unsaturated: scale(*a, unsaturated=False)),
        mock.patch.object(
            block_scales, "nvfp4_tensor_scale", lambda amax, headroom=False: tensor_scale(amax)
        ),
    ):
        yield


def tensors() -> dict[str, torch.Tensor]:
    """The issue's two tensors (the same as tests/lowbit/test_sr_unbiased.py)."""
    a = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    a[:, 7] *= 300
    a[5] *= 1e-3
    b = torch.randn(96, 512, generator=torch.Generator().manual_seed(1))
    return {"outliers 64x256": a, "binades 96x512": b * torch.exp2(torch.linspace(-4, 4, 96))[:, None]}


def bias(x: torch.Tensor, name: str, draws: int, stochastic: bool) -> dict[str, list[float]]:
    """``{"maxima"|"elsewhere": [signed mean error, its standard error]}`` in % of the block amax."""
    n = draws if stochastic else 1
    g = torch.Generator().manual_seed(2)
    q = quantize(x.repeat(n, 1), name, stochastic=stochastic, generator=g)
    deq = q.dequantize().reshape(n, *x.shape).double()
    rows, cols = get_format(name).block
    amax = block_scales.block_amax(x, rows, cols).repeat_interleave(rows, 0).repeat_interleave(cols, 1)
    err = (deq - x.double()) * x.sign() / amax * 100
    top = x.abs() == amax
    out = {}
    for group, mask in (("maxima", top), ("elsewhere", ~top & (x != 0))):
        se = (err.var(0)[mask].sum() / n).sqrt() / mask.sum() if stochastic else torch.zeros(())
        out[group] = [err.mean(0)[mask].mean().item(), se.item()]
    return out


def bias_table(draws: int) -> dict:
    results: dict = {}
    print(f"bias in % of the block amax (signed, toward zero < 0), {draws} SR draws, +- one standard error")
    print(f"{'tensor':<16} {'format':<7} {'rule':<8} {'block maxima':>20} {'elsewhere':>20}")
    for tname, x in tensors().items():
        for name in FORMATS:
            for rule in ("nearest", "old SR", "new SR"):
                with old_rule() if rule == "old SR" else contextlib.nullcontext():
                    r = bias(x, name, draws, rule != "nearest")
                results.setdefault(tname, {}).setdefault(name, {})[rule] = r
                cells = [f"{m:+.4f} +- {se:.4f}" for m, se in r.values()]
                print(f"{tname:<16} {name:<7} {rule:<8} {cells[0]:>20} {cells[1]:>20}")
    return results


class Arm:
    """One (workload, seed, rule) nvfp4 run, stepped one step at a time."""

    def __init__(self, task: str, seed: int, steps: int, old: bool) -> None:
        if task == "lm":
            spec = WORKLOADS["lm"]
            preset = replace(spec.presets["tiny"], params=LM_TINY)
            corpus = datasets.text_corpus(LM_TINY["corpus_bytes"], None)
            self.work = spec.build(corpus, preset, seed, steps, torch.device("cpu"))
        else:
            self.work = lowbit_lm._classify(seed, steps, torch.device("cpu"), teacher=True)
        lowbit_lm._convert("nvfp4", self.work.model, seed)  # SR generator seeded by the seed, as lowbit_lm
        make = self.work.make_scheduler
        self.scheduler = make(self.work.optimizer) if make else None
        self.rule = old_rule if old else contextlib.nullcontext

    def step(self) -> None:
        x, y = next(self.work.batches)
        with self.rule(), torch.autocast("cpu", dtype=torch.bfloat16):
            loss = self.work.loss_fn(self.work.model(x), y)
        with self.rule():
            loss.backward()
        self.work.optimizer.step()
        self.work.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()

    def evaluate(self) -> float:
        self.work.model.eval()

        def forward(inp: torch.Tensor) -> torch.Tensor:
            with self.rule(), torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                return self.work.model(inp)

        return self.work.evaluate(forward)[0]


def train(task: str, seeds: list[int], steps: int) -> dict:
    arms = [Arm(task, s, steps, old) for s in seeds for old in (True, False)]
    for step in range(steps):
        for i in range(len(arms)):  # the order rotates each step, so machine load hits every arm alike
            arms[(step + i) % len(arms)].step()
    losses = [arm.evaluate() for arm in arms]
    old, new = losses[0::2], losses[1::2]
    diff = [n - o for n, o in zip(new, old, strict=True)]
    mean = statistics.mean(diff)
    half = stats.t.ppf(0.975, len(diff) - 1) * statistics.stdev(diff) / len(diff) ** 0.5
    rel = [d / o * 100 for d, o in zip(diff, old, strict=True)]
    cells = f"old {' '.join(f'{v:.4f}' for v in old)}  new {' '.join(f'{v:.4f}' for v in new)}"
    interval = f"[{mean - half:+.4f}, {mean + half:+.4f}] ({statistics.mean(rel):+.2f}%)"
    print(f"{task:<8} {steps:>5} steps  {cells}  new-old {mean:+.4f} {interval}")
    return {
        "steps": steps,
        "seeds": seeds,
        "old": old,
        "new": new,
        "diff_mean": mean,
        "ci95": [mean - half, mean + half],
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--draws", type=int, default=200)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--lm-steps", type=int, default=40)
    parser.add_argument("--teacher-steps", type=int, default=60)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    if len(args.seeds) < 2:
        parser.error("--seeds needs at least two seeds for an interval")
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    results = {"bias": bias_table(args.draws), "draws": args.draws, "torch": torch.__version__}
    print("\nnvfp4 held-out loss, old vs new SR rule (paired by seed; 95% t-interval of the mean difference)")
    results["training"] = {}
    for task, steps in (("lm", args.lm_steps), ("teacher", args.teacher_steps)):
        if steps > 0:
            results["training"][task] = train(task, args.seeds, steps)
    results["wall_s"] = time.perf_counter() - start
    print(f"wall {results['wall_s']:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
