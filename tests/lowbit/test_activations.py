"""`mixprec.lowbit.save_activations`: saved tensors in fp8 / mxfp8 while they wait for backward.

The oracle is torch's own backward without the hooks (same run), and, for a linear layer, the weight
gradient computed by hand from ``quantize(x).dequantize()``: the backward must use exactly that tensor.
"""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

import mixprec
from mixprec.lowbit import quantize, save_activations
from mixprec.lowbit.activations import MIN_NUMEL

FMTS = ["fp8", "mxfp8"]
LOWBIT = {"fp8": "fp8_rowwise_fp32", "mxfp8": "mxfp8_rceil"}


def _block(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)


def _grads(model: torch.nn.Module, x: torch.Tensor, ctx=None, fn=None) -> torch.Tensor:
    model.zero_grad()
    call = fn or model
    if ctx is None:
        out = call(x)
    else:
        with ctx:
            out = call(x)
    _loss(out).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def _loss(out: torch.Tensor) -> torch.Tensor:
    # A fixed random projection: the mean square of a LayerNorm's output is ~1 whatever the weights.
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    return (out * probe).sum()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def block_case() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    model = _block()
    x = torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(1))
    return model, x, _grads(model, x)


@pytest.mark.parametrize("fmt", FMTS)
def test_transformer_block_gradients_close_to_unhooked(block_case, fmt: str) -> None:
    model, x, reference = block_case
    saved = save_activations(fmt)
    grads = _grads(model, x, saved)
    assert saved.quantized >= 8  # the block's activations went through the format
    assert 0 < _rel(grads, reference) < 0.05  # measured 0.025 (fp8), 0.030 (mxfp8)


@pytest.mark.parametrize("fmt", FMTS)
def test_backward_uses_exactly_the_dequantized_tensor(fmt: str) -> None:
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(2), requires_grad=True)
    w = torch.randn(32, 96, generator=torch.Generator().manual_seed(3), requires_grad=True)
    h = x * 1.5  # an intermediate, as a layer's input is
    with save_activations(fmt, min_numel=1):
        out = torch.nn.functional.linear(h, w)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    expected = grad_out.T @ quantize(h.detach(), LOWBIT[fmt], pad=True).dequantize()
    torch.testing.assert_close(w.grad, expected, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, 1.5 * (grad_out @ w.detach()), rtol=0, atol=0)  # the weight is kept


class _Probe(torch.autograd.Function):
    """Saves its inputs and records what backward gets back."""

    seen: ClassVar[list[torch.Tensor]] = []

    @staticmethod
    def forward(ctx, *tensors):
        ctx.save_for_backward(*tensors)
        return torch.zeros(())

    @staticmethod
    def backward(ctx, grad):
        _Probe.seen = list(ctx.saved_tensors)
        return tuple(None for _ in ctx.saved_tensors)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dtype_shape_and_strides_restored(fmt: str, dtype: torch.dtype) -> None:
    base = torch.randn(8, 40, 24, dtype=dtype, requires_grad=True) * 3
    tensors = [base, base.transpose(1, 2), base[:, ::2]]  # contiguous, transposed, strided views
    with save_activations(fmt) as saved:
        _Probe.apply(*tensors).backward()
    assert saved.quantized == 3
    for t, back in zip(tensors, _Probe.seen, strict=True):
        assert (back.dtype, back.shape, back.stride()) == (t.dtype, t.shape, t.stride())
        assert not torch.equal(back, t)  # it went through fp8
        expected = quantize(t.detach(), LOWBIT[fmt], pad=True).dequantize(dtype)
        torch.testing.assert_close(back, expected, rtol=0, atol=0)


def test_ints_bools_small_tensors_and_parameters_untouched() -> None:
    weight = torch.nn.Parameter(torch.randn(64, 64))
    leaf = torch.randn(64, 64, requires_grad=True)
    buffer = torch.randn(64, 64)
    module = torch.nn.Module()
    module.register_buffer("table", buffer)
    tensors = [
        torch.arange(2048),
        torch.ones(2048, dtype=torch.bool),
        torch.randn(MIN_NUMEL - 1).requires_grad_() * 2,
        weight,
        weight.T,
        leaf,
        buffer[:32],
        torch.randn(64, 64, dtype=torch.float64) * 2,
    ]
    with save_activations("fp8", module=module) as saved:
        _Probe.apply(*tensors).backward()
    assert saved.quantized == 0 and saved.kept == len(tensors)
    assert saved.kept_bytes == sum(t.numel() * t.element_size() for t in tensors)
    assert all(back is t or torch.equal(back, t) for back, t in zip(_Probe.seen, tensors, strict=True))
    assert _Probe.seen[0].dtype == torch.int64 and _Probe.seen[1].dtype == torch.bool
    with save_activations("fp8") as saved:  # without module=, the buffer's slice is quantized
        _Probe.apply(leaf * 1, buffer[:32]).backward()
    assert saved.quantized == 2


@pytest.mark.parametrize("fmt", FMTS)
def test_bytes_held_are_smaller(block_case, fmt: str) -> None:
    model, x, _ = block_case
    with save_activations(fmt) as saved:
        out = model(x)
    out.sum().backward()
    assert saved.original_bytes > 100_000
    assert saved.packed_bytes < 0.35 * saved.original_bytes  # 1 byte + scales per fp32 value


@pytest.mark.parametrize("fmt", FMTS)
def test_packed_bytes_count_the_pack_hooks_outputs(fmt: str) -> None:
    h = torch.randn(16, 100, requires_grad=True) * 2  # 100 is not a multiple of mxfp8's 32-block
    with save_activations(fmt) as saved:
        _Probe.apply(h).backward()
    q = quantize(h.detach(), LOWBIT[fmt], pad=True)
    assert saved.original_bytes == 6400
    assert saved.packed_bytes == q.data.numel() + q.scale.numel() * q.scale.element_size()
    assert saved.packed_bytes == (1600 + 64 if fmt == "fp8" else 16 * 128 + 16 * 4)
    assert saved.kept_bytes == 0


def test_nested_innermost_applies_and_active_instance_refused() -> None:
    leaf = torch.randn(16, 64, requires_grad=True)
    outer = save_activations("fp8", min_numel=1)
    with outer:
        with save_activations("mxfp8", min_numel=1) as inner:
            _Probe.apply(leaf * 2).backward()
        with pytest.raises(ValueError, match="already active"):
            outer.__enter__()
        _Probe.apply(leaf * 2).backward()
    assert (inner.quantized, outer.quantized) == (1, 1)
    with outer:  # re-entered after exit: counters keep adding up
        _Probe.apply(leaf * 2).backward()
    assert outer.quantized == 2
    h = leaf * 2
    _Probe.apply(h).backward()
    assert _Probe.seen[0] is h  # no hooks after exit


def test_checkpoint_around_and_inside(block_case) -> None:
    model, x, reference = block_case
    saved = save_activations("fp8")
    leaf = x.clone().requires_grad_()  # a leaf that requires grad is kept
    grads = _grads(model, leaf, saved, fn=lambda inp: mixprec.checkpoint(model, inp))
    assert saved.quantized == 0  # the checkpointed block keeps only its input and recomputes in fp32
    torch.testing.assert_close(grads, reference, rtol=1e-5, atol=1e-7)
    saved = save_activations("fp8")
    grads = _grads(model, x, saved, fn=lambda inp: mixprec.checkpoint(model, inp * 1))
    assert saved.quantized == 1  # an intermediate input: checkpoint keeps it in fp8, recomputes from that
    assert 0 < _rel(grads, reference) < 0.1
    hooked = _grads(model, x, save_activations("fp8"))
    inner = save_activations("fp8")

    def body(inp: torch.Tensor) -> torch.Tensor:
        with inner:
            return model(inp)

    grads = _grads(model, x, fn=lambda inp: torch.utils.checkpoint.checkpoint(body, inp, use_reentrant=False))
    assert inner.quantized > 0
    torch.testing.assert_close(grads, hooked, rtol=0, atol=0)  # inside, the hooks replace recomputation


def test_two_blocks_one_checkpointed_one_quantized() -> None:
    first, second = _block(0), _block(1)
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(4))

    def both(inp: torch.Tensor) -> torch.Tensor:
        return second(mixprec.checkpoint(first, inp))

    params = [*first.parameters(), *second.parameters()]
    ref = torch.autograd.grad(_loss(both(x)), params)
    with save_activations("mxfp8") as saved:
        loss = _loss(both(x))
    grads = torch.autograd.grad(loss, params)
    assert saved.quantized > 0
    n = len(list(first.parameters()))
    flat = lambda gs: torch.cat([g.flatten() for g in gs])  # noqa: E731
    assert 0 < _rel(flat(grads[n:]), flat(ref[n:])) < 0.1
    assert 0 < _rel(flat(grads[:n]), flat(ref[:n])) < 0.1  # the second block's error flows back


def test_torch_compile_saved_tensors_go_through_the_hooks() -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))
    x = torch.randn(32, 64)
    eager = _grads(mlp, x, save_activations("fp8"))
    reference = _grads(mlp, x)
    compiled = torch.compile(mlp, backend="aot_eager")
    saved = save_activations("fp8")
    grads = _grads(mlp, x, saved, fn=compiled)
    assert saved.quantized > 0
    assert 0 < _rel(grads, reference) < 0.1
    torch.testing.assert_close(grads, eager, rtol=1e-4, atol=1e-6)
    torch._dynamo.reset()


def test_non_finite_activation_gives_non_finite_gradients() -> None:
    h = torch.randn(4, 64, requires_grad=True) * 1
    h2 = h * 1
    w = torch.randn(8, 64, requires_grad=True)
    with torch.no_grad():
        h2[0, 0] = float("inf")
    with save_activations("fp8", min_numel=1):
        out = torch.nn.functional.linear(h2, w)
    out.sum().backward()
    assert not torch.isfinite(w.grad).all()


@pytest.mark.parametrize("bad", ["fp4", "e4m3", "FP8", None, 8])
def test_unknown_format_refused(bad: object) -> None:
    with pytest.raises(ValueError, match=r"one of \['fp8', 'mxfp8'\], got"):
        save_activations(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "10"])
def test_bad_min_numel_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="min_numel must be an int >= 1"):
        save_activations("fp8", min_numel=bad)  # type: ignore[arg-type]


def test_bad_module_refused() -> None:
    with pytest.raises(TypeError, match="module must be an nn.Module"):
        save_activations("fp8", module=[torch.nn.Linear(2, 2)])  # type: ignore[arg-type]
