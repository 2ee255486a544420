"""Each low-bit recipe's three GEMMs on the path lowbit_mm takes, against emulated_mm on the same operands.

For every recipe in :data:`mixprec.lowbit.RECIPES` (so a new recipe is covered without editing this file)
and each of its GEMMs (fprop, dgrad, wgrad), the operands are built as the backward pass builds them
(:func:`mixprec.lowbit.gemm.gemm_operands`: layouts, the Hadamard rotation) from a seeded random input
``x`` (M, K), weight (N, K) and output gradient (M, N), quantized once (nearest rounding, padded), then
multiplied twice: by :func:`~mixprec.lowbit.gemm.lowbit_mm` (the tensor-core kernel
:func:`~mixprec.lowbit.gemm.kernel_path` names, or the emulation where there is none) and by
:func:`~mixprec.lowbit.gemm.emulated_mm` (dequantize to float32, ``torch.mm``), both to float32. Reported:
the path taken and why, and the relative error ``max|a - b| / max|b|`` (b: the emulation), which passes at
<= 2**-6. A GEMM with a high-precision operand runs ``torch.mm`` either way and is listed as ``hp``.

On a CPU both sides are the emulation (no scaled-matmul kernels), so every GEMM must agree to rounding:
that checks the plumbing; on a GPU it checks that each kernel reads the scales and layouts as the emulation
means them. Exit code 1 if any GEMM fails. ``--json`` is rewritten after each recipe (``"partial"`` says
how many are in it; None once all are), so a run cut short by a time limit keeps the recipes it checked.

Usage::

    python benchmarks/gemm_numerics.py --device cuda --json numerics.json
    python benchmarks/gemm_numerics.py --device cpu --shape 32,64,48
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from mixprec.lowbit import RECIPES
from mixprec.lowbit.gemm import emulated_mm, gemm_operands, kernel_path, lowbit_mm
from mixprec.lowbit.quantize import quantize
from mixprec.lowbit.recipes import HP, Recipe

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoint import stop_on_sigterm, write_json  # a sibling script, not a package

TOLERANCE = 2**-6
GEMMS = {"fprop": ("fprop_x", "fprop_w"), "dgrad": ("dgrad_go", "dgrad_w"), "wgrad": ("wgrad_go", "wgrad_x")}
DEFAULT_SHAPE = {"cuda": (256, 512, 1024), "cpu": (32, 64, 48)}


def check_gemm(a: torch.Tensor, fmt_a: str, b: torch.Tensor, fmt_b: str) -> dict:
    """``a @ b.T`` on lowbit_mm's path and emulated, from the same quantized operands."""
    if HP in (fmt_a, fmt_b):
        return {"formats": [fmt_a, fmt_b], "path": "hp", "why": "a high-precision operand: torch.mm"}
    qa, qb = quantize(a, fmt_a, pad=True), quantize(b, fmt_b, pad=True)
    kernel, why = kernel_path(qa, qb)
    with warnings.catch_warnings():  # the emulation warning repeats what kernel_path said
        warnings.simplefilter("ignore")
        got = lowbit_mm(qa, qb, torch.float32)
    want = emulated_mm(qa, qb, torch.float32)
    error = ((got - want).abs().max() / want.abs().max()).item()
    return {
        "formats": [fmt_a, fmt_b],
        "path": kernel or "emulated",
        "why": why,
        "rel_error": error,
        "passed": error <= TOLERANCE,  # NaN fails too
    }


def check_recipe(recipe: Recipe, shape: tuple[int, int, int], device: torch.device) -> dict[str, dict]:
    """GEMM name -> :func:`check_gemm` of that GEMM's operands for ``recipe`` at (M, K, N) ``shape``."""
    m, k, n = shape
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(m, k, generator=gen, device=device)
    weight = torch.randn(n, k, generator=gen, device=device) / k**0.5
    grad_out = torch.randn(m, n, generator=gen, device=device) * 1e-3  # gradients run small
    ops = gemm_operands(x, weight, grad_out, recipe)
    return {gemm: check_gemm(*ops[name_a], *ops[name_b]) for gemm, (name_a, name_b) in GEMMS.items()}


def run(
    device: torch.device,
    shape: tuple[int, int, int],
    on_recipe: Callable[[list[dict], int, int], object] | None = None,
) -> list[dict]:
    """One row per (recipe, GEMM); a recipe that raises is one row with its error, and fails.

    ``on_recipe(rows so far, recipes done, recipes planned)`` is called after each recipe."""
    rows = []
    for done, (name, recipe) in enumerate(RECIPES.items(), 1):
        try:
            checked = check_recipe(recipe, shape, device)
        except Exception as exc:  # one broken recipe must not hide the others' results
            rows.append(
                {"recipe": name, "gemm": None, "error": f"{type(exc).__name__}: {exc}", "passed": False}
            )
        else:
            rows += [{"recipe": name, "gemm": gemm, **result} for gemm, result in checked.items()]
        if on_recipe is not None:
            on_recipe(rows, done, len(RECIPES))
    return rows


def _shape(text: str) -> tuple[int, int, int]:
    try:
        m, k, n = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shape takes M,K,N (three integers), got {text!r}") from None
    if min(m, k, n) < 1:
        raise argparse.ArgumentTypeError(f"--shape sizes must be >= 1, got {text!r}")
    return m, k, n


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", type=_shape, help="M,K,N (default 256,512,1024 on cuda, 32,64,48 on cpu)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    shape = args.shape or DEFAULT_SHAPE["cuda" if device.type == "cuda" else "cpu"]
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    meta = {"device": where, "torch": torch.__version__, "cuda": torch.version.cuda, "shape": list(shape)}
    meta["tolerance"] = TOLERANCE

    def save(rows: list[dict], done: int, planned: int) -> None:
        write_json(
            args.json,
            {"meta": meta, "rows": rows},
            None if done == planned else f"running: {done} of {planned} recipes",
        )

    stop_on_sigterm()
    rows = run(device, shape, save)
    print(f"lowbit_mm vs emulated_mm, M,K,N = {shape}, {where}, torch {torch.__version__}; pass: <= 2**-6")
    print(f"{'recipe':18} {'gemm':6} {'path':16} {'rel error':>10}  result")
    for row in rows:
        if "error" in row:
            print(f"{row['recipe']:18} {'-':6} {'-':16} {'-':>10}  FAIL {row['error']}")
        elif row["path"] == "hp":
            print(f"{row['recipe']:18} {row['gemm']:6} {'hp (torch.mm)':16} {'-':>10}  -")
        else:
            verdict = "ok" if row["passed"] else "FAIL"
            print(f"{row['recipe']:18} {row['gemm']:6} {row['path']:16} {row['rel_error']:10.2e}  {verdict}")
    failed = [r for r in rows if r.get("passed") is False]
    if failed:
        print(f"gemm_numerics: {len(failed)} of {len(rows)} rows failed", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
