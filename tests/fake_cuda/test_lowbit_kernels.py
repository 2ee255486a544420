"""Every lowbit recipe's three GEMMs on fake CUDA tensors: which reach torch's scaled matmul, per capability.

Runs on a CUDA build of torch without a GPU: ``device="cuda"`` FakeTensors under ``FakeTensorMode``, with
``torch.cuda.get_device_capability`` patched to (8, 9), (9, 0), (10, 0) and (12, 0). Autograd's engine cannot
run backward on fake CUDA, so ``LowbitLinearFunction.forward`` / ``.backward`` are called directly. Each GEMM
runs twice: through ``torch.nn.functional.scaled_mm`` where torch has it (its meta kernel only infers the
shape) and through ``torch._scaled_mm``, whose meta kernel checks the scale shapes and dtypes as CUDA does;
the scale strides the meta kernel leaves unchecked are compared with ScaledBlas.cpp's rules here.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from mixprec.lowbit import RECIPES, gemm

pytestmark = pytest.mark.skipif(torch.version.cuda is None, reason="needs a CUDA build of torch (fake tier)")

CAPS = [(8, 9), (9, 0), (10, 0), (12, 0)]
BIG = (256, 512, 1024)  # M, K, N: every dimension above 128
SMALL = [(32, 64, 48), (20, 40, 24)]  # the second: N = 40 and K = 24 are no multiple of 16 or 32
GEMMS = ("fprop", "dgrad", "wgrad")
# The kernel each named recipe's GEMMs take at BIG, per capability (None: emulated; "mm": hp torch.mm).
_FP8 = {"fp8_tensorwise": "fp8_tensorwise", "fp8_rowwise": "fp8_rowwise"}
_BLOCK = {
    "fp8_blockwise": ((9, 0), ("fp8_blockwise_1x128_128x128",) * 2 + ("fp8_blockwise_1x128_1x128",)),
    "mxfp8": ((10, 0), ("mxfp8",) * 3),
    "mxfp8_floor": ((10, 0), ("mxfp8",) * 3),
    "mxfp4": ((10, 0), ("mxfp4",) * 3),
    "nvfp4": ((10, 0), ("nvfp4",) * 3),
}


def _expected(recipe: str, cap: tuple[int, int]) -> tuple[str | None, ...]:
    if recipe in _FP8:
        return (_FP8[recipe],) * 3
    if recipe == "fp8_rowwise_gw_hp":  # dgrad: rowwise go x tensorwise w, the tensorwise scale expanded
        return ("fp8_rowwise", "fp8_rowwise", "mm")
    only_on, paths = _BLOCK[recipe]
    return paths if cap == only_on else (None, None, None)


class _Recorder:
    """Wraps lowbit_mm and both scaled-matmul entry points; one record per lowbit GEMM."""

    def __init__(self) -> None:
        self.gemms: list[dict] = []
        self._mm = gemm.lowbit_mm
        self._v1 = torch._scaled_mm
        self._v2 = gemm._SCALED_MM_V2

    def lowbit_mm(self, a, b, out_dtype, options=None):
        path, reason = gemm.kernel_path(a, b)
        self.gemms.append({"path": path, "reason": reason, "calls": []})
        out = self._mm(a, b, out_dtype, options)
        assert out.shape == (a.shape[0], b.shape[0]) and out.dtype == out_dtype
        assert out.device == a.data.device
        return out

    def v1(self, mat_a, mat_b, *, scale_a, scale_b, out_dtype, use_fast_accum=False):
        self.gemms[-1]["calls"].append(("v1", mat_a, mat_b, scale_a, scale_b, out_dtype, use_fast_accum))
        accum = {"use_fast_accum": True} if use_fast_accum else {}
        return self._v1(mat_a, mat_b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype, **accum)

    def v2(self, mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b, **kwargs):
        call = ("v2", mat_a, mat_b, scale_a, scale_b, kwargs["output_dtype"], kwargs["use_fast_accum"])
        self.gemms[-1]["calls"].append(call)
        return self._v2(mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b, **kwargs)


@contextmanager
def _fake_cuda(cap: tuple[int, int], use_v2: bool):
    from torch._subclasses.fake_tensor import FakeTensorMode

    rec = _Recorder()
    v2 = rec.v2 if use_v2 and rec._v2 is not None else None
    with (
        FakeTensorMode(),
        mock.patch("torch.cuda.get_device_capability", return_value=cap),
        mock.patch.object(gemm, "lowbit_mm", rec.lowbit_mm),
        mock.patch.object(gemm, "_SCALED_MM_V2", v2),
        mock.patch.object(torch, "_scaled_mm", rec.v1),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore")  # the emulation's once-per-process warning is tested on the CPU
        yield rec


def _run_layer(recipe_name: str, m: int, k: int, n: int, gemms=None, dtype=torch.bfloat16) -> None:
    """LowbitLinearFunction's forward and backward, called directly on fake CUDA tensors (bf16 default)."""
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    w = torch.randn(n, k, device="cuda", dtype=dtype)
    saved: list[torch.Tensor] = []
    ctx = SimpleNamespace(needs_input_grad=(True, True, False, False))
    ctx.save_for_backward = lambda *tensors: saved.extend(tensors)
    out = gemm.LowbitLinearFunction.forward(ctx, x, w, RECIPES[recipe_name], None, gemms)
    ctx.saved_tensors = tuple(saved)
    grad_x, grad_w, *_ = gemm.LowbitLinearFunction.backward(ctx, torch.randn_like(out))
    assert out.shape == (m, n) and grad_x.shape == x.shape and grad_w.shape == w.shape
    assert {out.device.type, grad_x.device.type, grad_w.device.type} == {"cuda"}


def _check_blockwise_strides(call: tuple) -> None:
    """ScaledBlas.cpp is_blockwise_1x128_scaling / is_blockwise_128x128_scaling, on A and on B.T."""
    _, mat_a, mat_b, scale_a, scale_b, *_ = call
    for t, s in ((mat_a, scale_a), (mat_b.t(), scale_b.t())):
        rows, kb = t.shape[0], -(-t.shape[1] // 128)
        if s.shape == (rows, kb):  # 1x128: outer-dim-major
            assert kb == 1 or s.stride() == (1, rows), s.stride()
        else:  # 128x128: row-major
            assert s.shape == (-(-rows // 128), kb) and (kb == 1 or s.stride() == (kb, 1)), s.stride()


@pytest.mark.parametrize("use_v2", [True, False], ids=["scaled_mm", "_scaled_mm"])
@pytest.mark.parametrize("cap", CAPS, ids=lambda c: f"sm{c[0]}{c[1]}")
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_each_gemm_reaches_the_scaled_matmul_the_table_names(recipe, cap, use_v2) -> None:
    with _fake_cuda(cap, use_v2) as rec:
        _run_layer(recipe, *BIG)
    expected = _expected(recipe, cap) if recipe in {*_FP8, "fp8_rowwise_gw_hp", *_BLOCK} else None
    lowbit = [g for g in expected if g != "mm"] if expected else None
    if lowbit is not None:
        assert [g["path"] for g in rec.gemms] == lowbit, [g["reason"] for g in rec.gemms]
    for record in rec.gemms:
        assert len(record["calls"]) == (record["path"] is not None), record["reason"]
        for call in record["calls"]:
            if record["path"].startswith("fp8_blockwise"):
                assert call[0] == "v1"  # the layouts of torch._scaled_mm's blockwise path
                _check_blockwise_strides(call)
            if record["path"] in ("mxfp4",):
                assert call[0] == "v1"
        if record["path"] is None:
            assert f"sm{cap[0]}{cap[1]}" in record["reason"] or "multiple" in record["reason"]


@pytest.mark.parametrize("dims", SMALL, ids=lambda d: "x".join(map(str, d)))
@pytest.mark.parametrize("cap", [(9, 0), (10, 0)], ids=lambda c: f"sm{c[0]}{c[1]}")
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_small_and_odd_sizes_take_the_kernel_or_fall_back_with_the_size_as_reason(recipe, cap, dims) -> None:
    with _fake_cuda(cap, use_v2=False) as rec:  # torch._scaled_mm: the meta kernel checks the sizes
        _run_layer(recipe, *dims)
    for record in rec.gemms:
        assert len(record["calls"]) == (record["path"] is not None), record["reason"]
        if record["path"] is None and _expected_big_path(recipe, cap):
            assert "needs K a multiple" in record["reason"] or "padded K differ" in record["reason"]


def _expected_big_path(recipe: str, cap: tuple[int, int]) -> bool:
    """Whether the recipe's lowbit GEMMs take a kernel at BIG on ``cap`` (so a fallback is for size)."""
    return recipe in RECIPES and any(p not in (None, "mm") for p in _expected(recipe, cap))


def test_odd_sizes_fall_back_on_the_tensorwise_recipe() -> None:
    with _fake_cuda((9, 0), use_v2=False) as rec:
        _run_layer("fp8_tensorwise", 20, 40, 24)  # N = 24 (fprop), K = 24 (dgrad), N = 40 (wgrad)
    assert [g["path"] for g in rec.gemms] == [None, None, None]
    assert all("needs K a multiple of 16 and N of 16" in g["reason"] for g in rec.gemms)


FAST = (gemm.GemmOptions(use_fast_accum=True),) * 3


def test_rowwise_with_gw_hp_dgrad_pairs_an_expanded_tensorwise_scale() -> None:
    """The issue's crash: rowwise go (M, 1) x tensorwise w (1, 1) refused by _scaled_mm (the rowwise
    kernel, which the dgrad takes with fast accumulation)."""
    with _fake_cuda((9, 0), use_v2=False) as rec:
        _run_layer("fp8_rowwise_gw_hp", *BIG, gemms=FAST)
    dgrad = rec.gemms[1]
    assert dgrad["path"] == "fp8_rowwise"
    (_, mat_a, mat_b, scale_a, scale_b, _, fast) = dgrad["calls"][0]
    assert scale_a.shape == (mat_a.shape[0], 1) and scale_b.shape == (1, mat_b.shape[1]) and fast
    assert scale_a.is_contiguous() and scale_b.is_contiguous()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("use_v2", [True, False], ids=["scaled_mm", "_scaled_mm"])
@pytest.mark.parametrize("recipe", ["fp8_rowwise", "fp8_rowwise_gw_hp"])
def test_rowwise_without_fast_accum_runs_the_tensorwise_kernel_then_scales(recipe, use_v2, dtype) -> None:
    """torchao's addmm_float8_unwrapped: row x row without fast accumulation is the tensorwise kernel
    (torch._scaled_mm, as mixprec calls it for tensorwise) with unit 0-dim scales writing bf16, then the
    (M, 1) x (1, N) descales applied in place to that output; the result in the asked dtype."""
    post: list[tuple] = []
    real = gemm._post_scale_

    def recorded(out, descale_a, descale_b):
        post.append((out.shape, out.dtype, descale_a.shape, descale_b.shape, descale_a.dtype))
        return real(out, descale_a, descale_b)

    m, k, n = BIG
    with _fake_cuda((9, 0), use_v2) as rec, mock.patch.object(gemm, "_post_scale_", recorded):
        _run_layer(recipe, m, k, n, dtype=dtype)
    rows = [g for g in rec.gemms if g["path"] == "fp8_rowwise"]
    assert len(rows) == (3 if recipe == "fp8_rowwise" else 2) and len(post) == len(rows)
    shapes = [(m, n), (m, k), (n, k)]  # fprop, dgrad, wgrad outputs
    for record, out_shape, seen in zip(rows, shapes, post, strict=False):
        assert "addmm_float8_unwrapped" in record["reason"]
        ((api, mat_a, mat_b, scale_a, scale_b, out_dtype, fast),) = record["calls"]
        assert api == "v1" and not fast and out_dtype == torch.bfloat16
        assert scale_a.shape == () and scale_b.shape == () and scale_a.dtype == torch.float32
        assert (mat_a.shape[0], mat_b.shape[1]) == out_shape
        assert seen == (out_shape, torch.bfloat16, (out_shape[0], 1), (1, out_shape[1]), torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("use_v2", [True, False], ids=["scaled_mm", "_scaled_mm"])
def test_rowwise_with_fast_accum_keeps_the_rowwise_kernel(use_v2, dtype) -> None:
    """... asking it for bf16 whatever the layer's dtype (the kernel outside sm90's cuBLAS writes only
    bf16; torchao asks for bf16 and casts), the result in the layer's dtype (``_run_layer`` checks)."""
    m, k, n = BIG
    with _fake_cuda((9, 0), use_v2) as rec:
        _run_layer("fp8_rowwise", m, k, n, gemms=FAST, dtype=dtype)
    assert [g["path"] for g in rec.gemms] == ["fp8_rowwise"] * 3
    for record in rec.gemms:
        ((api, mat_a, mat_b, scale_a, scale_b, out_dtype, fast),) = record["calls"]
        assert api == ("v2" if use_v2 and rec._v2 is not None else "v1") and fast
        assert scale_a.shape == (mat_a.shape[0], 1) and scale_b.shape == (1, mat_b.shape[1])
        assert out_dtype == torch.bfloat16


def test_the_hadamard_matrix_is_built_on_the_device_without_a_host_copy() -> None:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Copies(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            tensors = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
            # a host tensor lifted into the graph, or any CPU operand of an op (a host-to-device copy)
            if func is torch.ops.aten.lift_fresh.default or any(t.device.type == "cpu" for t in tensors):
                self.seen.append(str(func))
            return out

    with _fake_cuda((10, 0), use_v2=True):
        t = torch.randn(40, 64, device="cuda")
        with Copies() as copies:
            h = gemm.hadamard_16(t.device)
            rotated = gemm._rotate_rows(t)
    assert copies.seen == [] and h.device.type == "cuda" and rotated.shape == (48, 64)
    # the fake call built its own matrix: nothing fake is left in the per-device cache
    assert not any(torch._subclasses.fake_tensor.is_fake(v) for v in gemm._HADAMARD.values())
