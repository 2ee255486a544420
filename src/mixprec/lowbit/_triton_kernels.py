"""The Triton kernels of :mod:`mixprec.lowbit.triton_quantize` (see its doc), imported only by it and only
when Triton is installed; loaded once per ``TRITON_INTERPRET`` setting, which ``triton.jit`` reads here.

``PRECISE`` (a kernel argument): libdevice's ``log2f`` / ``exp2f`` for pow2 scales, as torch's CUDA
kernels compute them; the interpreter, which has no libdevice, passes False and gets numpy's.

``F32_DIV`` (a kernel argument): the scale ``ELEM_MAX / max(amax, EPS)`` as one correctly rounded float32
division instead of a float64 division rounded to float32. The bits are the same: double rounding through
a format of at least 2p + 2 bits is innocuous for division (Figueroa, "When is double rounding
innocuous?", SIGNUM Newsletter 1995; float64's 53 bits >= 2 * 24 + 2), the quotients stay normal (amax >=
EPS, ELEM_MAX <= 57344), and an amax below EPS takes EPS's quotient rounded once, as the float64 path
does. It holds fewer registers where a tile needs many scales.
"""

from __future__ import annotations

import importlib
import os
import struct
from typing import Any

import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# The interpreter has no libdevice (numpy's functions stand in for tl.log2 and the like).
libdevice: Any = None if INTERPRET else importlib.import_module("triton.language.extra.libdevice")

#: scaling.EPS: the smallest amax a scale is computed from.
EPS: Any = tl.constexpr(1e-12)


def _float32_at_or_above(value: float) -> float:
    bits = struct.unpack("<I", struct.pack("<f", value))[0]  # round to nearest
    bits += struct.unpack("<f", struct.pack("<I", bits))[0] < value
    return struct.unpack("<f", struct.pack("<I", bits))[0]


#: The smallest float32 >= EPS: a float32 amax below it is below EPS.
EPS_F32_UP: Any = tl.constexpr(_float32_at_or_above(1e-12))


@triton.jit
def _scale_of(amax_bits, ELEM_MAX: tl.constexpr, POW2: tl.constexpr, PRECISE: tl.constexpr,
              F32_DIV: tl.constexpr):  # fmt: skip
    # scaling.fp32_scale: ELEM_MAX / max(amax, EPS) in float64 (Triton divides f64 as div.rn), one
    # rounding to float32, or the same bits from one float32 div.rn (F32_DIV, the module doc); a nan amax
    # stays nan in both; pow2: exp2(floor(log2 s)) with libdevice's log2f, torch's CUDA log2.
    if F32_DIV:
        a = amax_bits.to(tl.float32, bitcast=True)
        at_eps = (tl.full([], ELEM_MAX, tl.float64) / EPS).to(tl.float32)
        s = tl.where(a < EPS_F32_UP, at_eps, tl.div_rn(tl.full(a.shape, ELEM_MAX, tl.float32), a))
    else:
        a64 = amax_bits.to(tl.float32, bitcast=True).to(tl.float64)
        a64 = tl.where(a64 != a64, a64, tl.maximum(a64, EPS))
        s = (ELEM_MAX / a64).to(tl.float32)
    if POW2:
        s = _pow2(s, PRECISE)
    return s


@triton.jit
def _pow2(s, PRECISE: tl.constexpr):
    # torchao's round_scales_to_power_of_2: exp2(floor(log2 s)), libdevice's log2f as torch's CUDA log2
    if PRECISE:
        return libdevice.exp2(libdevice.floor(libdevice.log2(s)))
    else:  # the interpreter has no libdevice; numpy's log2
        return tl.exp2(tl.floor(tl.log2(s)))


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


# Triton's own @jit helpers (tl.max, its combine function) are made when Triton is first imported, under
# whichever TRITON_INTERPRET setting that import saw; the other setting cannot call them (the compiler
# fails on an interpreted one, the interpreter on a compiled tl.max). So the compiled kernels reduce with
# this module's own combine function, made here under their setting, and the interpreted ones with
# tl.standard's, which the interpreter recognizes by identity and runs as numpy's max.
_MAX_COMBINE: Any = tl.standard._elementwise_max if INTERPRET else _maximum


@triton.jit
def _amax(bits, axis: tl.constexpr):
    return tl.reduce(bits, axis, _MAX_COMBINE)


@triton.jit
def _saturate(v, ELEM_MAX: tl.constexpr):
    # clamp(v, -max, max) with a nan kept (torch.clamp's), not dropped as min/max may drop it
    return tl.where(v != v, v, tl.minimum(tl.maximum(v, -ELEM_MAX), ELEM_MAX))


@triton.jit
def _store(ptr, v, mask, CAST: tl.constexpr, F8: tl.constexpr):
    if CAST:
        tl.store(ptr, v.to(F8), mask=mask)
    else:
        tl.store(ptr, v, mask=mask)


@triton.jit
def _tile(x_ptr, M, K, sxm, sxk, BM: tl.constexpr, BK: tl.constexpr):
    # This program's BM x BK tile of the (M, K) strided input as float32, zeros beyond M and K.
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rk = tl.program_id(1) * BK + tl.arange(0, BK)
    mask = (rm[:, None] < M) & (rk[None, :] < K)
    x = tl.load(x_ptr + rm[:, None].to(tl.int64) * sxm + rk[None, :] * sxk, mask=mask, other=0.0)
    return rm, rk, mask, x.to(tl.float32)


@triton.jit
def amax(x_ptr, M, K, sxm, sxk, row_ptr, col_ptr, BM: tl.constexpr, BK: tl.constexpr,
                ROWWISE: tl.constexpr, COLS: tl.constexpr):  # fmt: skip
    # max |x| as the int32 of its float32 bits (sign cleared): ordered as the magnitudes, a nan
    # above inf, so an atomic integer max is exact in any order and keeps a nan.
    rm, rk, _, x = _tile(x_ptr, M, K, sxm, sxk, BM, BK)
    bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    if ROWWISE:
        tl.atomic_max(row_ptr + rm, _amax(bits, 1), mask=rm < M)
        if COLS:
            tl.atomic_max(col_ptr + rk, _amax(bits, 0), mask=rk < K)
    else:
        tl.atomic_max(row_ptr, _amax(_amax(bits, 1), 0))


@triton.jit
def cast(x_ptr, M, K, sxm, sxk, row_ptr, col_ptr, scale_in_ptr, out_ptr, out_t_ptr,
                scale_ptr, scale_t_ptr, amax_out_ptr, scale_out_ptr, descale_ptr, BM: tl.constexpr,
                BK: tl.constexpr, MODE: tl.constexpr, TRANSPOSE: tl.constexpr,
                ELEM_MAX: tl.constexpr, POW2: tl.constexpr, CAST: tl.constexpr, F8: tl.constexpr,
                PRECISE: tl.constexpr, F32_DIV: tl.constexpr, STATS: tl.constexpr,
                DESCALE: tl.constexpr):  # fmt: skip
    # MODE 0: one scale from the tensor amax; 1: a given scale; 2: a scale per row (and per column
    # for the transposed copy). MODE 0 with STATS: also the amax and the scale into a layer's stats
    # slots; with DESCALE: the scale's reciprocal for the GEMMs (torch's CUDA reciprocal, 1 / s rounded
    # once), so a dynamic tensorwise layer records and inverts its scale without more launches.
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    rm, rk, mask, x = _tile(x_ptr, M, K, sxm, sxk, BM, BK)
    if MODE == 2:
        s_row = _scale_of(tl.load(row_ptr + rm, mask=rm < M, other=0), ELEM_MAX, POW2, PRECISE, F32_DIV)
        y = _saturate(x * s_row[:, None], ELEM_MAX)
        if pid_k == 0:
            tl.store(scale_ptr + rm, s_row, mask=rm < M)
    else:
        if MODE == 0:
            amax_bits = tl.load(row_ptr)
            s = _scale_of(amax_bits, ELEM_MAX, POW2, PRECISE, F32_DIV)
            if (pid_m == 0) & (pid_k == 0):
                tl.store(scale_ptr, s)
                if STATS:
                    tl.store(amax_out_ptr, amax_bits.to(tl.float32, bitcast=True))
                    tl.store(scale_out_ptr, s)
                if DESCALE:
                    tl.store(descale_ptr, tl.div_rn(tl.full(s.shape, 1.0, tl.float32), s))
        else:
            s = tl.load(scale_in_ptr)
        y = _saturate(x * s, ELEM_MAX)
    _store(out_ptr + rm[:, None].to(tl.int64) * K + rk[None, :], y, mask, CAST, F8)
    if TRANSPOSE:
        if MODE == 2:
            col_amax = tl.load(col_ptr + rk, mask=rk < K, other=0)
            s_col = _scale_of(col_amax, ELEM_MAX, POW2, PRECISE, F32_DIV)
            yt = _saturate(x * s_col[None, :], ELEM_MAX)
            if pid_m == 0:
                tl.store(scale_t_ptr + rk, s_col, mask=rk < K)
        else:
            yt = y
            if MODE == 0:
                if (pid_m == 0) & (pid_k == 0):
                    tl.store(scale_t_ptr, s)
        mask_t = (rk[:, None] < K) & (rm[None, :] < M)
        _store(out_t_ptr + rk[:, None].to(tl.int64) * M + rm[None, :], tl.trans(yt), mask_t, CAST, F8)


@triton.jit
def delayed_scale(amax_ptr, hist_ptr, L, scale_ptr, amax_out_ptr, scale_out_ptr, descale_ptr,
                  ELEM_MAX: tl.constexpr,
                  POW2: tl.constexpr, PRECISE: tl.constexpr, F32_DIV: tl.constexpr,
                  MARGIN_DIV: tl.constexpr, ALGO_MAX: tl.constexpr, UPDATE: tl.constexpr,
                  GROWTH: tl.constexpr, STATS: tl.constexpr, HBLOCK: tl.constexpr):  # fmt: skip
    # One program: history.delayed_scale (then pow2) from the amax the amax kernel left (float32 bits)
    # and the role's float32[L] history, then push_amax. The history holds finite amaxes >= 0 (push_amax
    # keeps it so, check_amax_history refuses others on load), so its max is an integer max of the bits;
    # one program reads the history before it writes it.
    offs = tl.arange(0, HBLOCK)
    in_l = offs < L
    hist = tl.load(hist_ptr + offs, mask=in_l, other=0.0)
    amax_bits = tl.load(amax_ptr)
    if ALGO_MAX:
        past_bits = _amax(hist.to(tl.int32, bitcast=True), 0)
    else:
        past_bits = tl.load(hist_ptr).to(tl.int32, bitcast=True)
    s = _scale_of(tl.where(past_bits > 0, past_bits, amax_bits), ELEM_MAX, False, PRECISE, F32_DIV)
    if MARGIN_DIV != 1.0:  # scale / 2**margin: a power of two, so div_rn is torch's float32 division
        s = tl.div_rn(s, tl.full(s.shape, MARGIN_DIV, tl.float32))
    finite = (amax_bits & 0x7FFFFFFF) < 0x7F800000
    s = tl.where(finite, s, float("nan"))
    if POW2:
        s = _pow2(s, PRECISE)
    tl.store(scale_ptr, s)
    tl.store(descale_ptr, tl.div_rn(tl.full(s.shape, 1.0, tl.float32), s))  # torch's reciprocal
    if STATS:
        tl.store(amax_out_ptr, amax_bits.to(tl.float32, bitcast=True))
        tl.store(scale_out_ptr, s)
    if UPDATE:  # push_amax: the new amax first (at most AMAX_GROWTH_LIMIT x the past max), the oldest out
        amax = amax_bits.to(tl.float32, bitcast=True)
        past = past_bits.to(tl.float32, bitcast=True)
        if not ALGO_MAX:
            past = _amax(hist.to(tl.int32, bitcast=True), 0).to(tl.float32, bitcast=True)
        bounded = tl.where(past > 0, tl.minimum(amax, past * GROWTH), amax)
        older = tl.load(hist_ptr + offs - 1, mask=in_l & (offs > 0), other=0.0)
        tl.store(hist_ptr + offs, tl.where(offs == 0, bounded, older), mask=in_l & finite)


@triton.jit
def block(x_ptr, M, K, sxm, sxk, out_ptr, out_t_ptr, scale_ptr, scale_t_ptr,
                 OUT_ROWS, OUT_T_ROWS, KP, MP, BM: tl.constexpr, BK: tl.constexpr,
                 TWO_D: tl.constexpr, TRANSPOSE: tl.constexpr, ELEM_MAX: tl.constexpr,
                 POW2: tl.constexpr, CAST: tl.constexpr, F8: tl.constexpr,
                 PRECISE: tl.constexpr, F32_DIV: tl.constexpr):  # fmt: skip
    # One BM x 128 tile (zeros beyond M, K: quantize's padding): 1x128 blocks are its rows, the
    # transposed copy's 1x128 blocks its columns (BM = 128), a 128x128 block the tile itself.
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    rm, rk, _, x = _tile(x_ptr, M, K, sxm, sxk, BM, BK)
    bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    n_kb = KP // BK
    n_mb = MP // BK
    if TWO_D:
        s = _scale_of(_amax(_amax(bits, 1), 0), ELEM_MAX, POW2, PRECISE, F32_DIV)
        y = _saturate(x * s, ELEM_MAX)
        tl.store(scale_ptr + pid_m * n_kb + pid_k, s)
        if TRANSPOSE:
            tl.store(scale_t_ptr + pid_k * n_mb + pid_m, s)
    else:
        s_row = _scale_of(_amax(bits, 1), ELEM_MAX, POW2, PRECISE, F32_DIV)
        y = _saturate(x * s_row[:, None], ELEM_MAX)
        tl.store(scale_ptr + rm.to(tl.int64) * n_kb + pid_k, s_row, mask=rm < OUT_ROWS)
    out_mask = (rm[:, None] < OUT_ROWS) & (rk[None, :] < KP)
    _store(out_ptr + rm[:, None].to(tl.int64) * KP + rk[None, :], y, out_mask, CAST, F8)
    if TRANSPOSE:
        if TWO_D:
            yt = y
        else:
            s_col = _scale_of(_amax(bits, 0), ELEM_MAX, POW2, PRECISE, F32_DIV)
            yt = _saturate(x * s_col[None, :], ELEM_MAX)
            tl.store(scale_t_ptr + rk.to(tl.int64) * n_mb + pid_m, s_col, mask=rk < OUT_T_ROWS)
        mask_t = (rk[:, None] < OUT_T_ROWS) & (rm[None, :] < MP)
        _store(out_t_ptr + rk[:, None].to(tl.int64) * MP + rm[None, :], tl.trans(yt), mask_t, CAST, F8)


@triton.jit
def post_scale(out_ptr, row_ptr, col_ptr, M, N, som, son, BM: tl.constexpr, BN: tl.constexpr,
               PRECISE: tl.constexpr):  # fmt: skip
    # out[i, j] = bf16(f32(out[i, j]) * (row[i] * col[j])) in place; out is the bfloat16 tensor's bits
    # (int16), widened to float32 exactly by a shift, so the interpreter's own bf16 casts never run.
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    ptrs = out_ptr + rm[:, None].to(tl.int64) * som + rn[None, :].to(tl.int64) * son
    bits = tl.load(ptrs, mask=mask, other=0).to(tl.uint16, bitcast=True).to(tl.uint32)
    x = (bits << 16).to(tl.float32, bitcast=True)
    row = tl.load(row_ptr + rm, mask=rm < M, other=0.0)
    col = tl.load(col_ptr + rn, mask=rn < N, other=0.0)
    y = x * (row[:, None] * col[None, :])  # the scale product first, as torch's outer product
    if PRECISE:  # cvt.rn.bf16.f32, the conversion torch's CUDA kernels use (sm80+)
        out = y.to(tl.bfloat16).to(tl.int16, bitcast=True)
    else:  # the interpreter's cast truncates: round to nearest even on the bits, a nan as 0x7FC0 (c10's)
        u = y.to(tl.uint32, bitcast=True)
        r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        r = tl.where(y != y, 0x7FC0, r)
        out = r.to(tl.uint16).to(tl.int16, bitcast=True)
    tl.store(ptrs, out, mask=mask)


#: The fp8 element types by lowbit element name.
DTYPES = {"e4m3": tl.float8e4nv, "e5m2": tl.float8e5}
