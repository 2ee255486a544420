"""The scaled fp8 matmul and the autograd function of an fp8 linear layer.

Shapes: the input ``x`` is (..., K), the weight (N, K), the output (..., N). Three matmuls, each of an
e4m3 or e5m2 operand pair (as in torchao and Transformer Engine)::

    forward      out     = x_e4m3   @ w_e4m3.T        (M, K) x (K, N)
    backward     grad_x  = go_e5m2  @ w_e4m3          (M, N) x (N, K)
                 grad_w  = go_e5m2.T @ x_e4m3         (N, M) x (M, K)

The function computes in its own dtypes with autocast disabled inside, so neither ``torch.autocast``
nor ``mixprec.autocast`` re-casts the fp8 matmul; the output has the input's dtype (the autocast dtype
when :class:`~mixprec.float8.Float8Linear` runs in an autocast region).
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec import formats
from mixprec.float8.config import Float8Config
from mixprec.float8.fsdp import Float8AllGatherWeight, Float8GatheredWeight
from mixprec.float8.scaling import amax_of, amax_to_scale, delayed_scale, push_amax, to_float8

__all__ = ["scaled_mm"]

E4M3 = formats.FP8_E4M3FN
E5M2 = formats.FP8_E5M2
# Output dtypes torch._scaled_mm writes; any other (float64) goes through the emulation.
_SCALED_MM_OUT = (torch.float32, torch.bfloat16, torch.float16)
_E5M2_DTYPES = (torch.float8_e5m2, torch.float8_e5m2fnuz)
_FNUZ = (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
# Rows of a Float8Linear's amax buffers.
INPUT, WEIGHT, GRAD_OUTPUT = 0, 1, 2


def scaled_mm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    *,
    emulate: bool = False,
    use_fast_accum: bool = False,
    pad_inner_dim: bool = False,
) -> torch.Tensor:
    """``(a / a_scale) @ (b / b_scale)`` in ``out_dtype`` for fp8 ``a`` (M, K) and ``b`` (K, N).

    Uses ``torch._scaled_mm`` (which takes the inverse scales, the dequantisation factors) unless
    ``emulate`` or the shapes are ones it rejects; the emulation is torchao's: a float32 ``torch.mm`` of
    the dequantized operands, cast to ``out_dtype``. ``use_fast_accum`` is passed to ``torch._scaled_mm``
    (the emulation ignores it); ``pad_inner_dim`` zero-pads K to a multiple of 16 first (torchao's
    ``pad_inner_dim``: zeros add nothing to the products).
    """
    if pad_inner_dim and a.shape[1] % 16:
        pad = -a.shape[1] % 16
        a = torch.nn.functional.pad(a, (0, pad))
        b = torch.nn.functional.pad(b, (0, 0, 0, pad))
    if not emulate and out_dtype in _SCALED_MM_OUT and _scaled_mm_accepts(a, b):
        return torch._scaled_mm(
            a.contiguous(),
            b.t().contiguous().t(),  # column-major, as cuBLASLt wants it
            scale_a=a_scale.reciprocal(),
            scale_b=b_scale.reciprocal(),
            out_dtype=out_dtype,
            use_fast_accum=use_fast_accum,
        )
    return torch.mm(a.to(torch.float32) / a_scale, b.to(torch.float32) / b_scale).to(out_dtype)


def _scaled_mm_accepts(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``torch._scaled_mm`` takes fp8 ``a`` (M, K) @ ``b`` (K, N) on their device: any pair on a
    CPU but the fnuz dtypes; on CUDA K and N multiples of 16 (torch checks those, any M is taken), not
    e5m2 x e5m2, and the fnuz dtypes (AMD MI300's) only in a ROCm build (``torch.version.hip``), where the
    "cuda" device is an AMD GPU."""
    if not hasattr(torch, "_scaled_mm"):
        return False
    if a.numel() == 0 or b.numel() == 0:
        return False
    fnuz = a.dtype in _FNUZ or b.dtype in _FNUZ
    if a.device.type == "cpu":
        # oneDNN's CPU kernel refuses fnuz on some CPUs ("itensor_view_from_dense expects ... fp8") and takes
        # it on others, so fnuz is emulated on every CPU, one result everywhere
        return not fnuz
    if a.device.type != "cuda" or (a.dtype in _E5M2_DTYPES and b.dtype in _E5M2_DTYPES):
        return False
    if fnuz and torch.version.hip is None:
        return False
    return a.shape[1] % 16 == 0 and b.shape[1] % 16 == 0


def _gemm_kwargs(config: Float8Config, gemm: int) -> dict[str, bool]:
    """:func:`scaled_mm`'s settings for GEMM ``gemm`` (0 output, 1 grad_input, 2 grad_weight)."""
    mm = config.linear_mm_config[gemm]
    return {"emulate": mm.emulate, "use_fast_accum": mm.use_fast_accum, "pad_inner_dim": mm.pad_inner_dim}


def _scale_for(
    row: int,
    x: torch.Tensor,
    fmt: formats.Format,
    config: Float8Config,
    history: torch.Tensor | None,
    stats: torch.Tensor,
    update: bool,
) -> torch.Tensor:
    """The scale of ``x`` for buffer row ``row``; records amax and scale in ``stats``, pushes the history."""
    amax = amax_of(x)
    if history is None:
        scale = amax_to_scale(amax, fmt, config.margin)
    else:
        scale = delayed_scale(history[row], amax, fmt, config.margin, config.amax_compute_algo)
        if update and x.numel():  # an empty tensor says nothing about the next step's range
            push_amax(history[row], amax)
    if config.round_scales_to_power_of_2:  # torchao's flag: down to a power of two (nan stays nan)
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    stats[0, row] = amax
    stats[1, row] = scale
    return scale


def _weight_to_float8(
    weight: torch.Tensor,
    config: Float8Config,
    history: torch.Tensor | None,
    stats: torch.Tensor,
    update: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight's e4m3 cast and its scale; under FSDP2's fp8 all-gather, the cast that was gathered."""
    if isinstance(weight, Float8GatheredWeight):
        stats[0, WEIGHT], stats[1, WEIGHT] = weight._amax, weight._scale
        return weight._data, weight._scale
    if isinstance(weight, Float8AllGatherWeight):  # not sharded (yet): cast the wrapped weight here
        weight = weight._tensor
    w_scale = _scale_for(WEIGHT, weight, E4M3, config, history, stats, update)
    return to_float8(weight, w_scale, E4M3), w_scale


class Float8LinearFunction(torch.autograd.Function):
    """``x @ weight.T`` with all three matmuls in fp8 (see the module doc); bias is added by the caller.

    ``history`` is the float32[3, L] amax history (rows: input, weight, grad_output) or None for
    dynamic scaling; ``stats`` a float32[2, 3] buffer that receives the last amax (row 0) and scale
    (row 1) of each role. Both are updated in place; ``update`` False reads the history without pushing.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        history: torch.Tensor | None,
        stats: torch.Tensor,
        config: Float8Config,
        update: bool,
    ) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            x2 = x.reshape(-1, x.shape[-1])
            x_scale = _scale_for(INPUT, x2, E4M3, config, history, stats, update)
            w8, w_scale = _weight_to_float8(weight, config, history, stats, update)
            x8 = to_float8(x2, x_scale, E4M3)
            out = scaled_mm(x8, x_scale, w8.t(), w_scale, x.dtype, **_gemm_kwargs(config, 0))
        ctx.save_for_backward(x8, x_scale, w8, w_scale)
        ctx.history, ctx.stats, ctx.config, ctx.update = history, stats, config, update
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x8, x_scale, w8, w_scale = ctx.saved_tensors
        config = ctx.config
        grad_x = grad_w = None
        with torch.autocast(grad_out.device.type, enabled=False):
            go2 = grad_out.reshape(-1, grad_out.shape[-1])
            go_scale = _scale_for(GRAD_OUTPUT, go2, E5M2, config, ctx.history, ctx.stats, ctx.update)
            go8 = to_float8(go2, go_scale, E5M2)
            if ctx.needs_input_grad[0]:
                grad_x = scaled_mm(go8, go_scale, w8, w_scale, grad_out.dtype, **_gemm_kwargs(config, 1))
                grad_x = grad_x.reshape(ctx.x_shape).to(ctx.x_dtype)
            if ctx.needs_input_grad[1]:
                grad_w = scaled_mm(go8.t(), go_scale, x8, x_scale, grad_out.dtype, **_gemm_kwargs(config, 2))
                grad_w = grad_w.to(ctx.w_dtype)
        return grad_x, grad_w, None, None, None, None
