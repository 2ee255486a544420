"""Fused fp8 quantization on CUDA: amax, scale, cast and the transposed copy in Triton kernels.

The pure-torch :func:`mixprec.lowbit.quantize` runs one kernel per step (abs, amax, the scale, multiply,
clamp, cast) and, for the backward's operand quantized along the other axis, all of them again on a
transposed copy. Here the formats below take two launches (tensorwise and rowwise: an amax reduction,
then one pass that scales, clamps, casts and writes the transposed copy) or one (1x128 and 128x128
blocks, whose amaxes are local to a 128x128 tile: Transformer Engine's "cast-transpose"):

======================  =========================  ==============================================
format (block)          the copy along K           the transposed copy (``x.T`` along M)
======================  =========================  ==============================================
tensorwise (-1, -1)     one scale                  the same scale
rowwise (1, -1)         a scale per row            a scale per column of ``x``
1x128 (1, 128)          a scale per 1x128 block    a scale per 128x1 block of ``x``
128x128 (128, 128)      a scale per 128x128 tile   the same scales, transposed
======================  =========================  ==============================================

for e4m3 (``float8_e4m3fn``) and e5m2 elements with fp32 or pow2 scales, nearest-even rounding, no
per-tensor amax given. The results are bit for bit :func:`~mixprec.lowbit.quantize`'s (the same
scale, the same fp8 bits; a nan propagates, its payload aside): the amax is an integer max of the
magnitude bits (exact in any order; a nan's bits are above inf's), the scale is divided in float64
and rounded once to float32 as :func:`mixprec.lowbit.scaling.fp32_scale` does, and pow2's
``exp2(floor(log2 s))`` uses libdevice's ``log2f``, the CUDA math library function torch's CUDA
``log2`` calls.

:func:`mixprec.lowbit.quantize` dispatches to :func:`quantize` (the module's), the per-tensor layers
(:mod:`mixprec.lowbit.gemm`, :mod:`mixprec.lowbit.history`) to :func:`dynamic_cast` (dynamic scaling:
the scale computed and recorded in the cast kernel), :func:`delayed_cast` (delayed scaling: the scale,
the records and the history push in one small program), :func:`tensor_amax` and :func:`scaled_cast`
(what neither takes: a dynamic margin, a history in another dtype), when :func:`fused_eligible` says
so: a plain CUDA tensor in
eager mode (under ``torch.compile`` inductor fuses the pure-torch quantizers itself; a FakeTensor or
another tensor subclass has no storage to launch on), Triton importable, a supported format, and the
environment variable ``MIXPREC_FUSED_QUANTIZE`` not set to ``0`` (the switch that forces the pure-torch
path, read at each call). This module imports Triton only when a kernel is first launched, so mixprec
imports without it.

One kernel here is not a quantizer: :func:`post_scale_`, the epilogue of a rowwise fp8 GEMM run as
torchao runs it without fast accumulation (``float8_ops.addmm_float8_unwrapped``: the tensorwise kernel
with unit scales, then ``out *= scale_a * scale_b`` on its bf16 output). It gives torch's bits in one
pass over the output, without the (M, N) float32 outer product torch's expression allocates, behind the
same gate (:func:`post_scale_eligible`).

Under Triton's CPU interpreter (``TRITON_INTERPRET=1`` set before the first launch) the kernels run on
CPU tensors, which is how the tests check them; the interpreter's float32-to-fp8 conversion is wrong
where rounding carries into the next binade, so ``cast=False`` (tests) stores the scaled, clamped
float32 values instead of the fp8 ones; its float32-to-bfloat16 conversion truncates, so the interpreted
post-scale rounds on the bits (see :func:`post_scale_`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, NamedTuple

import torch

from mixprec._triton import device_of, interpreting, kernels, triton_available
from mixprec.lowbit.formats import LowbitFormat, get_format
from mixprec.lowbit.quantized import Quantized

__all__ = [
    "ENV_SWITCH",
    "PerTensorCast",
    "delayed_cast",
    "dynamic_cast",
    "format_supported",
    "fused_eligible",
    "post_scale_",
    "post_scale_eligible",
    "quantize",
    "scaled_cast",
    "tensor_amax",
    "triton_available",
]

#: The environment variable that forces the pure-torch quantizers when set to ``0``.
ENV_SWITCH = "MIXPREC_FUSED_QUANTIZE"
_ELEMENTS = ("e4m3", "e5m2")
_SCALES = ("fp32", "pow2")
_BLOCKS = ((-1, -1), (1, -1), (1, 128), (128, 128))
_TILE = 128  # the side of a cast tile; a 1x128 / 128x128 block format's block side
_EPS = 1e-12  # scaling.EPS, the smallest amax a scale is computed from
_GROWTH = 2.0**8  # history.AMAX_GROWTH_LIMIT (history dispatches here, so it is not imported)
#: Per kernel, whether it computes scales with one float32 division (same bits as float64; see
#: ``_triton_kernels``' doc): where that holds fewer registers for sm_90 (docs/measured-figures.md).
F32_DIV = {"cast": True, "block": True}


def format_supported(fmt: LowbitFormat | str) -> bool:
    """Whether ``fmt`` has a fused kernel (see the module doc's table)."""
    fmt = get_format(fmt)
    return fmt.element in _ELEMENTS and fmt.scale in _SCALES and fmt.block in _BLOCKS and not fmt.two_level


def fused_eligible(x: torch.Tensor, fmt: LowbitFormat | str) -> bool:
    """Whether quantizing ``x`` to ``fmt`` takes the fused kernels: a non-empty plain CUDA tensor or
    Parameter (no other subclass, not fake) of one or two dims (or a CPU one under
    ``TRITON_INTERPRET=1``), in eager mode, Triton importable, ``fmt`` supported and
    ``MIXPREC_FUSED_QUANTIZE`` not ``0``. Stochastic rounding and a given per-tensor amax are the
    caller's to exclude."""
    return 0 < x.dim() <= 2 and format_supported(fmt) and _launchable(x)


def _launchable(x: torch.Tensor) -> bool:
    """The gate every kernel here shares: a non-empty plain CUDA tensor or Parameter (a CPU one under the
    interpreter), eager mode, Triton importable, ``MIXPREC_FUSED_QUANTIZE`` not ``0``."""
    return (
        type(x) in (torch.Tensor, torch.nn.Parameter)
        and (x.device.type == "cuda" or (x.device.type == "cpu" and interpreting()))
        and x.numel() > 0
        and os.environ.get(ENV_SWITCH, "1") != "0"
        and not torch.compiler.is_compiling()
        and triton_available()
    )


def quantize(
    x: torch.Tensor, fmt: LowbitFormat | str, *, transpose: bool = False, cast: bool = True
) -> tuple[Quantized, Quantized | None]:
    """``x`` (M, K) quantized along K, and with ``transpose`` ``x.T`` (K, M) quantized along M.

    Equal, bit for bit, to ``mixprec.lowbit.quantize(x, fmt, pad=True)`` and
    ``mixprec.lowbit.quantize(x.t(), fmt, pad=True)`` (see the module doc); ``x`` may be any strided
    2-D view (a transposed one is read in place, not copied). ``cast=False`` stores the scaled,
    clamped float32 values in place of fp8 (the tests' view of everything before the cast).

    Args:
        x: a float32, bfloat16 or float16 tensor of 1 or 2 dims (1 dim: one row) on a CUDA device, or on
            the CPU under Triton's interpreter.
        fmt: a format :func:`format_supported` accepts.

    Returns:
        ``(q, q_t)``: two :class:`~mixprec.lowbit.Quantized` (``q_t`` None without ``transpose``).

    Raises:
        ValueError: for an unsupported format or a tensor that is not 1-D or 2-D floating.
    """
    fmt = get_format(fmt)
    if not format_supported(fmt):
        raise ValueError(f"no fused kernel for {fmt.name}; fused: fp8 e4m3/e5m2, fp32/pow2 scales, {_BLOCKS}")
    if not x.is_floating_point() or not 0 < x.dim() <= 2:
        raise ValueError(f"x must be a floating 1-D or 2-D tensor, got {x.dtype} of shape {tuple(x.shape)}")
    with device_of(x):
        return _quantize(x, fmt, transpose, cast)


def _quantize(
    x: torch.Tensor, fmt: LowbitFormat, transpose: bool, cast: bool
) -> tuple[Quantized, Quantized | None]:
    x2 = x.reshape(1, -1) if x.dim() == 1 else x
    m, k = x2.shape
    rows = fmt.block[0]
    kern = _kernels(interpreting())
    elem_max, pow2 = float(fmt.elem.max), fmt.scale == "pow2"
    out_dtype = fmt.elem.dtype if cast else torch.float32
    f8 = kern.DTYPES[fmt.element]
    dev = x2.device
    if fmt.block in ((-1, -1), (1, -1)):
        rowwise = fmt.block == (1, -1)
        n_row = m if rowwise else 1
        row_amax = torch.zeros(n_row, dtype=torch.int32, device=dev)
        col_amax = torch.zeros(k if rowwise and transpose else 1, dtype=torch.int32, device=dev)
        bm, bk = 64, 64
        grid = (triton_cdiv(m, bm), triton_cdiv(k, bk))
        kern.amax[grid](
            x2, m, k, x2.stride(0), x2.stride(1), row_amax, col_amax,
            BM=bm, BK=bk, ROWWISE=rowwise, COLS=rowwise and transpose,
        )  # fmt: skip
        data = torch.empty(m, k, dtype=out_dtype, device=dev)
        data_t = torch.empty(k, m, dtype=out_dtype, device=dev) if transpose else data
        scale = torch.empty(n_row, 1, dtype=torch.float32, device=dev)
        scale_t = torch.empty(k if rowwise else 1, 1, dtype=torch.float32, device=dev) if transpose else scale
        kern.cast[grid](
            x2, m, k, x2.stride(0), x2.stride(1), row_amax, col_amax, row_amax,
            data, data_t, scale, scale_t, scale, scale, scale,
            BM=bm, BK=bk, MODE=2 if rowwise else 0, TRANSPOSE=transpose, ELEM_MAX=elem_max, POW2=pow2,
            CAST=cast, F8=f8, PRECISE=not interpreting(), F32_DIV=F32_DIV["cast"], STATS=False,
            DESCALE=False,
        )  # fmt: skip
    else:
        two_d = rows == _TILE
        mp, kp = m + -m % _TILE, k + -k % _TILE
        out_rows, out_t_rows = (mp, kp) if two_d else (m, k)
        bm = _TILE if (two_d or transpose) else 32
        grid = (triton_cdiv(mp if bm == _TILE else m, bm), kp // _TILE)
        data = torch.empty(out_rows, kp, dtype=out_dtype, device=dev)
        data_t = torch.empty(out_t_rows, mp, dtype=out_dtype, device=dev) if transpose else data
        scale = torch.empty(out_rows // rows, kp // _TILE, dtype=torch.float32, device=dev)
        scale_t = (
            torch.empty(out_t_rows // rows, mp // _TILE, dtype=torch.float32, device=dev)
            if transpose
            else scale
        )
        kern.block[grid](
            x2, m, k, x2.stride(0), x2.stride(1), data, data_t, scale, scale_t,
            out_rows, out_t_rows, kp, mp,
            BM=bm, BK=_TILE, TWO_D=two_d, TRANSPOSE=transpose, ELEM_MAX=elem_max, POW2=pow2,
            CAST=cast, F8=f8, PRECISE=not interpreting(), F32_DIV=F32_DIV["block"],
            num_warps=8 if bm == _TILE else 4,
        )  # fmt: skip
    q = Quantized(data, scale, None, fmt, x.shape, x.dtype, x.dim() - 1)
    if not transpose:
        return q, None
    q_t = Quantized(data_t, scale_t, None, fmt, torch.Size((k, m)), x.dtype, 1)
    return q, q_t


def scaled_cast(
    x: torch.Tensor,
    scale: torch.Tensor,
    fmt: LowbitFormat | str,
    *,
    transpose: bool = False,
    cast: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``saturate(x * scale)`` in ``fmt``'s fp8 dtype with a given float32 one-element ``scale``, bit for
    bit :func:`mixprec.lowbit.history.to_float8`, in one pass; with ``transpose`` also ``x.T``'s, contiguous.

    ``x``: a 2-D floating tensor (any strides) on a CUDA device (a CPU one under the interpreter).
    Returns ``(data (M, K), data_t (K, M) or None)``; ``cast=False``: float32 values before the cast.

    Raises:
        ValueError: for an unsupported format or a tensor that is not 2-D.
    """
    fmt = get_format(fmt)
    if not format_supported(fmt) or x.dim() != 2:
        raise ValueError(
            f"scaled_cast takes a 2-D tensor and a fused format, got {tuple(x.shape)}, {fmt.name}"
        )
    with device_of(x):
        return _scaled_cast(x, scale, fmt, transpose, cast)


def _scaled_cast(x, scale, fmt, transpose, cast) -> tuple[torch.Tensor, torch.Tensor | None]:
    m, k = x.shape
    kern = _kernels(interpreting())
    out_dtype = fmt.elem.dtype if cast else torch.float32
    data = torch.empty(m, k, dtype=out_dtype, device=x.device)
    data_t = torch.empty(k, m, dtype=out_dtype, device=x.device) if transpose else data
    scale32 = scale.reshape(1).to(torch.float32)
    unused = torch.empty(1, dtype=torch.int32, device=x.device)
    bm, bk = 64, 64
    kern.cast[(triton_cdiv(m, bm), triton_cdiv(k, bk))](
        x, m, k, x.stride(0), x.stride(1), unused, unused, scale32, data, data_t, scale32, scale32,
        scale32, scale32, scale32,
        BM=bm, BK=bk, MODE=1, TRANSPOSE=transpose, ELEM_MAX=float(fmt.elem.max), POW2=False,
        CAST=cast, F8=kern.DTYPES[fmt.element], PRECISE=not interpreting(), F32_DIV=F32_DIV["cast"],
        STATS=False, DESCALE=False,
    )  # fmt: skip
    return data, (data_t if transpose else None)


class PerTensorCast(NamedTuple):
    """A per-tensor cast of :func:`dynamic_cast` / :func:`delayed_cast`.

    Attributes:
        data: (M, K) fp8 (float32 values before the cast with ``cast=False``).
        data_t: the (K, M) transposed copy, contiguous, or None without ``transpose``.
        scale: the float32 0-dim multiplier (``x ~ data / scale``).
        descale: ``scale``'s float32 reciprocal, as torch's CUDA ``reciprocal`` rounds it (what the fp8
            GEMMs take).
        amax: ``max|x|``, float32 0-dim.
    """

    data: torch.Tensor
    data_t: torch.Tensor | None
    scale: torch.Tensor
    descale: torch.Tensor
    amax: torch.Tensor


def dynamic_cast(
    x: torch.Tensor,
    fmt: LowbitFormat | str,
    *,
    transpose: bool = False,
    cast: bool = True,
    amax_out: torch.Tensor | None = None,
    scale_out: torch.Tensor | None = None,
) -> PerTensorCast:
    """Dynamic tensorwise scaling in two kernels: ``max|x|``, then the scale, the cast and the transposed
    copy in one pass, bit for bit :class:`mixprec.lowbit.history.TensorScaling` (``delayed=False``,
    ``margin=0``) followed by :func:`mixprec.lowbit.history.to_float8`.

    Three launches per operand (the amax accumulator's zero-fill, the amax, the cast): the cast kernel
    computes the scale from the amax and its reciprocal (the GEMMs' descale) and, given ``amax_out`` /
    ``scale_out``, stores amax and scale there, where torch ops would compute and store them between
    the two kernels and invert the scale at each GEMM (docs/guide/fp8.md counts them).

    Args:
        x: a non-empty 2-D floating tensor (any strides) on a CUDA device (a CPU one under the
            interpreter).
        fmt: a tensorwise format with a fused kernel (fp32 or pow2 scales; see :func:`format_supported`).
        transpose: also write ``x.T`` (K, M) cast with the same scale, contiguous.
        cast: False stores the scaled, clamped float32 values instead of fp8 (the tests' view).
        amax_out, scale_out: float32 one-element tensors on ``x``'s device (e.g. ``stats[0, role]`` and
            ``stats[1, role]`` of a layer's float32[2, 3] stats buffer) that receive the amax and the
            scale; both or neither.

    Returns:
        A :class:`PerTensorCast`.

    Raises:
        ValueError: for a format that is not a fused tensorwise one, an ``x`` that is not non-empty 2-D,
            or ``amax_out`` / ``scale_out`` given alone, not float32 one-element, or on another device.
    """
    fmt = _check_per_tensor("dynamic_cast", x, fmt, amax_out, scale_out)
    m, k = x.shape
    kern = _kernels(interpreting())
    out_dtype = fmt.elem.dtype if cast else torch.float32
    with device_of(x):
        amax_bits = _amax_bits(x, kern)
        data = torch.empty(m, k, dtype=out_dtype, device=x.device)
        data_t = torch.empty(k, m, dtype=out_dtype, device=x.device) if transpose else data
        scale, descale = (torch.empty((), dtype=torch.float32, device=x.device) for _ in range(2))
        stats = amax_out is not None
        kern.cast[_grid(m, k)](
            x, m, k, x.stride(0), x.stride(1), amax_bits, amax_bits, scale, data, data_t, scale, scale,
            amax_out if stats else scale, scale_out if stats else scale, descale,
            BM=_BM, BK=_BK, MODE=0, TRANSPOSE=transpose, ELEM_MAX=float(fmt.elem.max),
            POW2=fmt.scale == "pow2", CAST=cast, F8=kern.DTYPES[fmt.element], PRECISE=not interpreting(),
            F32_DIV=F32_DIV["cast"], STATS=stats, DESCALE=True,
        )  # fmt: skip
    _written_in_place(amax_out, scale_out)
    return PerTensorCast(data, data_t if transpose else None, scale, descale, amax_bits.view(torch.float32))


def delayed_cast(
    x: torch.Tensor,
    fmt: LowbitFormat | str,
    history: torch.Tensor,
    *,
    amax_compute_algo: str = "max",
    margin: int = 0,
    update: bool = True,
    transpose: bool = False,
    cast: bool = True,
    amax_out: torch.Tensor | None = None,
    scale_out: torch.Tensor | None = None,
) -> PerTensorCast:
    """Delayed tensorwise scaling (Transformer Engine's ``DelayedScaling``) in three kernels, bit for bit
    :class:`mixprec.lowbit.history.TensorScaling` (``delayed=True``) followed by
    :func:`mixprec.lowbit.history.to_float8`: ``max|x|``; one program that computes the scale from the
    amax history (:func:`mixprec.lowbit.history.delayed_scale`, then pow2 where ``fmt`` says), records
    amax and scale and pushes the amax (:func:`mixprec.lowbit.history.push_amax`); the cast with the
    transposed copy: four launches with the zero-fill.

    Args:
        x: a non-empty 2-D floating tensor (any strides) on a CUDA device (a CPU one under the
            interpreter).
        fmt: a tensorwise format with a fused kernel (see :func:`format_supported`).
        history: the role's float32[L] amax history (newest first), contiguous, on ``x``'s device, of
            finite amaxes >= 0 (as ``push_amax`` keeps it and a checkpoint load checks it); updated in
            place when ``update``.
        amax_compute_algo: ``"max"`` (the history's largest entry) or ``"most_recent"`` (``history[0]``).
        margin: the scale is divided by ``2**margin``; an int from 0 to 64.
        update: push the amax into ``history`` (training).
        transpose, cast, amax_out, scale_out: as :func:`dynamic_cast`'s.

    Returns:
        A :class:`PerTensorCast` (its ``scale`` nan when the amax is not finite, so the cast is all nan,
        and the history is kept).

    Raises:
        ValueError: as :func:`dynamic_cast`, and for a ``history`` that is not a non-empty contiguous
            float32 1-D tensor on ``x``'s device, another ``amax_compute_algo`` or a ``margin`` outside
            0-64.
    """
    fmt = _check_per_tensor("delayed_cast", x, fmt, amax_out, scale_out)
    if (
        not isinstance(history, torch.Tensor)
        or history.dtype != torch.float32
        or history.dim() != 1
        or history.numel() == 0
        or history.stride(0) != 1
        or history.device != x.device
    ):
        got = (
            f"{history.dtype} {tuple(history.shape)} on {history.device}"
            if torch.is_tensor(history)
            else history
        )
        raise ValueError(
            f"history must be a non-empty contiguous float32 1-D tensor on {x.device}, got {got}"
        )
    if amax_compute_algo not in ("max", "most_recent"):
        raise ValueError(f"amax_compute_algo must be 'max' or 'most_recent', got {amax_compute_algo!r}")
    if isinstance(margin, bool) or not isinstance(margin, int) or not 0 <= margin <= MAX_MARGIN:
        raise ValueError(f"margin must be an int from 0 to {MAX_MARGIN}, got {margin!r}")
    kern = _kernels(interpreting())
    pow2 = fmt.scale == "pow2"
    with device_of(x):
        amax_bits = _amax_bits(x, kern)
        scale, descale = (torch.empty((), dtype=torch.float32, device=x.device) for _ in range(2))
        stats = amax_out is not None
        length = history.numel()
        kern.delayed_scale[(1,)](
            amax_bits, history, length, scale, amax_out if stats else scale, scale_out if stats else scale,
            descale,
            ELEM_MAX=float(fmt.elem.max), POW2=pow2, PRECISE=not interpreting(), F32_DIV=F32_DIV["cast"],
            MARGIN_DIV=2.0**margin, ALGO_MAX=amax_compute_algo == "max", UPDATE=update,
            GROWTH=_GROWTH, STATS=stats, HBLOCK=max(16, 1 << (length - 1).bit_length()),
        )  # fmt: skip
        data, data_t = _scaled_cast(x, scale, fmt, transpose, cast)
    _written_in_place(amax_out, scale_out, history if update else None)
    return PerTensorCast(data, data_t, scale, descale, amax_bits.view(torch.float32))


#: The largest ``margin`` :func:`delayed_cast` takes (``2**margin`` stays a normal float32).
MAX_MARGIN = 64
_BM, _BK = 64, 64  # the cast and amax kernels' tile


def _grid(m: int, k: int) -> tuple[int, int]:
    return triton_cdiv(m, _BM), triton_cdiv(k, _BK)


def _written_in_place(*tensors: torch.Tensor | None) -> None:
    """Count a kernel's writes through pointers as in-place changes (autograd's version counters), as the
    torch ops they replace count theirs."""
    torch.autograd.graph.increment_version([t for t in tensors if t is not None])


def _amax_bits(x: torch.Tensor, kern: Any) -> torch.Tensor:
    """``max|x|`` of a 2-D ``x`` as the int32 bits of its float32 value (0-dim), one amax launch."""
    m, k = x.shape
    amax_bits = torch.zeros((), dtype=torch.int32, device=x.device)
    kern.amax[_grid(m, k)](
        x, m, k, x.stride(0), x.stride(1), amax_bits, amax_bits, BM=_BM, BK=_BK, ROWWISE=False, COLS=False
    )
    return amax_bits


def _check_per_tensor(
    name: str,
    x: torch.Tensor,
    fmt: LowbitFormat | str,
    amax_out: torch.Tensor | None,
    scale_out: torch.Tensor | None,
) -> LowbitFormat:
    fmt = get_format(fmt)
    if not format_supported(fmt) or fmt.block != (-1, -1) or x.dim() != 2 or x.numel() == 0:
        raise ValueError(
            f"{name} takes a non-empty 2-D tensor and a fused tensorwise format, got "
            f"{tuple(x.shape)}, {fmt.name}"
        )
    if (amax_out is None) != (scale_out is None):
        raise ValueError(f"{name} takes amax_out and scale_out together, got one of them")
    for what, out in (("amax_out", amax_out), ("scale_out", scale_out)):
        if out is not None and (out.dtype != torch.float32 or out.numel() != 1 or out.device != x.device):
            raise ValueError(
                f"{what} must be a float32 one-element tensor on {x.device}, got {out.dtype} of shape "
                f"{tuple(out.shape)} on {out.device}"
            )
    return fmt


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """``max|x|`` as a float32 0-dim tensor in one pass, :func:`mixprec.lowbit.history.amax_of`'s value
    (an integer max of the magnitude bits: exact, a nan kept, its payload aside).

    ``x``: a non-empty floating tensor of 1 or 2 dims (any strides) on a CUDA device (a CPU one under
    the interpreter).
    """
    with device_of(x):
        return _amax_bits(x.reshape(1, -1) if x.dim() == 1 else x, _kernels(interpreting())).view(
            torch.float32
        )


def post_scale_eligible(out: torch.Tensor) -> bool:
    """Whether :func:`post_scale_` runs its kernel on ``out``: a 2-D bfloat16 tensor that passes the gate
    the quantizers pass (a plain CUDA tensor, or a CPU one under the interpreter, in eager mode, Triton
    importable, ``MIXPREC_FUSED_QUANTIZE`` not ``0``); elsewhere the caller computes
    ``out *= row_scale * col_scale`` with torch (inductor fuses it under ``torch.compile``)."""
    return out.dim() == 2 and out.dtype == torch.bfloat16 and _launchable(out)


def post_scale_(out: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor) -> torch.Tensor:
    """``out *= row_scale * col_scale`` in place, bit for bit torch's, without the (M, N) float32 product.

    Each element becomes ``bfloat16(float32(out[i, j]) * (row_scale[i] * col_scale[j]))``: the scale
    product rounded to float32 and the multiply in float32, rounded once to bfloat16 (nearest even), as
    torch's ``out *= row_scale * col_scale`` computes it, in one pass over ``out`` instead of torch's
    two (the outer product, then the multiply). The rowwise GEMM's epilogue of torchao's
    ``float8_ops.addmm_float8_unwrapped`` without fast accumulation (see :mod:`mixprec.lowbit.gemm`).
    On a GPU the cast is the device's float32-to-bfloat16 conversion, as torch's CUDA kernels convert;
    under the interpreter, whose own conversion truncates, an integer round to nearest even (torch's CPU
    ``c10::detail::round_to_nearest_even``, a nan as 0x7FC0).

    Args:
        out: bfloat16 (M, N), any strides, on a CUDA device (a CPU one under the interpreter).
        row_scale: float32 with M elements ((M, 1) or (M,)), on ``out``'s device.
        col_scale: float32 with N elements ((1, N) or (N,)), on ``out``'s device.

    Returns:
        ``out``, modified in place.

    Raises:
        ValueError: for an ``out`` that is not 2-D bfloat16, or scales of another dtype, size or device
            (``out`` is left unchanged).
    """
    if out.dim() != 2 or out.dtype != torch.bfloat16:
        raise ValueError(f"out must be a 2-D bfloat16 tensor, got {out.dtype} of shape {tuple(out.shape)}")
    m, n = out.shape
    for name, scale, size in (("row_scale", row_scale, m), ("col_scale", col_scale, n)):
        if scale.dtype != torch.float32 or scale.numel() != size or scale.device != out.device:
            raise ValueError(
                f"{name} must be float32 with {size} elements on {out.device} for out of shape {(m, n)}, "
                f"got {scale.dtype} of shape {tuple(scale.shape)} on {scale.device}"
            )
    if out.numel() == 0:
        return out
    rows, cols = row_scale.reshape(-1).contiguous(), col_scale.reshape(-1).contiguous()
    bits = out.view(torch.int16)  # the kernel reads and writes bfloat16 as its bits (see the doc)
    bm, bn = 32, 128
    with device_of(out):
        _kernels(interpreting()).post_scale[(triton_cdiv(m, bm), triton_cdiv(n, bn))](
            bits, rows, cols, m, n, bits.stride(0), bits.stride(1), BM=bm, BN=bn, PRECISE=not interpreting()
        )
    _written_in_place(out)
    return out


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _kernels(interpret: bool) -> Any:
    """The kernels module (``_triton_kernels.py``), loaded once per interpreter setting."""
    path = Path(__file__).with_name("_triton_kernels.py")
    return kernels(path, "mixprec.lowbit._triton_kernels", interpret)
