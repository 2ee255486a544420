"""The three GEMMs of a low-bit linear layer, each operand quantized as its recipe says.

Every GEMM is ``C = A @ B.T`` with both operands quantized along their last (reduction) axis, so one
function serves all three (see :mod:`mixprec.lowbit.recipes` for which tensor is A and B). On a CPU, and
wherever the hardware path is missing, the GEMM is emulated as torchao emulates: dequantize both operands to
float32, ``torch.mm``, cast to the output dtype. On CUDA, fp8 operands with per-tensor or per-row scales go
to ``torch._scaled_mm`` (Hopper and newer); any other case on CUDA is emulated with one warning naming what
is missing (block-scaled MX / NVFP4 GEMMs are not wired to torch's scaled-mm API here).

The random Hadamard transform (NVFP4's wgrad recipe) multiplies each run of 16 rows along M by
``H16 @ diag(signs) / 4``, an orthogonal matrix, on both wgrad operands, so ``(Q go).T (Q x) = go.T x``
exactly before quantization; it spreads an outlier over 16 values. The signs are fixed (drawn once from a
``torch.Generator`` seeded with 0), as Transformer Engine fixes its sign vector.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from mixprec.lowbit.quantize import Quantized, quantize
from mixprec.lowbit.recipes import HP, Recipe

__all__ = ["LowbitLinearFunction", "gemm_operands", "hadamard_16", "lowbit_mm"]

_HADAMARD_SIZE = 16


def hadamard_16(device: torch.device | str = "cpu") -> torch.Tensor:
    """The float32 (16, 16) orthogonal matrix ``H16 @ diag(signs) / 4`` of the random Hadamard transform."""
    h = torch.ones(1, 1)
    while h.shape[0] < _HADAMARD_SIZE:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.randint(0, 2, (_HADAMARD_SIZE,), generator=torch.Generator().manual_seed(0)) * 2 - 1
    return (h * signs.to(h.dtype) / 4.0).to(device)


def _rotate_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` (M, C) with each run of 16 rows multiplied by the Hadamard matrix (M zero-padded to 16)."""
    m = t.shape[0]
    pad = -m % _HADAMARD_SIZE
    t = torch.nn.functional.pad(t.to(torch.float32), (0, 0, 0, pad))
    h = hadamard_16(t.device)
    return torch.einsum("ij,bjc->bic", h, t.reshape(-1, _HADAMARD_SIZE, t.shape[1])).reshape(-1, t.shape[1])


def _fast_path_missing(a: Quantized, b: Quantized) -> str | None:
    """None when ``torch._scaled_mm`` takes this pair on this device, else what is missing."""
    fmts = (a.fmt, b.fmt)
    if any(f.element == "e2m1" or f.scale not in ("fp32", "pow2") for f in fmts):
        return f"a block-scaled {a.fmt.name} x {b.fmt.name} GEMM kernel"
    if any(f.block not in ((-1, -1), (1, -1)) for f in fmts):
        return f"a {a.fmt.name} x {b.fmt.name} GEMM with {a.fmt.block} / {b.fmt.block} blocks"
    if a.fmt.element == b.fmt.element == "e5m2":
        return "an e5m2 x e5m2 GEMM"
    if torch.cuda.get_device_capability(a.data.device) < (8, 9):
        return "fp8 tensor cores (compute capability 8.9 or newer)"
    if any(size % 16 for size in (*a.data.shape, b.data.shape[0])):
        return f"sizes that are multiples of 16 (got {tuple(a.data.shape)} x {tuple(b.data.shape)})"
    return None


def lowbit_mm(a: Quantized, b: Quantized, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b.T`` of two quantized (rows, K) matrices (quantized along K), in ``out_dtype``."""
    if a.data.device.type == "cuda":
        missing = _fast_path_missing(a, b)
        if missing is None:
            scale_b = b.block_descale().reshape(1, -1) if b.fmt.block == (1, -1) else b.block_descale()
            return torch._scaled_mm(
                a.data, b.data.t(), scale_a=a.block_descale(), scale_b=scale_b, out_dtype=out_dtype
            )
        warnings.warn(f"mixprec.lowbit: emulating the GEMM on CUDA, missing {missing}", stacklevel=3)
    return torch.mm(_matrix(a), _matrix(b).t()).to(out_dtype)


def _matrix(q: Quantized) -> torch.Tensor:
    """The (rows, K) matrix ``q`` quantized, dequantized to float32."""
    return q.dequantize(torch.float32).movedim(q.axis, -1).reshape(-1, q.shape[q.axis])


def _gemm(a, a_fmt, b, b_fmt, out_dtype, sr_a=False, generator=None) -> torch.Tensor:
    """``a @ b.T`` for (rows, K) matrices, each operand quantized along K unless its format is hp."""
    if a_fmt == HP and b_fmt == HP:
        return torch.mm(a, b.t()).to(out_dtype)
    qa = quantize(a, a_fmt, stochastic=sr_a, generator=generator, pad=True) if a_fmt != HP else None
    qb = quantize(b, b_fmt, pad=True) if b_fmt != HP else None
    if qa is not None and qb is not None:
        return lowbit_mm(qa, qb, out_dtype)
    a32 = _matrix(qa) if qa is not None else a.to(torch.float32)
    b32 = _matrix(qb) if qb is not None else b.to(torch.float32)
    return torch.mm(a32, b32.t()).to(out_dtype)


def gemm_operands(
    x2: torch.Tensor, weight: torch.Tensor, grad_out: torch.Tensor, recipe: Recipe
) -> dict[str, tuple[torch.Tensor, str]]:
    """Operand name -> ``(matrix, format name)``, each (rows, K) matrix quantized along K by its GEMM.

    ``x2`` (M, K) is the flattened input, ``weight`` (N, K), ``grad_out`` (M, N); the wgrad operands are
    Hadamard-rotated along M when the recipe says so. The layouts the backward pass uses, for diagnostics.
    """
    go_w, x_w = (_rotate_rows(grad_out), _rotate_rows(x2)) if recipe.rht else (grad_out, x2)
    return {
        "fprop_x": (x2, recipe.fprop_x),
        "fprop_w": (weight, recipe.fprop_w),
        "dgrad_go": (grad_out, recipe.dgrad_go),
        "dgrad_w": (weight.t(), recipe.dgrad_w),
        "wgrad_go": (go_w.t(), recipe.wgrad_go),
        "wgrad_x": (x_w.t(), recipe.wgrad_x),
    }


class LowbitLinearFunction(torch.autograd.Function):
    """``x @ weight.T`` with the three GEMMs quantized by ``recipe``; bias is added by the caller.

    ``x`` (..., K) and ``weight`` (N, K) are saved in their own precision, and each backward GEMM quantizes
    them along its own reduction axis (a rowwise or block format needs a different quantization per GEMM).
    Autocast is off inside; the output has ``x``'s dtype, the gradients ``x``'s and ``weight``'s.
    ``generator`` feeds stochastic rounding (None: torch's global generator).
    """

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, recipe: Recipe, generator: torch.Generator | None
    ) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            x2 = x.reshape(-1, x.shape[-1])
            w = weight.to(x.dtype)
            out = _gemm(x2, recipe.fprop_x, w, recipe.fprop_w, x.dtype)
        ctx.save_for_backward(x2, w)
        ctx.recipe, ctx.generator = recipe, generator
        ctx.x_shape, ctx.w_dtype = x.shape, weight.dtype
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x2, w = ctx.saved_tensors
        recipe, gen = ctx.recipe, ctx.generator
        grad_x = grad_w = None
        with torch.autocast(grad_out.device.type, enabled=False):
            go = grad_out.reshape(-1, grad_out.shape[-1]).to(x2.dtype)
            if ctx.needs_input_grad[0]:
                grad_x = _gemm(go, recipe.dgrad_go, w.t(), recipe.dgrad_w, x2.dtype, recipe.sr, gen)
                grad_x = grad_x.reshape(ctx.x_shape)
            if ctx.needs_input_grad[1]:
                ops = gemm_operands(x2, w, go, recipe)
                (go_w, go_fmt), (x_w, x_fmt) = ops["wgrad_go"], ops["wgrad_x"]
                grad_w = _gemm(go_w, go_fmt, x_w, x_fmt, x2.dtype, recipe.sr, gen).to(ctx.w_dtype)
        return grad_x, grad_w, None, None
