"""Which torch scaled-matmul kernel each lowbit recipe's three GEMMs take, per CUDA compute capability.

A Markdown table, recipe x capability -> the path of fprop / dgrad / wgrad for an ``nn.Linear(K, N)`` on an
``(M, K)`` input: the kernel's name (``"name x3"`` when all three GEMMs agree), ``mm`` for a GEMM with a
high-precision operand (plain ``torch.mm``), ``emulated (why)`` when no GEMM has a kernel. Computed, not
measured: :func:`mixprec.lowbit.gemm.gemm_kernel_paths` with the capability given, on ``device="meta"``
tensors (the operands' padded shapes, nothing computed), i.e. :func:`mixprec.lowbit.kernels.select_kernel`'s
decision. Pure CPU; no GPU needed.

Usage::

    python benchmarks/kernel_table.py
    python benchmarks/kernel_table.py --shape 256,512,1024 --json kernel_table.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys

import torch

from mixprec.lowbit import HP, OPERANDS, RECIPES, Recipe
from mixprec.lowbit.gemm import gemm_kernel_paths

CAPABILITIES: tuple[tuple[int, int], ...] = ((8, 9), (9, 0), (10, 0), (12, 0))
GEMMS = ("fprop", "dgrad", "wgrad")


def _shape(text: str) -> tuple[int, int, int]:
    parts = text.split(",")
    if len(parts) != 3 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"--shape must be M,K,N of three positive ints, got {text!r}")
    m, k, n = (int(p) for p in parts)
    return m, k, n


def paths(
    shape: tuple[int, int, int], capabilities: tuple[tuple[int, int], ...] = CAPABILITIES
) -> dict[str, dict[str, dict[str, tuple[str | None, str]]]]:
    """recipe -> ``"smXY"`` -> GEMM -> ``(kernel name or None, why)``, as ``gemm_kernel_paths`` says."""
    m, k, n = shape
    x2 = torch.empty(m, k, device="meta")
    weight = torch.empty(n, k, device="meta")
    grad_out = torch.empty(m, n, device="meta")
    return {
        name: {
            f"sm{cap[0]}{cap[1]}": gemm_kernel_paths(x2, weight, grad_out, recipe, capability=cap)
            for cap in capabilities
        }
        for name, recipe in RECIPES.items()
    }


def _why(reason: str) -> str:
    """The reason without the formats and the device (the table's row and column name them)."""
    return re.sub(r", this device is sm\d+$", "", re.sub(r"^\S+ x \S+: ", "", reason))


def names(recipe: Recipe, gemm_paths: dict[str, tuple[str | None, str]]) -> list[str]:
    """Per GEMM: the kernel's name, ``"mm"`` (a high-precision operand: plain torch.mm) or ``"emulated"``."""
    out = []
    for i, gemm in enumerate(GEMMS):
        hp = HP in (recipe.operand(OPERANDS[2 * i]), recipe.operand(OPERANDS[2 * i + 1]))
        out.append(gemm_paths[gemm][0] or ("mm" if hp else "emulated"))
    return out


def cell(recipe: Recipe, gemm_paths: dict[str, tuple[str | None, str]]) -> str:
    """One table cell: ``"name x3"``, ``"emulated (why)"`` when no GEMM has a kernel, else ``a / b / c``."""
    per_gemm = names(recipe, gemm_paths)
    if all(n in ("emulated", "mm") for n in per_gemm) and "emulated" in per_gemm:
        whys = dict.fromkeys(
            _why(gemm_paths[g][1]) for g, n in zip(GEMMS, per_gemm, strict=True) if n == "emulated"
        )
        return f"emulated ({'; '.join(whys)})"
    if len(set(per_gemm)) == 1:
        return f"{per_gemm[0]} x3"
    return " / ".join(per_gemm)


def markdown(table: dict[str, dict[str, dict[str, tuple[str | None, str]]]], shape) -> str:
    caps = list(next(iter(table.values())))
    lines = [
        f"GEMM paths (fprop / dgrad / wgrad) at M,K,N = {','.join(map(str, shape))}",
        "",
        "| recipe | " + " | ".join(caps) + " |",
        "|---|" + "---|" * len(caps),
    ]
    for name, per_cap in table.items():
        lines.append(f"| {name} | " + " | ".join(cell(RECIPES[name], per_cap[c]) for c in caps) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=_shape, default=(256, 512, 1024), help="M,K,N (default 256,512,1024)")
    parser.add_argument("--json", default=None, help="write the table and every GEMM's reason here")
    args = parser.parse_args(argv)
    table = paths(args.shape)
    print(markdown(table, args.shape))
    result = {
        "shape": {"M": args.shape[0], "K": args.shape[1], "N": args.shape[2]},
        "torch": torch.__version__,
        "paths": {
            r: {c: {g: {"kernel": p[0], "why": p[1]} for g, p in gp.items()} for c, gp in per.items()}
            for r, per in table.items()
        },
        "cells": {r: {c: cell(RECIPES[r], gp) for c, gp in per.items()} for r, per in table.items()},
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
