"""The Triton kernel of :mod:`mixprec.optim._triton_adam` (see its doc), imported only by it and only when
Triton is installed; loaded once per ``TRITON_INTERPRET`` setting, which ``triton.jit`` reads here.

bf16 tensors come in as their int16 bits: widening is a shift, and rounding back is integer arithmetic,
the same code compiled and interpreted (the interpreter's float32-to-bf16 cast truncates). The random bits
are this module's own Philox4x32-10 (Salmon et al. 2011, "Parallel Random Numbers: As Easy as 1, 2, 3"):
``tl.randint`` and ``tl.zeros_like`` are ``triton.jit`` helpers made under whichever interpreter setting
first imported Triton, which the other setting cannot call.
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
def adam(
    w_ptr, c_ptr, g_ptr, m_ptr, v_ptr, step_ptr, seed_ptr, bc_ptr, n, index,
    lr, beta1, beta2, eps, wd,
    ADAMW: tl.constexpr, DECAY: tl.constexpr, MAXIMIZE: tl.constexpr, ROUND: tl.constexpr,
    M_BF16: tl.constexpr, V_BF16: tl.constexpr, PRECISE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # One Adam/AdamW step of one bf16 tensor (ROUND 0 nearest, 1 Kahan, 2 stochastic); the fp32 math is
    # torch's CUDA fused Adam's (fused_adam_utils.cuh, adam_math), operation for operation, fma for fma.
    # fp32 hyperparameters (the interpreter passes Python floats through as float64)
    lr, beta1, beta2 = tl.cast(lr, tl.float32), tl.cast(beta1, tl.float32), tl.cast(beta2, tl.float32)
    eps, wd = tl.cast(eps, tl.float32), tl.cast(wd, tl.float32)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    step = tl.load(step_ptr)
    if PRECISE:  # libdevice's powf, the CUDA math library's, which torch's kernel calls
        bc1 = 1.0 - libdevice.pow(beta1, step)
        bc2 = 1.0 - libdevice.pow(beta2, step)
    else:
        bc1 = tl.load(bc_ptr)
        bc2 = tl.load(bc_ptr + 1)
    step_size = tl.div_rn(lr, bc1)
    bc2_sqrt = tl.sqrt_rn(bc2)
    w = _widen(tl.load(w_ptr + offs, mask=mask))
    p = w
    if ROUND == 1:
        p = w + _widen(tl.load(c_ptr + offs, mask=mask))
    g = _widen(tl.load(g_ptr + offs, mask=mask))
    m = tl.load(m_ptr + offs, mask=mask)
    if M_BF16:
        m = _widen(m)
    v = tl.load(v_ptr + offs, mask=mask)
    if V_BF16:
        v = _widen(v)
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
    if ROUND == 2:  # 16 uniform bits under bf16's last one, then truncate: carries with the dropped fraction
        bits = _philox(offs.to(tl.uint32), (offs * 0 + index).to(tl.uint32), tl.load(seed_ptr))
        rounded = (p.to(tl.int32, bitcast=True) + (bits & 0xFFFF).to(tl.int32)) >> 16
        tl.store(w_ptr + offs, tl.where(p != p, 0x7FC0, rounded).to(tl.int16), mask=mask)
    else:
        w_new = _nearest(p)
        tl.store(w_ptr + offs, w_new, mask=mask)
        if ROUND == 1:  # the remainder, exact in fp32 (w_new is p's neighbour), rounded to bf16
            tl.store(c_ptr + offs, _nearest(p - _widen(w_new)), mask=mask)
    if M_BF16:
        m = _nearest(m)
    tl.store(m_ptr + offs, m, mask=mask)
    if V_BF16:
        v = _nearest(v)
    tl.store(v_ptr + offs, v, mask=mask)
