"""What the huge-gradient guard costs: a training step with it against the same step without it.

``python benchmarks/huge_gradient_guard.py --threads 1 --json benchmarks/huge_gradient_guard.json``

For each path (O1, O2, bf16-true) and width, two copies of the same model and optimizer are built in this
process, one with the guard (:mod:`mixprec.optim.guard`) and one with it removed; their training steps
(forward, backward, ``step()``) alternate, so drift and other jobs on the machine hit both alike. Times are
CPU time (``time.process_time``) of blocks of ``--steps`` steps; the table gives the median per-step time of
each and the median of the per-round ratios, with the interquartile range in brackets.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
from torch import nn

import mixprec

PATHS = ("O1", "O2", "bf16-true")


def _build(path: str, width: int, depth: int, guarded: bool) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.LayerNorm(width), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(width, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.99), weight_decay=0.01)
    model, opt = mixprec.initialize(model, opt, path)
    if not guarded:
        opt._scaler_view.guard = None
    return model, opt


def _block(model: nn.Module, opt: Any, x: torch.Tensor, y: torch.Tensor, steps: int) -> float:
    start = time.process_time()
    for _ in range(steps):
        opt.zero_grad()
        opt.backward(nn.functional.cross_entropy(model(x).float(), y))
        opt.step()
    return (time.process_time() - start) / steps


def _quartiles(values: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return q[1], q[2] - q[0]


def measure(path: str, width: int, args: argparse.Namespace) -> dict[str, Any]:
    pair = {name: _build(path, width, args.depth, name == "guard") for name in ("guard", "none")}
    torch.manual_seed(1)
    x, y = torch.randn(args.batch, width), torch.randint(0, 10, (args.batch,))
    times: dict[str, list[float]] = {"guard": [], "none": []}
    for model, opt in pair.values():
        _block(model, opt, x, y, args.warmup)
    for round_ in range(args.rounds):
        order = ("guard", "none") if round_ % 2 == 0 else ("none", "guard")
        for name in order:
            times[name].append(_block(*pair[name], x, y, args.steps))
    ratios = [g / n for g, n in zip(times["guard"], times["none"], strict=True)]
    row = {"path": path, "width": width, "ratio": _quartiles(ratios)}
    row.update({f"ms_{k}": tuple(1e3 * v for v in _quartiles(t)) for k, t in times.items()})
    row["runs"] = times
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--widths", default="256,1024")
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [measure(p, int(w), args) for p in args.paths.split(",") for w in args.widths.split(",")]
    print(f"{'path':<10} {'width':>5}  {'ms guard [IQR]':>16}  {'ms none [IQR]':>16}  {'ratio [IQR]':>14}")
    for r in rows:
        print(
            f"{r['path']:<10} {r['width']:>5}  {r['ms_guard'][0]:>8.2f} [{r['ms_guard'][1]:.2f}]  "
            f"{r['ms_none'][0]:>8.2f} [{r['ms_none'][1]:.2f}]  {r['ratio'][0]:>6.3f} [{r['ratio'][1]:.3f}]"
        )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"args": vars(args), "rows": rows}, handle, indent=1)


if __name__ == "__main__":
    main()
