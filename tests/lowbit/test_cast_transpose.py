"""Each operand of a low-bit linear layer quantized once for both its GEMMs (the cast-transpose).

``quantize_pair`` against ``quantize`` along each axis, bitwise, for every format; the layer's outputs and
gradients with shared casts (``gemm.SHARE_CASTS``, the default) against the per-use quantization it
replaces (``SHARE_CASTS = False``), bitwise, for every named recipe and a few mixed ones; what backward
keeps (fp8 in place of the input); and the number of operand quantizations per layer per step, counted.
The fused CUDA kernels' transposed copy is the pure-torch quantization along the other axis by
tests/fake_cuda/test_triton_quantize.py, whose oracle is ``quantize`` here too.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from mixprec.formats import FP8_E4M3FN as E4M3
from mixprec.lowbit import RECIPES, Recipe, gemm
from mixprec.lowbit.formats import FORMATS
from mixprec.lowbit.gemm import LowbitLinearFunction, shared_operands
from mixprec.lowbit.history import TensorScaling, to_float8
from mixprec.lowbit.quantize import quantize, quantize_pair


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t.contiguous()


def _same_quantized(a, b) -> None:
    assert torch.equal(_bits(a.data), _bits(b.data))
    assert torch.equal(_bits(a.scale), _bits(b.scale))
    assert (a.tensor_scale is None) == (b.tensor_scale is None)
    if a.tensor_scale is not None:
        assert torch.equal(a.tensor_scale, b.tensor_scale)
    assert (a.fmt, tuple(a.shape), a.dtype, a.axis) == (b.fmt, tuple(b.shape), b.dtype, b.axis)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("shape", [(256, 128), (100, 200)])
def test_quantize_pair_is_quantize_along_each_axis(fmt, shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(3)) * 7
    x[5, 7] = 300.0  # an outlier in one row and one column
    q, q_t = quantize_pair(x, fmt)
    _same_quantized(q, quantize(x, fmt, pad=True))
    _same_quantized(q_t, quantize(x.t(), fmt, pad=True))


def test_quantize_pair_refuses_what_is_not_a_matrix():
    with pytest.raises(ValueError, match=r"2-D \(M, K\).*\(2, 3, 4\)"):
        quantize_pair(torch.randn(2, 3, 4), "fp8_rowwise")
    with pytest.raises(TypeError, match="floating"):
        quantize_pair(torch.ones(4, 4, dtype=torch.int32), "fp8_rowwise")


MIXED = {
    "go_sr_only": Recipe("fp8_rowwise", "fp8_rowwise", "fp8_rowwise", "fp8_rowwise", "fp8_rowwise",
                         "fp8_rowwise", sr=True),
    "w_two_formats": Recipe("fp8_rowwise", "fp8_blockwise_2d", "fp8_rowwise", "fp8_tensorwise", "mxfp8_rceil",
                            "fp8_rowwise"),
    "x_hp_grad": Recipe("fp8_blockwise", "fp8_blockwise_2d", "fp8_blockwise", "fp8_blockwise_2d", "hp", "hp"),
}  # fmt: skip
CASES = {**RECIPES, **MIXED}


def _step(recipe, share, monkeypatch, grads=(True, True), dtype=torch.float32, shape=(3, 40, 96)):
    """One forward and backward of the layer: (out, grad_x, grad_w, saved bytes, operand quantizations)."""
    monkeypatch.setattr(gemm, "SHARE_CASTS", share)
    gen = torch.Generator().manual_seed(11)
    x = (torch.randn(*shape, generator=gen) * 3).to(dtype).requires_grad_(grads[0])
    w = (torch.randn(64, shape[-1], generator=gen) / 8).requires_grad_(grads[1])
    go = torch.randn(*shape[:-1], 64, generator=gen).to(dtype)
    counted = {"n": 0}
    for name in ("_quantize_operand", "_quantize_both"):
        real = getattr(gemm, name)

        def counting(*args, _real=real, **kwargs):
            counted["n"] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(gemm, name, counting)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the CPU's emulation warning
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = LowbitLinearFunction.apply(x, w, recipe, torch.Generator().manual_seed(5))
        out.backward(go)
    # The layer's own saved tensors, not the parameter (alive anyway): what the step adds to memory.
    extra = sum(t.numel() * t.element_size() for t in saved if t is not w)
    return out.detach(), x.grad, w.grad, extra, counted["n"]


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("grads", [(True, True), (True, False), (False, True)])
def test_shared_casts_give_the_per_use_bits(name, grads, monkeypatch):
    recipe = CASES[name]
    new = _step(recipe, True, monkeypatch, grads)
    old = _step(recipe, False, monkeypatch, grads)
    for a, b in zip(new[:3], old[:3], strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a, b), name


def test_bf16_with_a_float32_master_weight_is_the_same_bits(monkeypatch):
    for name in ("fp8_rowwise", "fp8_blockwise", "mxfp8"):
        new = _step(RECIPES[name], True, monkeypatch, dtype=torch.bfloat16)
        old = _step(RECIPES[name], False, monkeypatch, dtype=torch.bfloat16)
        for a, b in zip(new[:3], old[:3], strict=True):
            assert torch.equal(a, b), name


# Operand quantizations (each one read of a high-precision tensor) per layer per training step, per use
# before and shared after: x, w and grad_output once each where the recipe gives one format to both uses.
PASSES = {
    "fp8_tensorwise": (6, 3),
    "fp8_rowwise": (6, 3),
    "fp8_rowwise_gw_hp": (4, 4),  # x and grad_output meet wgrad in hp, w has two formats
    "fp8_blockwise": (6, 3),
    "mxfp8": (6, 3),
    "mxfp8_floor": (6, 3),
    "mxfp4": (6, 3),
    "nvfp4": (6, 5),  # only w: rht rotates x and grad_output for wgrad, sr rounds grad_output
}


def _qbytes(q) -> int:
    return sum(t.numel() * t.element_size() for t in (q.data, q.scale, q.tensor_scale) if t is not None)


@pytest.mark.parametrize("name", list(PASSES))
def test_operand_quantizations_per_step_and_the_memory_backward_keeps(name, monkeypatch):
    recipe, shape = RECIPES[name], (2, 128, 128)  # 256 tokens: no block is padded
    *_, old_bytes, old_passes = _step(recipe, False, monkeypatch, shape=shape)
    *_, new_bytes, new_passes = _step(recipe, True, monkeypatch, shape=shape)
    assert (old_passes, new_passes) == PASSES[name]
    share_x, share_w, _ = shared_operands(recipe)
    x_bytes = 256 * 128 * 4  # the float32 input the per-use path keeps
    x_t = quantize(torch.randn(128, 256), recipe.wgrad_x, pad=True) if share_x else None
    w_t = quantize(torch.randn(128, 64), recipe.dgrad_w, pad=True) if share_w else None
    # Backward keeps the fp8 (or fp4) transposed input in place of the input, and the weight's
    # transposed copy beside the parameter (alive anyway).
    expected = old_bytes - (x_bytes - _qbytes(x_t) if x_t else 0) + (_qbytes(w_t) if w_t else 0)
    assert new_bytes == expected
    if x_t:
        assert _qbytes(x_t) <= x_bytes // 4 + x_bytes // 64  # 1 byte a value (fp4: half) and the scales


@pytest.mark.parametrize("name", ["fp8_rowwise", "fp8_rowwise_gw_hp", "nvfp4", "mxfp8"])
@pytest.mark.parametrize("share", [True, False])
def test_a_gradient_not_asked_for_keeps_nothing_for_it(name, share, monkeypatch):
    """A frozen weight's layer keeps no input (only wgrad reads it), an input without grad keeps no
    weight copy (only dgrad reads it): what backward keeps is the bytes the other gradient needs."""
    shape = (2, 128, 128)
    frozen = _step(RECIPES[name], share, monkeypatch, grads=(True, False), shape=shape)
    first = _step(RECIPES[name], share, monkeypatch, grads=(False, True), shape=shape)
    assert frozen[2] is None and first[1] is None  # the gradient not asked for
    assert frozen[1] is not None and first[2] is not None
    # frozen weight: nothing but dgrad's weight copy (or nothing, when the parameter itself is read)
    recipe = RECIPES[name]
    w_copy = (
        _qbytes(quantize(torch.randn(128, 64), recipe.dgrad_w, pad=True))
        if share and shared_operands(recipe)[1]
        else 0
    )
    assert frozen[3] == w_copy
    # no input gradient: the input (hp or its quantized transposed copy), never a weight copy
    x_bytes = 256 * 128 * 4
    x_t = (
        quantize(torch.randn(128, 256), recipe.wgrad_x, pad=True)
        if share and shared_operands(recipe)[0]
        else None
    )
    assert first[3] == (_qbytes(x_t) if x_t is not None else x_bytes)


def test_shared_operands_follow_the_recipe(monkeypatch):
    assert shared_operands(RECIPES["fp8_rowwise"]) == (True, True, True)
    assert shared_operands(RECIPES["nvfp4"]) == (False, True, False)
    assert shared_operands(RECIPES["fp8_rowwise_gw_hp"]) == (False, False, False)
    assert shared_operands(MIXED["go_sr_only"]) == (True, True, False)
    monkeypatch.setattr(gemm, "SHARE_CASTS", False)
    assert shared_operands(RECIPES["fp8_rowwise"]) == (False, False, False)


@pytest.mark.parametrize("delayed", [False, True])
def test_per_tensor_scaling_keeps_the_transposed_fp8_copies(delayed):
    """A per-tensor layer saves x.T and w.T cast once (one amax, one scale), the bits of each cast."""
    tw, e5 = "fp8_tensorwise", "fp8_tensorwise_e5m2"
    recipe = Recipe(tw, tw, e5, tw, e5, tw, scaling=TensorScaling(delayed=delayed))
    x = torch.randn(2, 24, 32, requires_grad=True)
    w = torch.randn(16, 32, requires_grad=True)
    history = torch.zeros(3, 4) + 5.0 if delayed else None
    stats = torch.zeros(2, 3)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = LowbitLinearFunction.apply(x, w, recipe, None, None, history, stats, True)
    x8_t, x_scale, w8_t, w_scale = saved
    assert x8_t.shape == (32, 48) and x8_t.dtype == torch.float8_e4m3fn
    assert w8_t.shape == (32, 16) and w8_t.dtype == torch.float8_e4m3fn
    assert torch.equal(_bits(x8_t), _bits(to_float8(x.detach().reshape(-1, 32), x_scale, E4M3).t()))
    assert torch.equal(_bits(w8_t), _bits(to_float8(w.detach(), w_scale, E4M3).t()))
    out.sum().backward()
    assert x.grad is not None and w.grad is not None
