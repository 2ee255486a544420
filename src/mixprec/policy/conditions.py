"""Argument-dependent op rules: the executable form of ``ops.CONDITIONAL``.

``torch.autocast`` works on ATen ops, so a Python-level function whose decomposition reaches a listed
op only for some arguments (``torch.einsum`` runs ``bmm`` only for contracting equations, ``F.pad``
runs ``reflection_pad2d`` only in reflect mode) changes dtype only for those arguments. The engine
sees the Python-level call, so each such function gets a predicate here: ``(args, kwargs) -> category``
or None for "leave it alone". The prose in ``ops.CONDITIONAL`` documents the same rules.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mixprec.policy.ops import FP32, LOWER

__all__ = ["CONDITIONS", "LOWER_RESULT", "Condition"]

#: Run the op as given (its low-precision kernels may not exist) and cast its result to the compute
#: dtype: what torch's decomposition produces when only the op's last step is a listed one.
LOWER_RESULT = "lower_result"

Condition = Callable[[tuple, dict], "str | None"]


def _arg(args: tuple, kwargs: dict, index: int, name: str, default: Any = None) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else default


def _einsum(args: tuple, kwargs: dict) -> str | None:
    equation = _arg(args, kwargs, 0, "equation")
    if not isinstance(equation, str):
        return None  # the sublist form has no autocast kernel
    lhs, _, rhs = equation.replace(" ", "").partition("->")
    operands = [set(term.replace("...", "")) for term in lhs.split(",")]
    letters = [c for term in operands for c in term]
    output = (
        set(rhs.replace("...", "")) if "->" in equation else {c for c in letters if letters.count(c) == 1}
    )
    for letter in set(letters) - output:
        if sum(letter in term for term in operands) >= 2:
            return LOWER  # a contraction between two operands: torch runs bmm
    return None


def _inner(args: tuple, kwargs: dict) -> str | None:
    a, b = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "other")
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() == 1 and b.dim() == 1:
        return None  # dot, unlisted on CPU
    return LOWER


def _chain_matmul(args: tuple, kwargs: dict) -> str | None:
    matrices = args[0] if len(args) == 1 and isinstance(args[0], (list, tuple)) else args
    return LOWER if len(matrices) >= 2 else None


def _matrix_power(args: tuple, kwargs: dict) -> str | None:
    n = _arg(args, kwargs, 1, "n")
    if not isinstance(n, int):
        return None
    if abs(n) >= 2:
        return LOWER
    return FP32 if n == -1 else None  # -1 is inverse, on the fp32 list


def _pad(args: tuple, kwargs: dict) -> str | None:
    mode = _arg(args, kwargs, 2, "mode", "constant")
    pad = _arg(args, kwargs, 1, "pad", ())
    if mode == "replicate":
        return FP32
    if mode == "reflect" and len(pad) in (2, 4):
        return FP32  # reflection_pad1d/2d are listed; reflection_pad3d is not
    return None


def _local_response_norm(args: tuple, kwargs: dict) -> str | None:
    x = _arg(args, kwargs, 0, "input")
    return FP32 if isinstance(x, torch.Tensor) and x.dim() >= 4 else None


def _max_pool3d(args: tuple, kwargs: dict) -> str | None:
    return None if _arg(args, kwargs, 6, "return_indices", False) else FP32


def _interpolate(args: tuple, kwargs: dict) -> str | None:
    return None if _arg(args, kwargs, 3, "mode", "nearest") == "area" else FP32


def _always_lower(args: tuple, kwargs: dict) -> str | None:
    return LOWER


def _convolution(args: tuple, kwargs: dict) -> str | None:
    return LOWER if len(args) + len(kwargs) == 12 else None  # only the deprecated 12-argument overload


def _pinv(args: tuple, kwargs: dict) -> str | None:
    return LOWER_RESULT  # svd in fp32 (no low-precision kernel), then the listed matmul


CONDITIONS: dict[str, dict[str, Condition]] = {
    "cpu": {
        "einsum": _einsum,
        "inner": _inner,
        "chain_matmul": _chain_matmul,
        "matrix_power": _matrix_power,
        "linalg_matrix_power": _matrix_power,
        "pad": _pad,
        "local_response_norm": _local_response_norm,
        "max_pool3d": _max_pool3d,
        "lstm": _always_lower,
        "_convolution": _convolution,
        "linalg_pinv": _pinv,
    },
    "cuda": {
        "interpolate": _interpolate,
        "upsample": _interpolate,
        "lstm": _always_lower,
        "gru": _always_lower,
        "rnn_tanh": _always_lower,
        "rnn_relu": _always_lower,
    },
}
