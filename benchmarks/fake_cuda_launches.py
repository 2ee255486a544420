"""Kernel launches and host syncs per optimizer step on fake CUDA: mixprec's fused Adam beside torch's.

Runs on a CUDA build of torch without a GPU (the fake-CUDA tier's harness, ``tests/fake_cuda``): bf16
parameters of a GPT's weight shapes (``benchmarks/optimizer_speed.py``'s; the default ``--width 2048
--layers 8`` is 403M parameters, which ``FakeTensorMode`` holds without allocating) are stepped
``--steps`` times by each config, and the harness's recorder counts, per step, the ops the host issues to
the device that run a kernel (views and bare allocations left out; a ``_foreach_*`` or fused op over a
long list may launch a few kernels on a GPU, torch's too) and the host syncs. Counts of dispatched ops,
not timings: they hold on any machine. Configs:

- ``torch-fused``: ``torch.optim.AdamW(fused=True)`` (bf16 moments, round to nearest);
- ``mixprec-kahan`` / ``mixprec-stochastic``: ``CompensatedOptimizer(AdamW, method)``;
- ``mixprec-int8``: ``CompensatedOptimizer(AdamW, "nearest", state_format="int8")``;

each mixprec config with ``skip_nonfinite=False`` (as torch: no check) and, in a ``+guard`` row, the default
``True`` (one read of the gradient norms per step).

    PYTHONPATH=src .ci/.venv-cuda/bin/python benchmarks/fake_cuda_launches.py [--width 2048 --layers 8]
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from fake_cuda import loops
from fake_cuda.harness import fake_cuda

import mixprec

LR, BETAS, WD = 1e-4, (0.9, 0.95), 0.1  # benchmarks/optimizer_speed.py's


def _adamw(params: list[torch.Tensor], **flags: bool) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, betas=BETAS, weight_decay=WD, **flags)


def configs() -> dict[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer]]:
    """Each config's optimizer on the given params."""
    out: dict[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer]] = {
        "torch-fused": lambda ps: _adamw(ps, fused=True)
    }
    for name, method, fmt in (
        ("mixprec-kahan", "kahan", None),
        ("mixprec-stochastic", "stochastic", None),
        ("mixprec-int8", "nearest", "int8"),
    ):
        for guard in (False, True):
            out[name + ("+guard" if guard else "")] = lambda ps, m=method, f=fmt, g=guard: (
                mixprec.CompensatedOptimizer(_adamw(ps), m, state_format=f, skip_nonfinite=g)
            )
    return out


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=2048, help="model width (default 2048)")
    parser.add_argument("--layers", type=int, default=8, help="blocks (8 at width 2048: 403M parameters)")
    parser.add_argument(
        "--steps", type=int, default=3, help="steps per config (default 3); the first warms up"
    )
    parser.add_argument(
        "--configs", default=",".join(configs()), help="comma-separated configs (default all)"
    )
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    if torch.version.cuda is None:
        parser.error(f"needs a CUDA build of torch (this is {torch.__version__}): .ci/run's .ci/.venv-cuda")
    if args.steps < 2:
        parser.error(f"--steps must be at least 2 (the first step warms up); got {args.steps}")
    makers = configs()
    names = args.configs.split(",")
    unknown = [n for n in names if n not in makers]
    if unknown:
        parser.error(f"unknown configs {unknown}; known: {', '.join(makers)}")
    shapes = loops.gpt_shapes(args.width, args.layers)
    numel = sum(torch.Size(s).numel() for s in shapes)
    rows = []
    with warnings.catch_warnings(), fake_cuda() as rec:
        warnings.simplefilter("ignore")
        for name in names:
            counts = loops.optimizer_launches(rec, makers[name], shapes, args.steps)
            rows.append({"config": name, "syncs": [s for s, _ in counts], "launches": [n for _, n in counts]})
    print(f"per optimizer step on fake CUDA, {numel:,} bf16 parameters ({len(shapes)} tensors), torch "
          f"{torch.__version__}; first step (creates the state) / later steps")  # fmt: skip
    print("| config | kernel launches / step | host syncs / step |\n|---|---|---|")
    for row in rows:
        launches, syncs = row["launches"], row["syncs"]
        print(f"| {row['config']} | {launches[0]} / {launches[-1]} | {syncs[0]} / {syncs[-1]} |")
    result = {"torch": torch.__version__, "numel": numel, "steps": args.steps, "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
