"""Host syncs and host-to-device copies per training step on fake CUDA, mixprec beside torch's same loop.

Runs on a CUDA build of torch without a GPU (the fake-CUDA tier's harness, ``tests/fake_cuda``): each loop
runs ``--steps`` steps on ``device="cuda"`` FakeTensors under ``FakeTensorMode`` at the given compute
capability, and the harness's recorder counts ``aten._local_scalar_dense`` (``.item()``, ``bool()``, ...),
data-dependent shapes and device-to-host copies as syncs, and host-to-device copies. Counts are of the
dispatched ops, not timings: they hold on any machine. Rows:

- optimizer paths: GradScaler (foreach / fused AdamW, on finite steps and on inf steps, which skip),
  CompensatedOptimizer, MixedPrecisionOptimizer, each beside the torch loop it replaces;
- one Linear layer's forward and backward for every float8 config (recipe x scaling) and every lowbit
  recipe (enumerated from the recipe tables), beside a bf16 ``F.linear`` forward and backward.

    PYTHONPATH=src .ci/.venv-cuda/bin/python benchmarks/fake_cuda_syncs.py [--capability 9,0] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from fake_cuda import loops
from fake_cuda.harness import Ctx, Recorder, fake_cuda

import mixprec
from mixprec.float8 import Float8Config, convert_to_float8_training
from mixprec.float8.config import RECIPE_NAMES, SCALINGS
from mixprec.float8.linear import Float8Linear
from mixprec.lowbit import RECIPES
from mixprec.lowbit.gemm import LowbitLinearFunction
from mixprec.optim import METHODS

M, K, N = 256, 512, 1024


def _per_step(counts: loops.Counts) -> dict[str, object]:
    syncs = [s for s, _ in counts]
    return {"syncs": syncs, "h2d_after_first": sum(h for _, h in counts[1:])}


def _optimizer_rows(rec: Recorder, steps: int) -> list[dict[str, object]]:
    torch_scaler = lambda: torch.amp.GradScaler("cuda")  # noqa: E731
    rows = []
    for overflow in (False, True):  # finite steps, then inf steps (skipped)
        for fused in (False, True):
            path = f"GradScaler + {'fused' if fused else 'foreach'} AdamW" + (
                ", inf steps" if overflow else ""
            )
            ours = loops.scaler_loop(rec, mixprec.GradScaler("cuda"), fused, True, steps, overflow)
            theirs = loops.scaler_loop(rec, torch_scaler(), fused, True, steps, overflow)
            rows.append({"path": path, "mixprec": _per_step(ours), "torch": _per_step(theirs)})
    bf16_adamw = _per_step(loops.torch_adamw_loop(rec, torch.bfloat16, steps))
    for method in METHODS:  # every compensation method, so a new one gets a row
        for skip in (False, True):
            rows.append(
                {
                    "path": f"CompensatedOptimizer({method}), skip_nonfinite={skip}",
                    "mixprec": _per_step(loops.compensated_loop(rec, method, skip, steps)),
                    "torch": bf16_adamw,
                    "torch_loop": "bf16 AdamW (foreach), no guard",
                }
            )
    rows.append(
        {
            "path": "MixedPrecisionOptimizer, no scaler",
            "mixprec": _per_step(loops.master_loop(rec, None, steps)),
            "torch": _per_step(loops.torch_master_loop(rec, None, steps)),
        }
    )
    rows.append(
        {
            "path": "MixedPrecisionOptimizer, dynamic scaler",
            "mixprec": _per_step(loops.master_loop(rec, "dynamic", steps)),
            "torch": _per_step(loops.torch_master_loop(rec, torch_scaler(), steps)),
        }
    )
    return rows


def _float8_step(layer: Float8Linear, x: torch.Tensor) -> Callable[[], None]:
    """What ``Float8Linear.forward`` + backward run, with the Function called directly."""

    def step() -> None:
        config = layer.config  # the same arguments Float8Linear.forward passes
        fn = LowbitLinearFunction
        args = (x, layer.weight, config.resolved_lowbit_recipe, None, config.gemm_options,
                layer.amax_history, layer.fp8_stats, True)  # fmt: skip
        ctx = Ctx((True, True) + (False,) * (len(args) - 2))
        out = fn.forward(ctx, *args)
        fn.backward(ctx, torch.randn_like(out))

    return step


def _counted(rec: Recorder, steps: int, step: Callable[[], None]) -> dict[str, object]:
    return _per_step(loops._counted(rec, steps, step))


def _layer_rows(rec: Recorder, steps: int) -> list[dict[str, object]]:
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = nn.Parameter(torch.randn(N, K, device="cuda", dtype=torch.bfloat16))

    def bf16_step() -> None:
        xr = x.detach().requires_grad_()
        go = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        torch.nn.functional.linear(xr, w)
        go @ w, go.t() @ xr  # backward's two GEMMs, as autograd would run them

    reference = _counted(rec, steps, bf16_step)
    rows = []
    for name in RECIPE_NAMES:
        for scaling in SCALINGS:
            try:
                config = Float8Config.from_recipe_name(name, scaling=scaling)
            except ValueError:  # e.g. delayed scaling exists only for tensorwise casts
                continue
            model = nn.Sequential(nn.Linear(K, N, bias=False, device="cuda", dtype=torch.bfloat16))
            convert_to_float8_training(model, config=config)
            rows.append(
                {
                    "path": f"float8 {name}, {scaling}",
                    "mixprec": _counted(rec, steps, _float8_step(model[0], x)),
                    "torch": reference,
                    "torch_loop": "bf16 F.linear forward + backward",
                }
            )
    for name, recipe in RECIPES.items():

        def step(recipe=recipe) -> None:
            ctx = Ctx((True, True, False, False))
            out = LowbitLinearFunction.forward(ctx, x, w, recipe, None)
            LowbitLinearFunction.backward(ctx, torch.randn_like(out))

        rows.append(
            {
                "path": f"lowbit {name}",
                "mixprec": _counted(rec, steps, step),
                "torch": reference,
                "torch_loop": "bf16 F.linear forward + backward",
            }
        )
    return rows


def _cell(counts: dict[str, object]) -> str:
    syncs = counts["syncs"]
    per = str(syncs[-1]) if len(set(syncs[1:] or syncs)) == 1 else "/".join(map(str, syncs))
    return per + ("" if counts["h2d_after_first"] == 0 else f" (+{counts['h2d_after_first']} h2d)")


def markdown(rows: list[dict[str, object]]) -> str:
    lines = ["| path | mixprec syncs / step | torch syncs / step |", "|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['path']} | {_cell(r['mixprec'])} | {_cell(r['torch'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--capability", default="9,0", help="compute capability, MAJOR,MINOR (default 9,0)")
    parser.add_argument("--steps", type=int, default=3, help="steps per loop (default 3); the first warms up")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    if torch.version.cuda is None:
        parser.error(f"needs a CUDA build of torch (this is {torch.__version__}): .ci/run's .ci/.venv-cuda")
    cap = tuple(int(v) for v in args.capability.split(","))
    if len(cap) != 2:
        parser.error(f"--capability is MAJOR,MINOR, e.g. 9,0; got {args.capability!r}")
    if args.steps < 2:
        parser.error(f"--steps must be at least 2 (the first step warms up); got {args.steps}")
    with warnings.catch_warnings(), fake_cuda(cap) as rec:
        warnings.simplefilter("ignore")  # the emulation's once-per-process warning
        rows = _optimizer_rows(rec, args.steps) + _layer_rows(rec, args.steps)
    result = {"capability": list(cap), "torch": torch.__version__, "steps": args.steps, "rows": rows}
    print(
        f"host syncs per step on fake CUDA sm{cap[0]}{cap[1]} (torch {torch.__version__}; last step shown "
        "when all but the first agree; '+n h2d': host-to-device copies after the first step)"
    )
    print(markdown(rows))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
