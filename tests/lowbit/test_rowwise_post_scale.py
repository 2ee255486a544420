"""A rowwise fp8 GEMM without fast accumulation, run as torchao runs it: bitwise torchao's, on the CPU.

On CUDA, ``gemm._scaled`` sends a rowwise x rowwise fp8 GEMM without fast accumulation to
``_rowwise_post_scaled``: the tensorwise kernel with unit scales writing bf16, then ``out *= scale_a *
scale_b`` (torchao's ``float8_ops.addmm_float8_unwrapped``). This CPU has torch's tensorwise
``torch._scaled_mm`` (oneDNN), so the same path runs here when forced (the internal function called
directly, or ``gemm._post_scaled`` patched to take CPU operands: tests only; a CPU GEMM is emulated
otherwise), and must give torchao's bits: the post-scale here is torch's expression (no Triton on this
CPU; the Triton kernel is checked in ``tests/fake_cuda/test_triton_post_scale.py``).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from mixprec.lowbit import gemm
from mixprec.lowbit.kernels import KERNELS
from mixprec.lowbit.quantize import quantize

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # torchao warns about its optional C extensions
    float8_ops = pytest.importorskip("torchao.float8.float8_ops")

# (M, K, N): multiples of 16, M and N not (K must be for a kernel on CUDA; the CPU's takes any), one row.
SHAPES = [(32, 64, 48), (20, 48, 24), (33, 64, 7), (1, 16, 1), (130, 256, 90)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# torchao's rowwise recipes round scales to powers of two (an exact post-scale but at the range's ends);
# fp32 scales make the product and the multiply round, so the order of the roundings shows.
FORMATS = ["fp8_rowwise", "fp8_rowwise_fp32"]
ROWWISE = next(k for k in KERNELS if k.name == "fp8_rowwise")


def _operands(m: int, k: int, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 2, m)[:, None]  # rows of many magnitudes
    w = torch.randn(n, k, generator=g) * torch.logspace(1, -1, n)[:, None]
    return x, w


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("fmt", FORMATS)
def test_rowwise_post_scaled_is_torchaos_addmm_float8_unwrapped(fmt, shape, dtype) -> None:
    m, k, n = shape
    x, w = _operands(m, k, n)
    qa, qb = quantize(x, fmt), quantize(w, fmt)
    # torchao: data (M, K) @ (K, N) with multiplier scales (M, 1) and (1, N), use_fast_accum False
    ref = float8_ops.addmm_float8_unwrapped(qa.data, qa.scale, qb.data.t(), qb.scale.t(), dtype)
    got = gemm._rowwise_post_scaled(qa.data, qb.data.t(), qa.block_descale(), qb.block_descale().t(), dtype)
    assert got.dtype == dtype and got.shape == (m, n)
    assert torch.equal(got, ref)
    # the bf16 rounding of torchao's workaround is there for fp16 / fp32 too
    assert torch.equal(got, got.to(torch.bfloat16).to(dtype))


@pytest.fixture
def post_scaled_on_cpu(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """``gemm._post_scaled`` without its device test (``_post_scale_rule``); records its answers."""
    seen: list[bool] = []

    def on_any_device(kernel, a, b, fast_accum):
        seen.append(gemm._post_scale_rule(kernel, a, b, fast_accum))
        return seen[-1]

    monkeypatch.setattr(gemm, "_post_scaled", on_any_device)
    return seen


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("fmts", [(f, f) for f in FORMATS] + [("fp8_rowwise", "fp8_tensorwise")], ids=str)
def test_scaled_row_by_row_without_fast_accum_is_torchaos(post_scaled_on_cpu, fmts, shape, dtype) -> None:
    """Through ``gemm._scaled``, the one call site: the scale layouts (a tensorwise B promoted to rowwise,
    its one scale repeated on every row, as fp8_rowwise_gw_hp's dgrad pairs them) and the trimming."""
    m, k, n = shape
    x, w = _operands(m, k, n, seed=1)
    qa, qb = quantize(x, fmts[0], pad=True), quantize(w, fmts[1], pad=True)
    got = gemm._scaled(ROWWISE, qa, qb, dtype)
    assert post_scaled_on_cpu == [True]
    b_scale = qb.scale.t().expand(1, n).contiguous()  # (1, N) however B was scaled
    ref = float8_ops.addmm_float8_unwrapped(qa.data, qa.scale, qb.data.t(), b_scale, dtype)
    assert got.dtype == dtype and torch.equal(got, ref)


def test_the_rule_and_the_device() -> None:
    """The path: row x row fp8 without fast accumulation, on CUDA only (a CPU pair is emulated)."""
    x, w = _operands(32, 64, 48)
    qa, qb = quantize(x, "fp8_rowwise"), quantize(w, "fp8_rowwise")
    assert gemm._post_scale_rule(ROWWISE, qa, qb, False) and not gemm._post_scale_rule(ROWWISE, qa, qb, True)
    tensorwise = next(k for k in KERNELS if k.name == "fp8_tensorwise")
    qt = quantize(x, "fp8_tensorwise")
    assert not gemm._post_scale_rule(tensorwise, qt, qt, False)
    assert not gemm._post_scaled(ROWWISE, qa, qb, False)  # a CPU tensor


def test_kernel_path_says_how_rowwise_runs_without_fast_accum() -> None:
    x, w = _operands(256, 512, 1024)
    qa, qb = quantize(x, "fp8_rowwise"), quantize(w, "fp8_rowwise")
    path, reason = gemm.kernel_path(qa, qb, capability=(9, 0))
    assert path == "fp8_rowwise" and "addmm_float8_unwrapped" in reason and "unit scales" in reason
    path, reason = gemm.kernel_path(quantize(x, "fp8_tensorwise"), quantize(w, "fp8_tensorwise"), (9, 0))
    assert path == "fp8_tensorwise" and "addmm_float8_unwrapped" not in reason


def test_the_path_compiles_in_one_graph_with_the_same_bits() -> None:
    """Under ``torch.compile`` the post-scale is torch's expression (inductor fuses it on CUDA): no graph
    break (fullgraph), the eager bits."""
    x, w = _operands(48, 64, 40, seed=2)
    qa, qb = quantize(x, "fp8_rowwise_fp32"), quantize(w, "fp8_rowwise_fp32")
    args = (qa.data, qb.data.t(), qa.block_descale(), qb.block_descale().t(), torch.bfloat16)
    torch._dynamo.reset()
    compiled = torch.compile(gemm._rowwise_post_scaled, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(*args), gemm._rowwise_post_scaled(*args))
