"""The fused fp8 quantization kernels (mixprec.lowbit.triton_quantize) against the pure-torch quantizers.

Run under Triton's CPU interpreter (``TRITON_INTERPRET=1``, set per test) on CPU tensors, in the CUDA
build's environment, which has Triton. Everything up to the fp8 cast (amax, scale, multiply, clamp,
the transposed copy, the padding) is compared bit for bit with ``cast=False``, and torch's cast of those
values must give the pure-torch quantizer's fp8 bits. The in-kernel cast is compared on its own: the
interpreter's float32-to-fp8 conversion (``triton.runtime.interpreter._convert_float``) rounds half up
without carrying into the exponent, so a value whose rounding carries into the next binade from an odd
exponent field comes out half as large (127.9 -> 64 in e4m3, not 128) and an exact tie rounds away from
zero; those values, and only those, may differ. On a GPU (the last test, skipped without one) the cast
is compared bit for bit everywhere.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import struct

import pytest
import torch

from fake_cuda.bits import same_bits
from mixprec.lowbit.formats import get_format
from mixprec.lowbit.quantize import Quantized, quantize

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),  # numpy's, in the interpreter: log2(0), inf * 0
]

FORMATS = [
    "fp8_tensorwise",
    "fp8_tensorwise_e5m2",
    "fp8_tensorwise_pow2",
    "fp8_rowwise",
    "fp8_rowwise_fp32",
    "fp8_rowwise_e5m2",
    "fp8_blockwise",
    "fp8_blockwise_2d",
]
SHAPES = [(64, 256), (70, 200), (1, 5), (130, 300)]


def _reference(x: torch.Tensor, fmt: str, monkeypatch: pytest.MonkeyPatch) -> Quantized:
    """The pure-torch quantizer (the switch set: under the interpreter a CPU tensor would be fused)."""
    with monkeypatch.context() as m:
        m.setenv("MIXPREC_FUSED_QUANTIZE", "0")
        return quantize(x, fmt, pad=True)


def _input(shape: tuple[int, int], kind: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.logspace(-3, 3, shape[1])  # columns of every magnitude
    if kind == "outliers":
        x[0, 0] = 3e4
        x.view(-1)[::7] *= 1e-4
    elif kind == "zeros":
        x.zero_()
        x[0, 0] = -0.0
    elif kind == "inf":
        x[shape[0] // 2, shape[1] // 3] = float("inf")
    elif kind == "nan":
        x[shape[0] - 1, shape[1] - 1] = float("nan")
    elif kind == "bf16":
        x = x.to(torch.bfloat16)
    return x


def _expand(scale: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    rows, cols = shape[0] // scale.shape[0], shape[1] // scale.shape[1]
    return scale.repeat_interleave(rows, 0).repeat_interleave(cols, 1)


def _pre_cast(ref: Quantized, x: torch.Tensor) -> torch.Tensor:
    """The pure-torch path's float32 values before its cast: the padded matrix times its scale, clamped."""
    m, k = ref.data.shape
    x2 = torch.nn.functional.pad(x.to(torch.float32), (0, k - x.shape[1], 0, m - x.shape[0]))
    lim = ref.fmt.elem.max
    return torch.clamp(x2 * _expand(ref.scale, ref.data.shape), min=-lim, max=lim)


def _check_before_cast(got: Quantized, ref: Quantized, x: torch.Tensor) -> None:
    assert got.data.dtype == torch.float32
    assert same_bits(got.scale, ref.scale), (got.scale, ref.scale)
    assert same_bits(got.data, _pre_cast(ref, x))
    assert same_bits(
        got.data.to(ref.data.dtype), ref.data
    )  # torch's cast of the kernel's values: the same bits
    assert (got.shape, got.dtype, got.axis) == (ref.shape, ref.dtype, ref.axis)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("kind", ["randn", "outliers", "zeros", "inf", "nan", "bf16"])
def test_everything_before_the_cast_is_bitwise(interpret, monkeypatch, fmt, shape, kind):
    x = _input(shape, kind)
    got, got_t = interpret.quantize(x, fmt, transpose=True, cast=False)
    _check_before_cast(got, _reference(x, fmt, monkeypatch), x)
    _check_before_cast(got_t, _reference(x.t(), fmt, monkeypatch), x.t())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(70, 200), (130, 300)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_without_the_transposed_copy_the_same_bits(interpret, monkeypatch, fmt, shape):
    x = _input(shape, "outliers", seed=8).to(torch.float16)
    got, none = interpret.quantize(x, fmt, cast=False)  # 1x128 blocks: a narrower tile than with the copy
    assert none is None
    _check_before_cast(got, _reference(x, fmt, monkeypatch), x)


@pytest.mark.parametrize("fmt", ["fp8_rowwise", "fp8_blockwise", "fp8_blockwise_2d", "fp8_tensorwise"])
def test_a_transposed_view_is_read_in_place_and_one_dim_is_one_row(interpret, monkeypatch, fmt):
    base = _input((200, 70), "randn", seed=1)
    view = base.t()  # (70, 200), column-major
    got, got_t = interpret.quantize(view, fmt, transpose=True, cast=False)
    _check_before_cast(got, _reference(view, fmt, monkeypatch), view)
    _check_before_cast(got_t, _reference(base, fmt, monkeypatch), base)
    row = _input((1, 300), "randn", seed=2)[0]
    got1, _ = interpret.quantize(row, fmt, cast=False)
    _check_before_cast(got1, _reference(row, fmt, monkeypatch), row.reshape(1, -1))


def _interpreter_cast_error(pre: torch.Tensor, got: torch.Tensor, ref: torch.Tensor, elem) -> torch.Tensor:
    """Where the interpreter's cast ``got`` may differ from torch's ``ref`` for float32 ``pre``: a carry
    into the next binade (``ref`` a power of two above ``|pre|``, ``got`` half of it), an exact tie
    between two neighbours on the grid rounded away from zero (``got`` the larger, ``ref`` the even one),
    or a subnormal of the format truncated (``got`` the neighbour toward zero, ``ref`` the other)."""
    g, r, p = got.float().abs(), ref.float().abs(), pre.abs()
    mant = torch.frexp(r).mantissa
    carry = (mant == 0.5) & (p < r) & (g * 2 == r)
    ulp = torch.exp2(torch.clamp(torch.floor(torch.log2(p)), min=1 - elem.bias) - elem.mantissa_bits)
    low = torch.floor(p / ulp) * ulp
    tie = (p - low == ulp / 2) & (g == low + ulp) & (r == low)
    truncated = (p < 2.0 ** (1 - elem.bias)) & (g == low) & (r == low + ulp)
    return carry | tie | truncated


@pytest.mark.parametrize("fmt", ["fp8_tensorwise", "fp8_tensorwise_e5m2", "fp8_rowwise", "fp8_blockwise_2d"])
def test_the_in_kernel_cast_differs_only_where_the_interpreter_is_wrong(interpret, monkeypatch, fmt):
    elem = get_format(fmt).elem
    x = torch.cat([_input((64, 256), "randn", seed=3), _input((64, 256), "outliers", seed=4)])
    x[0, :] = torch.linspace(-elem.max, elem.max, 256)  # values near every binade edge of the format
    x[1, :] = elem.max * torch.exp2(-torch.arange(256) / 8.0)  # down into the subnormals
    ref = _reference(x, fmt, monkeypatch)
    got, got_t = interpret.quantize(x, fmt, transpose=True)
    pre, pre_t = interpret.quantize(x, fmt, transpose=True, cast=False)
    for g, p, r in ((got, pre, ref), (got_t, pre_t, _reference(x.t(), fmt, monkeypatch))):
        assert same_bits(g.scale, r.scale)
        differs = g.data.view(torch.uint8) != r.data.view(torch.uint8)
        explained = _interpreter_cast_error(p.data, g.data, r.data, elem)
        assert not (differs & ~explained).any(), p.data[differs & ~explained][:8]
        assert differs.float().mean() < 0.25  # most values, the subnormals many of the rest


def test_scaled_cast_is_history_to_float8(interpret):
    from mixprec.lowbit.history import to_float8

    x = _input((70, 200), "outliers", seed=5)
    for fmt in ("fp8_tensorwise", "fp8_tensorwise_e5m2"):
        elem = get_format(fmt).elem
        scale = torch.tensor(elem.max / 3e4, dtype=torch.float32)
        pre, pre_t = interpret.scaled_cast(x, scale, fmt, transpose=True, cast=False)
        assert same_bits(pre.to(elem.dtype), to_float8(x, scale, elem))
        assert same_bits(pre_t, pre.t().contiguous())
        data, data_t = interpret.scaled_cast(x, scale, fmt, transpose=True)
        assert data.dtype == elem.dtype and same_bits(data_t, data.t().contiguous())


def test_the_dispatch_of_quantize_takes_the_kernels_and_the_switch_turns_them_off(interpret, monkeypatch):
    calls = []
    fused = interpret.quantize

    def spy(*args, **kwargs):
        calls.append(args[1])
        return fused(*args, **kwargs)

    monkeypatch.setattr(interpret, "quantize", spy)
    x = _input((64, 256), "randn", seed=6)
    quantize(x, "fp8_rowwise")  # a CPU tensor is eligible under the interpreter
    quantize(x, "mxfp8_floor")  # not a fused format
    quantize(x, "fp8_rowwise", stochastic=True)  # stochastic rounding: pure torch
    assert [get_format(f).name for f in calls] == ["fp8_rowwise"]
    monkeypatch.setenv("MIXPREC_FUSED_QUANTIZE", "0")
    assert not interpret.fused_eligible(x, "fp8_rowwise")
    quantize(x, "fp8_rowwise")
    assert len(calls) == 1
    with pytest.raises(ValueError, match="multiple of its 1x128 block"):  # no pad: refused, as before
        monkeypatch.setenv("MIXPREC_FUSED_QUANTIZE", "1")
        quantize(x[:, :200], "fp8_blockwise")


def test_unsupported_input_is_refused_by_name(interpret):
    with pytest.raises(ValueError, match="no fused kernel for mxfp8"):
        interpret.quantize(torch.ones(4, 32), "mxfp8_floor")
    with pytest.raises(ValueError, match="1-D or 2-D"):
        interpret.quantize(torch.ones(2, 2, 2), "fp8_rowwise")
    assert not interpret.format_supported("fp8_tensorwise_fnuz")
    assert all(interpret.format_supported(f) for f in FORMATS)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the compiled kernels)")
@pytest.mark.parametrize("fmt", FORMATS)
def test_on_a_gpu_every_bit_is_the_pure_torch_quantizers(monkeypatch, fmt):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from mixprec.lowbit import triton_quantize

    for shape in SHAPES:
        for kind in ("randn", "outliers", "zeros", "inf", "nan", "bf16"):
            x = _input(shape, kind).cuda()
            got, got_t = triton_quantize.quantize(x, fmt, transpose=True)
            refs = _reference(x, fmt, monkeypatch), _reference(x.t(), fmt, monkeypatch)
            for g, r in zip((got, got_t), refs, strict=True):
                assert same_bits(g.scale, r.scale) and same_bits(g.data, r.data), (fmt, shape, kind)


_SIGNATURES = {
    "block": "x_ptr M K sxm sxk out_ptr out_t_ptr scale_ptr scale_t_ptr OUT_ROWS OUT_T_ROWS KP MP",
    "cast": "x_ptr M K sxm sxk row_ptr col_ptr scale_in_ptr out_ptr out_t_ptr scale_ptr scale_t_ptr "
    "amax_out_ptr scale_out_ptr descale_ptr",
    "amax": "x_ptr M K sxm sxk row_ptr col_ptr",
    "delayed_scale": "amax_ptr hist_ptr L scale_ptr amax_out_ptr scale_out_ptr descale_ptr",
}
_TYPES = {
    "x_ptr": "*bf16",
    "row_ptr": "*i32",
    "col_ptr": "*i32",
    "out_ptr": "*F8",
    "out_t_ptr": "*F8",
    "amax_ptr": "*i32",
}


def _ptx(kernel, name: str, f8: str, **constexprs) -> str:
    """The sm90 PTX of one kernel (Triton compiles without a GPU)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    args = _SIGNATURES[name].split()
    signature = {a: _TYPES.get(a, "*fp32" if a.endswith("_ptr") else "i32").replace("F8", f8) for a in args}
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    return compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]


def test_the_gpu_kernels_compile_with_torchs_rounding(monkeypatch):
    """For sm90: the scale as one correctly rounded float32 division (div.rn.f32, F32_DIV) or divided in
    float64 with div.rn and rounded once (cvt.rn.f32.f64), libdevice's log2f (not lg2.approx), no
    approximate float32 division, and the saturating nearest-even fp8 cast."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from mixprec.lowbit import triton_quantize

    k = triton_quantize._kernels(False)
    common = {"ELEM_MAX": 448.0, "POW2": True, "CAST": True, "F8": k.DTYPES["e4m3"], "PRECISE": True}
    approximate = ("lg2.approx", "div.full.f32", "div.approx.f32")
    for f32_div, needed, absent in (
        (True, ["div.rn.f32"], "div.rn.f64"),
        (False, ["div.rn.f64", "cvt.rn.f32.f64"], "div.rn.f32"),
    ):
        block = {"BM": 128, "BK": 128, "TWO_D": False, "TRANSPOSE": True, "F32_DIV": f32_div}
        ptx = _ptx(k.block, "block", "fp8e4nv", **block, **common)
        for wanted in (*needed, "cvt.rn.satfinite.e4m3x2.f32"):
            assert wanted in ptx, (f32_div, wanted)
        assert absent not in ptx, f32_div
        assert not any(op in ptx for op in approximate), f32_div
    # with F32_DIV, EPS's quotient is folded at compile time: float32(448 / 1e-12), rounded once
    at_eps = f"0f{struct.unpack('<I', struct.pack('<f', 448.0 / 1e-12))[0]:08X}"
    assert at_eps in _ptx(
        k.block, "block", "fp8e4nv", BM=128, BK=128, TWO_D=False, TRANSPOSE=True, F32_DIV=True, **common
    )
    e5m2 = {**common, "ELEM_MAX": 57344.0, "POW2": False, "F8": k.DTYPES["e5m2"], "F32_DIV": True}
    ptx = _ptx(
        k.cast, "cast", "fp8e5", BM=64, BK=64, MODE=2, TRANSPOSE=True, STATS=False, DESCALE=False, **e5m2
    )
    assert "div.rn.f32" in ptx and "cvt.rn.satfinite.e5m2x2.f32" in ptx and "div.full.f32" not in ptx
    assert "atom.global" in _ptx(k.amax, "amax", "fp8e4nv", BM=64, BK=64, ROWWISE=True, COLS=True)
    # the dynamic tensorwise cast (MODE 0) that records amax and scale into a layer's stats
    ptx = _ptx(
        k.cast,
        "cast",
        "fp8e4nv",
        BM=64,
        BK=64,
        MODE=0,
        TRANSPOSE=True,
        STATS=True,
        DESCALE=True,
        F32_DIV=True,
        **common,
    )
    assert "div.rn.f32" in ptx and "cvt.rn.satfinite.e4m3x2.f32" in ptx
    assert not any(op in ptx for op in approximate)
    # the delayed scale: the margin's division and the amax's both correctly rounded, libdevice's log2f
    delayed = {"ELEM_MAX": 448.0, "POW2": True, "PRECISE": True, "F32_DIV": True, "ALGO_MAX": True}
    ptx = _ptx(
        k.delayed_scale,
        "delayed_scale",
        "",
        MARGIN_DIV=4.0,
        UPDATE=True,
        GROWTH=256.0,
        STATS=True,
        HBLOCK=16,
        **delayed,
    )
    assert "div.rn.f32" in ptx and not any(op in ptx for op in approximate)


TENSORWISE = ["fp8_tensorwise", "fp8_tensorwise_e5m2", "fp8_tensorwise_pow2"]


@pytest.mark.parametrize("fmt", TENSORWISE)
@pytest.mark.parametrize("kind", ["randn", "outliers", "zeros", "inf", "nan", "bf16"])
def test_dynamic_cast_is_tensor_scaling_then_to_float8(interpret, monkeypatch, fmt, kind):
    """The amax kernel and the cast kernel that computes the scale and records it: the scale, the stats
    slots, the amax and everything before the cast bit for bit TensorScaling's scale and to_float8."""
    from mixprec.lowbit.history import TensorScaling, amax_of, to_float8

    f = get_format(fmt)
    for view in (_input((70, 200), kind, seed=11), _input((130, 300), kind, seed=12).t()):
        ref_stats, stats = torch.full((2, 3), 7.0), torch.full((2, 3), 7.0)
        with monkeypatch.context() as m:
            m.setenv("MIXPREC_FUSED_QUANTIZE", "0")
            ref_scale = TensorScaling().scale(2, view, f.elem, f.scale == "pow2", None, ref_stats, True)
            ref = to_float8(view, ref_scale, f.elem)
            ref_amax = amax_of(view)
        pre, pre_t, scale, descale, amax = interpret.dynamic_cast(
            view, fmt, transpose=True, cast=False, amax_out=stats[0, 2], scale_out=stats[1, 2]
        )
        assert same_bits(scale, ref_scale) and same_bits(amax, ref_amax), (scale, ref_scale, amax)
        assert same_bits(descale, ref_scale.reciprocal()), (descale, ref_scale)  # the GEMMs' descale
        assert same_bits(stats, ref_stats), (stats, ref_stats)  # only the role's column written
        assert same_bits(pre.to(f.elem.dtype), ref)
        assert same_bits(pre_t, pre.t().contiguous())
        data, none, *_ = interpret.dynamic_cast(view, fmt)  # no stats, no transposed copy, fp8
        assert none is None and data.dtype == f.elem.dtype and data.shape == view.shape


def _history(kind: str, length: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(length)
    if kind == "empty":  # the first step: no amax yet
        return torch.zeros(3, length)
    h = torch.rand(3, length, generator=g) * 50
    if kind == "small":  # far below the amax: the push is bounded by AMAX_GROWTH_LIMIT x the past max
        h = h * 1e-6
    return h


@pytest.mark.parametrize("fmt", TENSORWISE)
@pytest.mark.parametrize("kind", ["randn", "outliers", "zeros", "inf", "nan", "bf16"])
def test_delayed_cast_is_tensor_scaling_then_to_float8(interpret, monkeypatch, fmt, kind):
    """The amax kernel, the one-program delayed scale with the history push, and the given-scale cast:
    scale, stats, amax, the pushed history and everything before the cast bit for bit TensorScaling's
    delayed scale (with push_amax) and to_float8, for each algo, margin, history length and state."""
    from mixprec.lowbit.history import TensorScaling, to_float8

    f = get_format(fmt)
    x = _input((70, 200), kind, seed=13)
    cases = [
        ("max", 0, 16, "empty", True),
        ("max", 0, 20, "full", True),
        ("max", 3, 1, "full", True),
        ("most_recent", 0, 16, "full", True),
        ("most_recent", 1, 7, "small", True),
        ("max", 0, 16, "small", True),
        ("max", 2, 16, "full", False),
    ]
    for algo, margin, length, state, update in cases:
        scaling = TensorScaling(delayed=True, margin=margin, amax_compute_algo=algo)
        ref_hist, hist = _history(state, length), _history(state, length)
        ref_stats, stats = torch.full((2, 3), 7.0), torch.full((2, 3), 7.0)
        with monkeypatch.context() as m:
            m.setenv("MIXPREC_FUSED_QUANTIZE", "0")
            ref_scale = scaling.scale(1, x, f.elem, f.scale == "pow2", ref_hist, ref_stats, update)
            ref = to_float8(x, ref_scale, f.elem)
        pre, pre_t, scale, descale, _ = interpret.delayed_cast(
            x, fmt, hist[1], amax_compute_algo=algo, margin=margin, update=update, transpose=True,
            cast=False, amax_out=stats[0, 1], scale_out=stats[1, 1],
        )  # fmt: skip
        case = (algo, margin, length, state, update)
        assert same_bits(scale, ref_scale), (case, scale, ref_scale)
        assert same_bits(descale, ref_scale.reciprocal()), (case, descale, ref_scale)
        assert same_bits(stats, ref_stats), (case, stats, ref_stats)
        assert same_bits(hist, ref_hist), (case, hist[1], ref_hist[1])  # only the role's row, pushed
        assert same_bits(pre.to(f.elem.dtype), ref), case
        assert same_bits(pre_t, pre.t().contiguous()), case


def test_delayed_cast_refuses_by_name_and_writes_nothing(interpret):
    x, hist = torch.randn(8, 16), torch.ones(3, 4)
    with pytest.raises(ValueError, match="contiguous float32 1-D tensor on cpu, got torch.bfloat16"):
        interpret.delayed_cast(x, "fp8_tensorwise", hist[0].bfloat16())
    with pytest.raises(ValueError, match="got torch.float32 \\(3,\\)"):
        interpret.delayed_cast(x, "fp8_tensorwise", hist[:, 0])  # a column: not contiguous
    with pytest.raises(ValueError, match="amax_compute_algo must be 'max' or 'most_recent', got 'mean'"):
        interpret.delayed_cast(x, "fp8_tensorwise", hist[0], amax_compute_algo="mean")
    with pytest.raises(ValueError, match="margin must be an int from 0 to 64, got 65"):
        interpret.delayed_cast(x, "fp8_tensorwise", hist[0], margin=65)
    with pytest.raises(ValueError, match="fused tensorwise format, got \\(8, 16\\), fp8_blockwise"):
        interpret.delayed_cast(x, "fp8_blockwise", hist[0])
    assert torch.equal(hist, torch.ones(3, 4))


def test_dynamic_cast_refuses_by_name_and_writes_nothing(interpret):
    x, stats = torch.randn(8, 16), torch.full((2, 3), 7.0)
    with pytest.raises(ValueError, match="fused tensorwise format, got \\(8, 16\\), fp8_rowwise"):
        interpret.dynamic_cast(x, "fp8_rowwise", amax_out=stats[0, 0], scale_out=stats[1, 0])
    with pytest.raises(ValueError, match="got \\(2, 4, 16\\)"):
        interpret.dynamic_cast(x.reshape(2, 4, 16), "fp8_tensorwise")
    with pytest.raises(ValueError, match="got \\(0, 16\\)"):
        interpret.dynamic_cast(x[:0], "fp8_tensorwise")
    with pytest.raises(ValueError, match="together, got one"):
        interpret.dynamic_cast(x, "fp8_tensorwise", amax_out=stats[0, 0])
    with pytest.raises(
        ValueError, match="scale_out must be a float32 one-element tensor on cpu, got torch.bfloat16"
    ):
        interpret.dynamic_cast(x, "fp8_tensorwise", amax_out=stats[0, 0], scale_out=stats[1, :1].bfloat16())
    with pytest.raises(ValueError, match="amax_out must be a float32 one-element .* shape \\(3,\\)"):
        interpret.dynamic_cast(x, "fp8_tensorwise", amax_out=stats[0], scale_out=stats[1, 0])
    assert torch.equal(stats, torch.full((2, 3), 7.0))


@pytest.mark.parametrize("kind", ["randn", "outliers", "zeros", "inf", "nan", "bf16"])
def test_tensor_amax_is_amax_of(interpret, kind):
    from mixprec.lowbit.history import amax_of

    x = _input((130, 300), kind, seed=7)
    for view in (x, x.t(), x[3]):  # 2-D, a transposed view, 1-D
        got = interpret.tensor_amax(view)
        assert got.shape == () and got.dtype == torch.float32
        assert same_bits(got, amax_of(view)), (got, amax_of(view))


def _layer_step(recipe, seed: int = 9):
    """One forward and backward of a low-bit linear layer: (out, grad_x, grad_w)."""
    import warnings

    from mixprec.lowbit.gemm import LowbitLinearFunction

    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(2, 70, 256, generator=g) * 4).requires_grad_()
    w = (torch.randn(96, 256, generator=g) / 16).requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the CPU's emulation warning
        out = LowbitLinearFunction.apply(x, w, recipe)
        out.backward(torch.randn(2, 70, 96, generator=g))
    return out.detach(), x.grad, w.grad


@pytest.mark.parametrize("recipe", ["fp8_tensorwise", "fp8_rowwise", "fp8_blockwise"])
def test_a_layer_reads_each_operand_once_and_gets_the_per_use_bits(interpret, monkeypatch, recipe):
    """The layer's step through the kernels' cast-transpose (one launch set per operand, transpose=True),
    with torch's cast of the kernels' values (the interpreter's cast aside, as above), is bit for bit the
    pure-torch per-use quantization's step."""
    from mixprec.lowbit import RECIPES, gemm

    calls = []
    fused = interpret.quantize

    def kernels_with_torchs_cast(x, fmt, *, transpose=False, cast=True):
        calls.append((tuple(x.shape), transpose))
        pair = fused(x, fmt, transpose=transpose, cast=False)
        return tuple(q and dataclasses.replace(q, data=q.data.to(q.fmt.elem.dtype)) for q in pair)

    monkeypatch.setattr(interpret, "quantize", kernels_with_torchs_cast)
    got = _layer_step(RECIPES[recipe])
    assert calls == [((140, 256), True), ((96, 256), True), ((140, 96), True)]  # x, w, grad_output
    with monkeypatch.context() as m:
        m.setenv("MIXPREC_FUSED_QUANTIZE", "0")
        m.setattr(gemm, "SHARE_CASTS", False)
        ref = _layer_step(RECIPES[recipe])
    assert len(calls) == 3
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a, b)


def _dynamic_recipes():
    from mixprec.lowbit import RECIPES, Recipe
    from mixprec.lowbit.history import TensorScaling

    pow2 = dict.fromkeys(
        ("fprop_x", "fprop_w", "dgrad_go", "dgrad_w", "wgrad_go", "wgrad_x"), "fp8_tensorwise_pow2"
    )
    return {
        "dynamic": RECIPES["fp8_tensorwise"].with_(scaling=TensorScaling()),
        "dynamic_e5m2_grads": RECIPES["fp8_tensorwise"].with_(
            scaling=TensorScaling(), dgrad_go="fp8_tensorwise_e5m2", wgrad_go="fp8_tensorwise_e5m2"
        ),
        "dynamic_pow2": Recipe(**pow2, scaling=TensorScaling()),
    }


def _per_tensor_step(recipe, dtype=torch.float32, device="cpu", seed: int = 9):
    """One forward and backward of a per-tensor-scaled layer: (out, grad_x, grad_w, stats)."""
    import warnings

    from mixprec.lowbit.gemm import LowbitLinearFunction

    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(2, 70, 256, generator=g) * 4).to(device, dtype).requires_grad_()
    w = (torch.randn(96, 256, generator=g) / 16).to(device).requires_grad_()
    stats = torch.zeros(2, 3, device=device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the CPU's emulation warning
        out = LowbitLinearFunction.apply(x, w, recipe, None, None, None, stats)
        out.backward(torch.randn(2, 70, 96, generator=g).to(device, dtype))
    return out.detach(), x.grad, w.grad, stats


def test_delayed_layer_steps_with_the_fused_scale_are_the_torch_steps(interpret, monkeypatch):
    """Three steps of a delayed-scaling layer (the history filling up, a margin, pow2 scales) through
    delayed_cast, with torch's cast of its values: outputs, gradients, stats and histories bit for bit."""
    import warnings

    from mixprec.lowbit import Recipe
    from mixprec.lowbit.gemm import LowbitLinearFunction
    from mixprec.lowbit.history import TensorScaling

    fused = interpret.delayed_cast
    calls = []

    def kernels_with_torchs_cast(x, fmt, history, **kwargs):
        calls.append(tuple(x.shape))
        kwargs.pop("cast", None)
        got = fused(x, fmt, history, cast=False, **kwargs)
        dtype = get_format(fmt).elem.dtype
        return got._replace(data=got.data.to(dtype), data_t=got.data_t.to(dtype))

    operands = ("fprop_x", "fprop_w", "dgrad_go", "dgrad_w", "wgrad_go", "wgrad_x")
    recipe = Recipe(**dict.fromkeys(operands, "fp8_tensorwise_pow2"), scaling=TensorScaling(True, 1, "max"))

    def steps():
        g = torch.Generator().manual_seed(21)
        w = (torch.randn(96, 256, generator=g) / 16).requires_grad_()
        history, stats, seen = torch.zeros(3, 6), torch.zeros(2, 3), []
        for step in range(3):
            x = (torch.randn(2, 70, 256, generator=g) * 4 * (step + 1)).requires_grad_()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out = LowbitLinearFunction.apply(x, w, recipe, None, None, history, stats, True)
                out.backward(torch.randn(2, 70, 96, generator=g))
            seen += [out.detach(), x.grad, stats.clone(), history.clone()]
        return [*seen, w.grad]

    monkeypatch.setattr(interpret, "delayed_cast", kernels_with_torchs_cast)
    got = steps()
    assert len(calls) == 9  # input, weight, grad_output per step
    monkeypatch.setenv("MIXPREC_FUSED_QUANTIZE", "0")
    ref = steps()
    assert len(calls) == 9 and (ref[-2][:, :3] > 0).all()  # three amaxes pushed per role
    for a, b in zip(got, ref, strict=True):
        assert same_bits(a, b)


@pytest.mark.parametrize("name", ["dynamic", "dynamic_e5m2_grads", "dynamic_pow2"])
def test_a_dynamic_per_tensor_layer_step_with_the_in_kernel_scale_is_the_torch_step(
    interpret, monkeypatch, name
):
    """Input, weight and grad_output each through dynamic_cast (with torch's cast of its values, the
    interpreter's cast aside): the layer's output, gradients and stats bit for bit the torch path's."""
    recipe = _dynamic_recipes()[name]
    calls = []
    fused = interpret.dynamic_cast

    def kernels_with_torchs_cast(x, fmt, *, transpose=False, cast=True, amax_out=None, scale_out=None):
        calls.append((tuple(x.shape), transpose, amax_out is not None))
        got = fused(x, fmt, transpose=transpose, cast=False, amax_out=amax_out, scale_out=scale_out)
        dtype = get_format(fmt).elem.dtype
        return got._replace(data=got.data.to(dtype), data_t=got.data_t.to(dtype))

    monkeypatch.setattr(interpret, "dynamic_cast", kernels_with_torchs_cast)
    got = _per_tensor_step(recipe)
    assert calls == [((140, 256), True, True), ((96, 256), True, True), ((140, 96), True, True)]
    monkeypatch.setenv("MIXPREC_FUSED_QUANTIZE", "0")
    ref = _per_tensor_step(recipe)
    assert len(calls) == 3
    for a, b in zip(got, ref, strict=True):
        assert same_bits(a, b)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the compiled kernels)")
@pytest.mark.parametrize("fmt", TENSORWISE)
def test_on_a_gpu_delayed_cast_is_tensor_scaling_then_to_float8(monkeypatch, fmt):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from mixprec.lowbit import triton_quantize
    from mixprec.lowbit.history import TensorScaling, to_float8

    f = get_format(fmt)
    for kind in ("randn", "outliers", "zeros", "inf", "nan", "bf16"):
        x = _input((300, 500), kind, seed=14).cuda()
        for algo, margin, state in (("max", 0, "empty"), ("max", 2, "full"), ("most_recent", 1, "small")):
            scaling = TensorScaling(delayed=True, margin=margin, amax_compute_algo=algo)
            ref_hist, hist = _history(state, 16).cuda(), _history(state, 16).cuda()
            ref_stats, stats = torch.zeros(2, 3, device="cuda"), torch.zeros(2, 3, device="cuda")
            monkeypatch.setenv("MIXPREC_FUSED_QUANTIZE", "0")
            ref_scale = scaling.scale(0, x, f.elem, f.scale == "pow2", ref_hist, ref_stats, True)
            ref = to_float8(x, ref_scale, f.elem)
            monkeypatch.delenv("MIXPREC_FUSED_QUANTIZE")
            data, data_t, scale, descale, _ = triton_quantize.delayed_cast(
                x, fmt, hist[0], amax_compute_algo=algo, margin=margin, transpose=True,
                amax_out=stats[0, 0], scale_out=stats[1, 0],
            )  # fmt: skip
            case = (fmt, kind, algo, margin, state)
            assert same_bits(scale, ref_scale) and same_bits(stats, ref_stats), case
            assert same_bits(descale, ref_scale.reciprocal()), case
            assert same_bits(hist, ref_hist) and same_bits(data, ref), case
            assert same_bits(data_t, data.t().contiguous()), case


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the compiled kernels)")
@pytest.mark.parametrize("name", ["dynamic", "dynamic_e5m2_grads", "dynamic_pow2"])
def test_on_a_gpu_a_dynamic_per_tensor_step_is_the_torch_step(monkeypatch, name):
    # bf16 activations only: each input dtype is one more Triton compile in gpu.sh's 40 s tests step
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    recipe = _dynamic_recipes()[name]
    got = _per_tensor_step(recipe, torch.bfloat16, "cuda")
    monkeypatch.setenv("MIXPREC_FUSED_QUANTIZE", "0")
    for a, b in zip(got, _per_tensor_step(recipe, torch.bfloat16, "cuda"), strict=True):
        assert same_bits(a, b)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the compiled kernels)")
@pytest.mark.parametrize("recipe", ["fp8_tensorwise", "fp8_rowwise", "fp8_blockwise", "per_tensor"])
def test_on_a_gpu_a_layer_step_with_the_cast_transpose_is_the_per_use_step(monkeypatch, recipe):
    import warnings

    from mixprec.lowbit import RECIPES, Recipe, gemm
    from mixprec.lowbit.gemm import LowbitLinearFunction

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    r = Recipe.parse("fp8_tensorwise scaling=dynamic") if recipe == "per_tensor" else RECIPES[recipe]

    def step():
        g = torch.Generator().manual_seed(4)
        x = (torch.randn(2, 300, 512, generator=g) * 4).cuda().to(torch.bfloat16).requires_grad_()
        w = (torch.randn(384, 512, generator=g) / 16).cuda().requires_grad_()
        stats = torch.zeros(2, 3, device="cuda")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = LowbitLinearFunction.apply(x, w, r, None, None, None, stats)
            out.backward(torch.randn(2, 300, 384, generator=g).cuda().to(torch.bfloat16))
        return out.detach(), x.grad, w.grad

    got = step()
    monkeypatch.setenv("MIXPREC_FUSED_QUANTIZE", "0")
    monkeypatch.setattr(gemm, "SHARE_CASTS", False)
    for a, b in zip(got, step(), strict=True):
        assert torch.equal(a, b)


def test_kernel_writes_count_as_in_place_changes(interpret):
    """Stats, a pushed history and a post-scaled output change through pointers; their version counters
    move as the torch ops' (``copy_``, ``*=``) would move them, and a history not pushed stays put."""
    x, stats, hist = torch.randn(64, 96), torch.zeros(2, 3), torch.ones(3, 8)
    versions = stats._version, hist._version
    interpret.dynamic_cast(x, "fp8_tensorwise", amax_out=stats[0, 0], scale_out=stats[1, 0])
    assert stats._version > versions[0]
    versions = stats._version, hist._version
    interpret.delayed_cast(
        x, "fp8_tensorwise", hist[0], update=False, amax_out=stats[0, 1], scale_out=stats[1, 1]
    )
    assert stats._version > versions[0] and hist._version == versions[1]
    interpret.delayed_cast(x, "fp8_tensorwise", hist[0], update=True)
    assert hist._version > versions[1]
    out = torch.randn(32, 128).bfloat16()
    version = out._version
    interpret.post_scale_(out, torch.rand(32) + 0.5, torch.rand(128) + 0.5)
    assert out._version > version
