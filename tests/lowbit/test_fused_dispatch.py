"""The dispatch to the fused fp8 quantization kernels (mixprec.lowbit.triton_quantize) on the CPU suite.

A CPU tensor, torch.compile and a torch without Triton (this suite's) take the pure-torch quantizers; the
hook hands an eligible tensor to the fused module and builds the result from what it returns. The kernels
themselves are tested under Triton's interpreter in tests/fake_cuda/test_triton_quantize.py.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from mixprec.lowbit import gemm, history, triton_quantize
from mixprec.lowbit.formats import get_format
from mixprec.lowbit.quantize import Quantized, quantize


def test_a_cpu_tensor_takes_pure_torch_without_importing_triton(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = torch.randn(64, 256)
    assert not triton_quantize.fused_eligible(x, "fp8_rowwise")
    q = quantize(x, "fp8_rowwise")
    assert q.data.dtype == torch.float8_e4m3fn
    assert "mixprec.lowbit._triton_kernels" not in sys.modules  # never loaded for a CPU tensor
    assert triton_quantize.triton_available() == (importlib.util.find_spec("triton") is not None)


def test_without_triton_nothing_is_eligible(monkeypatch):
    monkeypatch.setattr(triton_quantize, "triton_available", lambda: False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # even where a CPU tensor would be
    assert not triton_quantize.fused_eligible(torch.randn(4, 4), "fp8_tensorwise")


def test_eligibility_follows_the_switch_the_format_and_the_tensor(monkeypatch):
    monkeypatch.setattr(triton_quantize, "triton_available", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x = torch.randn(8, 128)
    assert triton_quantize.fused_eligible(x, "fp8_blockwise")
    assert not triton_quantize.fused_eligible(x, "mxfp8_floor")  # e8m0 scales: no kernel
    assert not triton_quantize.fused_eligible(x, "fp8_tensorwise_fnuz")  # fnuz elements: no kernel
    assert not triton_quantize.fused_eligible(x.reshape(2, 4, 128), "fp8_blockwise")  # 3-D
    assert not triton_quantize.fused_eligible(x[:0], "fp8_blockwise")  # empty
    monkeypatch.setenv(triton_quantize.ENV_SWITCH, "0")
    assert not triton_quantize.fused_eligible(x, "fp8_blockwise")


def test_the_hook_hands_an_eligible_tensor_to_the_fused_module(monkeypatch):
    x = torch.randn(64, 256)
    ref = quantize(x.t(), "fp8_rowwise", pad=True)  # pure torch (no interpreter set)
    calls = []

    def fused(x2, fmt, transpose=False, cast=True):
        calls.append((tuple(x2.shape), x2.stride(), get_format(fmt).name))
        return Quantized(ref.data, ref.scale, None, get_format(fmt), x2.shape, x2.dtype, 1), None

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(triton_quantize, "fused_eligible", lambda x, fmt: True)
    monkeypatch.setattr(triton_quantize, "quantize", fused)
    q = quantize(x, "fp8_rowwise", axis=0)
    assert calls == [((256, 64), (1, 256), "fp8_rowwise")]  # the transposed view, not a copy
    assert q.data is ref.data and q.scale is ref.scale
    assert (q.shape, q.axis, q.dtype) == (x.shape, 0, x.dtype)
    quantize(x, "fp8_rowwise", stochastic=True)  # stochastic rounding stays pure torch
    with pytest.raises(ValueError, match="multiple of its 1x128 block"):  # without pad still refused
        quantize(x[:, :200], "fp8_blockwise")
    assert len(calls) == 1


def test_compiled_quantize_stays_pure_torch(monkeypatch):
    x = torch.randn(16, 128)
    expected = quantize(x, "fp8_blockwise").data
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(triton_quantize, "fused_eligible", lambda x, fmt: True)
    monkeypatch.setattr(triton_quantize, "quantize", lambda *a, **k: pytest.fail("fused under compile"))
    compiled = torch.compile(lambda t: quantize(t, "fp8_blockwise").data, backend="eager", fullgraph=True)
    assert torch.equal(compiled(x).view(torch.uint8), expected.view(torch.uint8))


def test_the_tensorwise_cast_on_a_cpu_is_history_to_float8():
    x = torch.randn(32, 48) * 100
    scale = torch.tensor(2.5)
    fmt = get_format("fp8_tensorwise_e5m2")
    out, out_t = gemm._to_float8(x, scale, fmt, transpose=True)
    assert torch.equal(out.view(torch.uint8), history.to_float8(x, scale, fmt.elem).view(torch.uint8))
    assert torch.equal(out_t.view(torch.uint8), history.to_float8(x.t(), scale, fmt.elem).view(torch.uint8))


def test_the_amax_of_a_cpu_tensor_is_torchs(monkeypatch):
    monkeypatch.setattr(triton_quantize, "tensor_amax", lambda x: pytest.fail("fused amax on a CPU"))
    x = torch.randn(8, 16)
    x[2, 3] = -50.0
    assert history.amax_of(x).item() == 50.0


class _Launches:
    """Stand-in for the kernels module: records each launch (name, constexprs) and computes nothing."""

    def __init__(self) -> None:
        self.DTYPES = {"e4m3": None, "e5m2": None}
        self.launched: list[tuple[str, dict]] = []

    def __getattr__(self, name: str):
        recorder = self

        class _Kernel:
            def __getitem__(self, grid):
                return lambda *args, **constexprs: recorder.launched.append((name, constexprs))

        return _Kernel()


# aten ops that make a view or an uninitialized tensor: no kernel runs for them on a GPU.
_NO_LAUNCH = {
    "aten.select.int",
    "aten.empty.memory_format",
    "aten.view.dtype",
    "aten.view.default",
    "aten.detach.default",
}


def _glue_ops(fn) -> list[str]:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with Ops() as mode:
        fn()
    return mode.ops


@pytest.mark.parametrize("fmt", ["fp8_tensorwise", "fp8_tensorwise_pow2"])
def test_a_dynamic_tensorwise_operand_takes_two_launches_and_one_fill(monkeypatch, fmt):
    """The dynamic per-tensor layer's cast of one operand: the amax kernel, then the cast kernel that
    computes the scale and stores it and the amax into the layer's stats (STATS), and one zero-fill of
    the amax's accumulator. The path it replaces launched ten: the fill, the amax kernel, the 7 torch ops
    of the scale and its stats (counted below), the cast."""
    from mixprec.lowbit.history import TensorScaling

    launches = _Launches()
    monkeypatch.setattr(triton_quantize, "triton_available", lambda: True)
    monkeypatch.setattr(triton_quantize, "_kernels", lambda interpret: launches)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # a CPU tensor is launchable
    x, stats, out = torch.randn(64, 96), torch.zeros(2, 3), []
    scaling = TensorScaling()
    ops = _glue_ops(
        lambda: out.extend(gemm._scale_cast(1, x, fmt, scaling, None, stats, True, transpose=True))
    )
    assert [name for name, _ in launches.launched] == ["amax", "cast"]
    cast = launches.launched[1][1]
    pow2 = fmt.endswith("pow2")
    assert (cast["MODE"], cast["STATS"], cast["DESCALE"], cast["TRANSPOSE"], cast["POW2"]) == (
        0,
        True,
        True,
        True,
        pow2,
    )
    assert [op for op in ops if op not in _NO_LAUNCH] == ["aten.zeros.default"]
    q, _, q_t = out  # both GEMMs of the operand take the kernel's descale: no reciprocal launched per GEMM
    assert q.descale is not None and q_t.descale is not None
    assert _glue_ops(q.block_descale) == [] and q.block_descale() is q.descale


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_a_delayed_operand_takes_three_launches_and_one_fill(monkeypatch, algo):
    """Delayed scaling: the amax kernel, one program that computes the scale from the history, records
    amax and scale and pushes the history, and the cast with that scale (28 torch ops between the amax and
    the cast kernels before, counted below)."""
    from mixprec.lowbit.history import TensorScaling

    launches = _Launches()
    monkeypatch.setattr(triton_quantize, "triton_available", lambda: True)
    monkeypatch.setattr(triton_quantize, "_kernels", lambda interpret: launches)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x, stats, history_ = torch.randn(64, 96), torch.zeros(2, 3), torch.ones(3, 20)
    scaling = TensorScaling(delayed=True, margin=2, amax_compute_algo=algo)
    ops = _glue_ops(lambda: gemm._scale_cast(1, x, "fp8_tensorwise", scaling, history_, stats, False))
    assert [name for name, _ in launches.launched] == ["amax", "delayed_scale", "cast"]
    scale = launches.launched[1][1]
    assert (scale["MARGIN_DIV"], scale["ALGO_MAX"], scale["UPDATE"], scale["STATS"]) == (
        4.0,
        algo == "max",
        False,
        True,
    )
    assert scale["HBLOCK"] == 32 and launches.launched[2][1]["MODE"] == 1  # the next power of two >= 20
    assert [op for op in ops if op not in _NO_LAUNCH] == ["aten.zeros.default"]


def test_a_margin_a_converted_stats_buffer_or_history_keep_their_own_paths(monkeypatch):
    from mixprec.lowbit.history import TensorScaling

    launches = _Launches()
    monkeypatch.setattr(triton_quantize, "triton_available", lambda: True)
    monkeypatch.setattr(triton_quantize, "_kernels", lambda interpret: launches)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x = torch.randn(64, 96)
    gemm._scale_cast(0, x, "fp8_tensorwise", TensorScaling(margin=1), None, torch.zeros(2, 3), True)
    history16 = torch.ones(3, 4, dtype=torch.bfloat16)  # model.to(bfloat16) converts the buffer
    gemm._scale_cast(0, x, "fp8_tensorwise", TensorScaling(delayed=True), history16, torch.zeros(2, 3), True)
    far = TensorScaling(delayed=True, margin=triton_quantize.MAX_MARGIN + 1)
    gemm._scale_cast(0, x, "fp8_tensorwise", far, torch.ones(3, 4), torch.zeros(2, 3), True)
    assert [n for n, _ in launches.launched] == ["cast"] * 3  # torch's scale, then a given-scale cast
    assert [c["MODE"] for _, c in launches.launched] == [1, 1, 1]
    launches.launched.clear()
    stats16 = torch.zeros(2, 3, dtype=torch.bfloat16)
    gemm._scale_cast(2, x, "fp8_tensorwise", TensorScaling(), None, stats16, True)
    assert [(n, c.get("STATS")) for n, c in launches.launched] == [("amax", None), ("cast", False)]


@pytest.mark.parametrize("pow2", [False, True])
def test_the_torch_ops_the_fused_scale_replaces(monkeypatch, pow2):
    """What the layer launched between the amax and the cast kernels before the scale moved on the
    device: 7 ops dynamic (the float64 scale, two stats stores), 28 delayed (with the history push),
    3 more each for pow2 (the figures the docs and the CHANGELOG quote)."""
    from mixprec.lowbit.history import TensorScaling

    amax = torch.tensor(3.0)
    monkeypatch.setattr(history, "amax_of", lambda x: amax)
    x, stats, hist = torch.randn(8, 16), torch.zeros(2, 3), torch.ones(3, 16)
    elem = get_format("fp8_tensorwise").elem
    dynamic = _glue_ops(lambda: TensorScaling().scale(0, x, elem, pow2, None, stats, True))
    delayed = _glue_ops(lambda: TensorScaling(delayed=True).scale(0, x, elem, pow2, hist, stats, True))
    views = _NO_LAUNCH | {"aten.slice.Tensor", "aten.alias.default"}
    extra = 3 if pow2 else 0
    assert len([op for op in dynamic if op not in views]) == 7 + extra, dynamic
    assert len([op for op in delayed if op not in views]) == 28 + extra, delayed


def test_the_kernels_constants_are_the_torch_paths():
    """Constants the fused module repeats (it cannot import the modules that dispatch to it)."""
    from mixprec.lowbit.history import AMAX_GROWTH_LIMIT, EPS

    assert triton_quantize._GROWTH == AMAX_GROWTH_LIMIT and triton_quantize._EPS == EPS
