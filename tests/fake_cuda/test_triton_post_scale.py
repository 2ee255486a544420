"""The fused post-scale of a rowwise fp8 GEMM (``triton_quantize.post_scale_``) against torch's expression.

``out *= row * col`` (bf16 ``out`` (M, N), float32 (M, 1) and (1, N)) is what torchao's
``addmm_float8_unwrapped`` applies to the tensorwise kernel's bf16 output; the kernel must give torch's
bits. Run under Triton's CPU interpreter (``TRITON_INTERPRET=1``, set per test) on CPU tensors. The
interpreter's own float32-to-bfloat16 cast truncates (``triton.runtime.interpreter._convert_float`` with
no rounding mode: round toward zero, and a nan whose payload lies in the low 16 bits becomes inf), so the
interpreted kernel rounds on the bits instead (``PRECISE=False``: nearest even, torch's CPU rounding);
everything else (the bf16 read, the float32 scale product and multiply, the masks and strides) is the
code the GPU runs. The GPU's cast, ``cvt.rn.bf16.f32`` (torch's CUDA conversion), is checked in the
compiled PTX here and bit for bit on a device by the last test (skipped without one). A nan compares
equal to a nan: torch's own CPU paths write different nan payloads (the vectorized cast 0xFFFF, the
scalar one 0x7FC0).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from fake_cuda.bits import same_bits

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),  # numpy's, in the interpreter: 3e38 * 2 -> inf
]

SHAPES = [(1, 1), (5, 7), (70, 300), (33, 129)]


def _case(
    shape: tuple[int, int], kind: str, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    m, n = shape
    out = (torch.randn(m, n, generator=g) * torch.logspace(-3, 3, n)).to(torch.bfloat16)
    row = torch.rand(m, 1, generator=g) * 4 + 1e-3
    col = torch.rand(1, n, generator=g) * 4 + 1e-3
    if kind == "ties":  # x * (1 + 2^-8): an odd 8-bit significand lands exactly half-way (both parities)
        row.fill_(1 + 2**-8)
        col.fill_(1.0)
    elif kind == "specials":  # nan, infs, zeros of both signs, overflow to inf, bf16 subnormal results
        flat = out.view(-1)
        specials = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 3e38, -3e38, 1e-30, 2e-38]
        flat[: min(len(specials), flat.numel())] = torch.tensor(
            specials[: flat.numel()], dtype=torch.bfloat16
        )
        row[0] = 2.0
        if m > 1:
            row[1] = 1e-10  # 1e-30 * 1e-10 * col: float32 subnormal or zero
    return out, row, col


@pytest.mark.parametrize("kind", ["randn", "ties", "specials"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_the_kernel_is_torchs_out_times_row_times_col(interpret, shape, kind):
    out, row, col = _case(shape, kind)
    ref = out.clone()
    ref *= row * col  # torchao's expression
    got = out.clone()
    assert interpret.post_scale_(got, row, col) is got
    assert same_bits(got, ref)
    if kind == "ties" and out.numel() > 16:  # the case exercises rounding: truncation differs here
        truncated = ((out.float() * (row * col)).view(torch.int32) >> 16).to(torch.int16)
        assert not torch.equal(truncated, ref.view(torch.int16))


def test_a_strided_view_is_scaled_in_place_and_the_rest_untouched(interpret):
    out, row, col = _case((40, 96), "randn", seed=3)
    base = out.clone()
    view = base[3:35, ::2]  # rows 3..34, every other column: strides (96, 2)
    r, c = row[3:35], col[:, ::2].contiguous()
    ref = base.clone()
    ref[3:35, ::2] *= r * c
    interpret.post_scale_(view, r, c)
    assert same_bits(base, ref)


def test_one_dim_scales_and_an_empty_out(interpret):
    out, row, col = _case((8, 24), "randn", seed=5)
    ref = out.clone()
    ref *= row * col
    assert same_bits(interpret.post_scale_(out, row.reshape(-1), col.reshape(-1)), ref)
    empty = torch.empty(0, 5, dtype=torch.bfloat16)
    assert interpret.post_scale_(empty, torch.empty(0), torch.ones(5)).shape == (0, 5)


def test_bad_input_is_refused_by_name_and_out_left_unchanged(interpret):
    out, row, col = _case((6, 10), "randn")
    before = out.clone()
    with pytest.raises(ValueError, match="out must be a 2-D bfloat16 tensor, got torch.float32"):
        interpret.post_scale_(out.float(), row, col)
    with pytest.raises(ValueError, match=r"row_scale must be float32 with 6 elements .* got torch.float64"):
        interpret.post_scale_(out, row.double(), col)
    with pytest.raises(ValueError, match=r"col_scale must be float32 with 10 elements .* shape \(1, 9\)"):
        interpret.post_scale_(out, row, col[:, :9])
    assert torch.equal(out.view(torch.int16), before.view(torch.int16))


def test_eligibility_follows_the_quantizers_gate(interpret, monkeypatch):
    out = torch.ones(4, 4, dtype=torch.bfloat16)
    assert interpret.post_scale_eligible(out)
    assert not interpret.post_scale_eligible(out.float())  # the tensorwise kernel wrote bf16; nothing else
    assert not interpret.post_scale_eligible(out.reshape(-1))
    monkeypatch.setenv("MIXPREC_FUSED_QUANTIZE", "0")
    assert not interpret.post_scale_eligible(out)
    monkeypatch.setenv("MIXPREC_FUSED_QUANTIZE", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not interpret.post_scale_eligible(out)  # a CPU tensor without the interpreter


def test_gemm_dispatches_to_the_kernel_and_the_switch_turns_it_off(interpret, monkeypatch):
    """``gemm._post_scale_`` (the rowwise GEMM's epilogue) takes the kernel where it is eligible and
    torch's expression where ``MIXPREC_FUSED_QUANTIZE=0``: the same bits either way."""
    from mixprec.lowbit import gemm

    out, row, col = _case((50, 70), "randn", seed=7)
    calls = []
    real = interpret.post_scale_
    monkeypatch.setattr(interpret, "post_scale_", lambda *a: calls.append(1) or real(*a))
    fused = out.clone()
    gemm._post_scale_(fused, row, col)
    assert calls == [1]
    monkeypatch.setenv("MIXPREC_FUSED_QUANTIZE", "0")
    plain = out.clone()
    gemm._post_scale_(plain, row, col)
    assert calls == [1] and same_bits(fused, plain)


def test_rowwise_as_tensorwise_through_the_kernel_is_torchaos(interpret):
    """The whole path under the interpreter (the tensorwise ``torch._scaled_mm`` on the CPU, then the
    kernel) against torchao's ``addmm_float8_unwrapped`` without fast accumulation: torchao's own where it
    is installed, else its steps written out (this environment may lack torchao)."""
    from mixprec.lowbit import gemm

    try:
        from torchao.float8.float8_ops import addmm_float8_unwrapped
    except ImportError:
        addmm_float8_unwrapped = None

    g = torch.Generator().manual_seed(11)
    m, k, n = 40, 64, 56
    a = (torch.randn(m, k, generator=g) * 8).to(torch.float8_e4m3fn)
    b = (torch.randn(k, n, generator=g) * 8).to(torch.float8_e4m3fn)
    sa, sb = torch.rand(m, 1, generator=g) + 0.1, torch.rand(1, n, generator=g) + 0.1
    one = torch.ones(())
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        if addmm_float8_unwrapped is not None:
            ref = addmm_float8_unwrapped(a, sa, b, sb, dtype, use_fast_accum=False)
        else:  # float8_ops.addmm_float8_unwrapped's steps for rowwise scales without fast accumulation
            ref = torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
            ref *= sa.reciprocal() * sb.reciprocal()
            ref = ref.to(dtype)
        got = gemm._rowwise_post_scaled(a, b, sa.reciprocal(), sb.reciprocal(), dtype)
        assert got.dtype == dtype and torch.equal(got, ref)


_POST_SCALE_SIGNATURE = {"out_ptr": "*i16", "row_ptr": "*fp32", "col_ptr": "*fp32"}


def test_the_gpu_kernel_compiles_with_torchs_rounding(monkeypatch):
    """For sm90: the float32-to-bfloat16 conversion is cvt.rn (nearest even, torch's CUDA cast), the
    multiplies are not fused into an fma nor flushed to zero."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from mixprec.lowbit import triton_quantize

    kernel = triton_quantize._kernels(False).post_scale
    signature = {**_POST_SCALE_SIGNATURE, "M": "i32", "N": "i32", "som": "i32", "son": "i32"}
    constexprs = {"BM": 32, "BN": 128, "PRECISE": True}
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    ptx = compile(
        ASTSource(fn=kernel, signature=signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32)
    ).asm["ptx"]
    assert "cvt.rn.bf16" in ptx  # cvt.rn.bf16.f32 or its two-lane form
    assert "mul.f32" in ptx or "mul.rn.f32" in ptx
    assert "fma" not in ptx and ".ftz" not in ptx


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the compiled kernel)")
@pytest.mark.parametrize("kind", ["randn", "ties", "specials"])
def test_on_a_gpu_every_bit_is_torchs(monkeypatch, kind):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("MIXPREC_FUSED_QUANTIZE", raising=False)
    from mixprec.lowbit import triton_quantize

    out, row, col = (t.cuda() for t in _case((300, 1000), kind))
    ref = out.clone()
    ref *= row * col
    got = triton_quantize.post_scale_(out.clone(), row, col)
    assert torch.equal(got.view(torch.int16), ref.view(torch.int16))  # the nan too: cvt.rn on both sides
