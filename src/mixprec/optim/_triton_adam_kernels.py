"""The Triton kernels of :mod:`mixprec.optim._triton_adam` (see its doc), imported only by it and only when
Triton is installed; loaded once per ``TRITON_INTERPRET`` setting, which ``triton.jit`` reads here.

``adam`` steps a tensor with moments in torch's layout, ``adam_coded`` one run of a block-coded tensor
(int8 / fp8 moments); both share the Adam math and the weight's rounding. ``cast_e4m3`` is the coded
kernel's e4m3 cast on its own, for the tests.

bf16 tensors come in as their int16 bits: widening is a shift, and rounding back is integer arithmetic,
the same code compiled and interpreted (the interpreter's float32-to-bf16 cast truncates). The random bits
are this module's own Philox4x32-10 (Salmon et al. 2011, "Parallel Random Numbers: As Easy as 1, 2, 3"):
``tl.randint``, ``tl.zeros_like``, ``tl.zeros`` and ``tl.max`` are ``triton.jit`` helpers made under
whichever interpreter setting first imported Triton, which the other setting cannot call.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# The interpreter has no libdevice; it is given the bias corrections (see _triton_adam.step_unit).
libdevice: Any = None if INTERPRET else importlib.import_module("triton.language.extra.libdevice")


@triton.jit
def _widen(bits):
    # bf16 bits (int16) -> fp32, exact
    return (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _nearest(x):
    # fp32 -> bf16 bits rounded to nearest even (c10's round_to_nearest_even); a nan -> 0x7FC0
    bits = x.to(tl.int32, bitcast=True)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    return tl.where(x != x, 0x7FC0, rounded).to(tl.int16)


@triton.jit
def _philox(c0, c1, seed):
    # Philox4x32-10 of the counter (c0, c1, 0, 0) under the 64-bit key ``seed``; the first word
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    c2 = c0 * 0  # not tl.zeros_like: a triton.jit helper (see the module doc)
    c3 = c0 * 0
    for _ in tl.static_range(10):
        a0, a2 = c0, c2
        c0 = tl.math.umulhi(a2, 0xCD9E8D57) ^ c1 ^ k0
        c2 = tl.math.umulhi(a0, 0xD2511F53) ^ c3 ^ k1
        c1 = a2 * 0xCD9E8D57
        c3 = a0 * 0xD2511F53
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return c0


@triton.jit
def _step_sizes(step_ptr, bc_ptr, lr, beta1, beta2, PRECISE: tl.constexpr):
    # lr / (1 - b1**step) and sqrt(1 - b2**step), as torch's kernel computes them
    step = tl.load(step_ptr)
    if PRECISE:  # libdevice's powf, the CUDA math library's, which torch's kernel calls
        bc1 = 1.0 - libdevice.pow(beta1, step)
        bc2 = 1.0 - libdevice.pow(beta2, step)
    else:
        bc1 = tl.load(bc_ptr)
        bc2 = tl.load(bc_ptr + 1)
    return tl.div_rn(lr, bc1), tl.sqrt_rn(bc2)


@triton.jit
def _load_weight(w_ptr, c_ptr, offs, mask, ROUND: tl.constexpr, W_F32: tl.constexpr):
    # fp32(w) + fp32(c) with a Kahan buffer (ROUND 1), else fp32(w); an fp32 weight (W_F32) as it is
    if W_F32:
        p = tl.load(w_ptr + offs, mask=mask)
    else:
        p = _widen(tl.load(w_ptr + offs, mask=mask))
        if ROUND == 1:
            p = p + _widen(tl.load(c_ptr + offs, mask=mask))
    return p


@triton.jit
def _load_grad(g_ptr, offs, mask, W_F32: tl.constexpr):
    # the gradient in fp32: an fp32 weight's is fp32, a bf16 one's bf16 (bits)
    if W_F32:
        g = tl.load(g_ptr + offs, mask=mask)
    else:
        g = _widen(tl.load(g_ptr + offs, mask=mask))
    return g


@triton.jit
def _adam_math(
    p, g, m, v, step_size, bc2_sqrt, lr, beta1, beta2, eps, wd,
    ADAMW: tl.constexpr, DECAY: tl.constexpr, MAXIMIZE: tl.constexpr,
):  # fmt: skip
    # torch's CUDA fused Adam (fused_adam_utils.cuh, adam_math), operation for operation, fma for fma
    if MAXIMIZE:
        g = -g
    if DECAY:
        if ADAMW:
            p = tl.fma(p, -(lr * wd), p)
        else:
            g = tl.fma(p, wd, g)
    m = tl.fma(m, beta1, tl.fma(g, -beta1, g))
    g2 = g * g
    v = tl.fma(v, beta2, tl.fma(g2, -beta2, g2))
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    p = p - tl.div_rn(step_size * m, denom)
    return p, m, v


@triton.jit
def _store_weight(
    w_ptr, c_ptr, seed_ptr, p, offs, mask, counter, index, ROUND: tl.constexpr, W_F32: tl.constexpr
):  # fmt: skip
    # the stepped fp32 value into the bf16 weight: nearest (ROUND 0), Kahan (1), stochastic (2);
    # ``counter``: each value's Philox counter within its tensor. An fp32 weight (W_F32) takes it as it is
    if W_F32:
        tl.store(w_ptr + offs, p, mask=mask)
    elif ROUND == 2:
        # 16 uniform bits under bf16's last one, then truncate: carries with the dropped fraction
        bits = _philox(counter.to(tl.uint32), (counter * 0 + index).to(tl.uint32), tl.load(seed_ptr))
        rounded = (p.to(tl.int32, bitcast=True) + (bits & 0xFFFF).to(tl.int32)) >> 16
        tl.store(w_ptr + offs, tl.where(p != p, 0x7FC0, rounded).to(tl.int16), mask=mask)
    else:
        w_new = _nearest(p)
        tl.store(w_ptr + offs, w_new, mask=mask)
        if ROUND == 1:  # the remainder, exact in fp32 (w_new is p's neighbour), rounded to bf16
            tl.store(c_ptr + offs, _nearest(p - _widen(w_new)), mask=mask)


@triton.jit
def adam(
    w_ptr, c_ptr, g_ptr, m_ptr, v_ptr, step_ptr, seed_ptr, bc_ptr, n, index,
    lr, beta1, beta2, eps, wd,
    ADAMW: tl.constexpr, DECAY: tl.constexpr, MAXIMIZE: tl.constexpr, ROUND: tl.constexpr,
    M_BF16: tl.constexpr, V_BF16: tl.constexpr, PRECISE: tl.constexpr, BLOCK: tl.constexpr,
    W_F32: tl.constexpr,
):  # fmt: skip
    # One Adam/AdamW step of one bf16 tensor, moments in torch's layout (ROUND 0 nearest, 1 Kahan,
    # 2 stochastic), or of an fp32 one (W_F32: its gradient fp32, no rounding). fp32 hyperparameters
    # (the interpreter passes Python floats through as float64)
    lr, beta1, beta2 = tl.cast(lr, tl.float32), tl.cast(beta1, tl.float32), tl.cast(beta2, tl.float32)
    eps, wd = tl.cast(eps, tl.float32), tl.cast(wd, tl.float32)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    step_size, bc2_sqrt = _step_sizes(step_ptr, bc_ptr, lr, beta1, beta2, PRECISE)
    p = _load_weight(w_ptr, c_ptr, offs, mask, ROUND, W_F32)
    g = _load_grad(g_ptr, offs, mask, W_F32)
    m = tl.load(m_ptr + offs, mask=mask)
    if M_BF16:
        m = _widen(m)
    v = tl.load(v_ptr + offs, mask=mask)
    if V_BF16:
        v = _widen(v)
    p, m, v = _adam_math(p, g, m, v, step_size, bc2_sqrt, lr, beta1, beta2, eps, wd, ADAMW, DECAY, MAXIMIZE)
    _store_weight(w_ptr, c_ptr, seed_ptr, p, offs, mask, offs, index, ROUND, W_F32)
    if M_BF16:
        m = _nearest(m)
    tl.store(m_ptr + offs, m, mask=mask)
    if V_BF16:
        v = _nearest(v)
    tl.store(v_ptr + offs, v, mask=mask)


@triton.jit
def _e4m3(x):
    # fp32 -> float8_e4m3fn bits as torch 2.14's cast: c10's rounding step for step (integer rounding to
    # nearest even, one fp32 add for a subnormal), saturating: 448 for anything above it, inf included;
    # 0x7F (nan) for a nan
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    sub = ((a.to(tl.float32, bitcast=True) + 16384.0).to(tl.int32, bitcast=True) - (141 << 23)) & 0xFF
    normal = tl.minimum((a + (((7 - 127) << 23) + 0x7FFFF) + ((a >> 20) & 1)) >> 20, 0x7E)
    code = tl.where(a >= (1087 << 20), 0x7E, tl.where(a < (121 << 23), sub, normal))
    code = tl.where(a > 0x7F800000, 0x7F, code)
    return (code | sign).to(tl.uint8)


@triton.jit
def _decode(codes_ptr, scales_ptr, table_ptr, offs, mask, rows, live, SQRT: tl.constexpr):
    # a block-coded moment in fp32: table[code] * scale (squared where stored as its square root)
    code = tl.load(codes_ptr + offs, mask=mask, other=0).to(tl.int32)
    x = tl.load(table_ptr + code) * tl.load(scales_ptr + rows, mask=live, other=1.0)[:, None]
    if SQRT:
        x = x * x
    return x


@triton.jit
def _larger(a, b):
    return tl.maximum(a, b)


@triton.jit
def _encode(
    x, codes_ptr, scales_ptr, mids_ptr, offs, mask, rows, live, tiny, q,
    FP8: tl.constexpr, SQRT: tl.constexpr, RECIPROCAL: tl.constexpr,
):  # fmt: skip
    # ``state_formats.quantize_`` of each row (one block): absmax, scale, divide, nearest code
    if SQRT:
        x = tl.sqrt_rn(x)
    magnitude = tl.where(mask, x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0)
    # exact in any order, a nan's bits above inf's; our own max: tl.max is a triton.jit helper
    amax = tl.reduce(magnitude, 1, _larger).to(tl.float32, bitcast=True)
    amax = tl.where(amax < tiny, tiny, amax)  # clamp(min=tiny): a nan stays
    if FP8:
        if RECIPROCAL:  # torch's CUDA ``tensor / 448.0`` multiplies by the fp32 reciprocal, q
            scale = amax * q
        else:  # q = 448
            scale = tl.div_rn(amax, q)
    else:
        scale = amax
    tl.store(scales_ptr + rows, scale, mask=live)
    x = tl.div_rn(x, scale[:, None])
    if FP8:
        code = _e4m3(x)
    else:  # torch.bucketize(x, mids, right=True): how many midpoints are not above x (255 for a nan)
        code = x.to(tl.int32, bitcast=True) * 0  # not tl.zeros: a triton.jit helper (see the module doc)
        for k in tl.static_range(8):
            probe = tl.load(mids_ptr + code + ((128 >> k) - 1))
            code = tl.where(probe > x, code, code + (128 >> k))
        code = code.to(tl.uint8)
    tl.store(codes_ptr + offs, code, mask=mask)


@triton.jit
def adam_coded(
    w_ptr, c_ptr, g_ptr, m_ptr, ms_ptr, v_ptr, vs_ptr, m_table, m_mids, v_table, v_mids,
    step_ptr, seed_ptr, bc_ptr, n, start, index,
    lr, beta1, beta2, eps, wd, tiny, q,
    ADAMW: tl.constexpr, DECAY: tl.constexpr, MAXIMIZE: tl.constexpr, ROUND: tl.constexpr,
    FP8: tl.constexpr, RECIPROCAL: tl.constexpr, PRECISE: tl.constexpr, ROWS: tl.constexpr,
    BLOCK: tl.constexpr, W_F32: tl.constexpr,
):  # fmt: skip
    # One Adam/AdamW step of one run of a bf16 (or, W_F32, fp32) tensor's block grid, moments block-coded
    # (int8: the dynamic map's codes, fp8: e4m3, the second moment's square root): a program owns ROWS
    # whole blocks of BLOCK values, a row each, and decodes, steps and encodes them
    lr, beta1, beta2 = tl.cast(lr, tl.float32), tl.cast(beta1, tl.float32), tl.cast(beta2, tl.float32)
    eps, wd, tiny = tl.cast(eps, tl.float32), tl.cast(wd, tl.float32), tl.cast(tiny, tl.float32)
    q = tl.cast(q, tl.float32)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = offs < n
    live = rows * BLOCK < n
    step_size, bc2_sqrt = _step_sizes(step_ptr, bc_ptr, lr, beta1, beta2, PRECISE)
    p = _load_weight(w_ptr, c_ptr, offs, mask, ROUND, W_F32)
    g = _load_grad(g_ptr, offs, mask, W_F32)
    m = _decode(m_ptr, ms_ptr, m_table, offs, mask, rows, live, False)
    v = _decode(v_ptr, vs_ptr, v_table, offs, mask, rows, live, FP8)
    p, m, v = _adam_math(p, g, m, v, step_size, bc2_sqrt, lr, beta1, beta2, eps, wd, ADAMW, DECAY, MAXIMIZE)
    _store_weight(w_ptr, c_ptr, seed_ptr, p, offs, mask, offs + start, index, ROUND, W_F32)
    _encode(m, m_ptr, ms_ptr, m_mids, offs, mask, rows, live, tiny, q, FP8, False, RECIPROCAL)
    _encode(v, v_ptr, vs_ptr, v_mids, offs, mask, rows, live, tiny, q, FP8, FP8, RECIPROCAL)


@triton.jit
def cast_e4m3(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    # ``_e4m3`` on its own, fp32 in, e4m3 bits out: how the tests compare it with torch's cast everywhere
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, _e4m3(tl.load(x_ptr + offs, mask=mask)), mask=mask)
