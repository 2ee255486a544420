"""The roofline's quantization traffic per path (issue 40): the unfused path's byte counts checked
against the ops the pure-torch quantizers issue (recorded with a TorchDispatchMode on a real CPU call,
so the model cannot drift from the code), the fused paths' per-format differences, and the rule that
picks the path."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

from mixprec.lowbit import auto_filter, gemm
from mixprec.lowbit.cost import (
    QUANTIZE_PATHS,
    TARGETS,
    gemm_cost,
    quantize_bytes,
    quantize_path,
)
from mixprec.lowbit.formats import FORMATS
from mixprec.lowbit.quantize import quantize
from mixprec.lowbit.recipes import RECIPES, get_recipe

_SKIP = (torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default, torch.ops.aten.mm.default)


def _touched(t: torch.Tensor) -> int:
    """Bytes an op reads or writes of ``t``: its elements, a broadcast (stride 0) dim counted once."""
    n = t.element_size()
    for size, stride in zip(t.shape, t.stride(), strict=True):
        n *= size if stride else 1
    return n


class _Traffic(TorchDispatchMode):
    """Sums the bytes every non-view op reads and writes (a GEMM's mm left out: priced apart)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view and func not in _SKIP and func is not torch.ops.aten.detach.default:
            tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
            self.bytes += sum(_touched(t) for t in tensors)
        return out


def _recorded(fn) -> int:
    with _Traffic() as rec:
        fn()
    return rec.bytes


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_one_unfused_call_moves_the_bytes_the_model_counts(fmt) -> None:
    x = torch.randn(256, 2048, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    recipe = f"fprop={fmt},hp dgrad=hp,hp wgrad=hp,hp sr=off rht=off"
    model = quantize_bytes(recipe, 256, 1, 2048, "unfused")  # one call: x along K
    assert _recorded(lambda: quantize(x, fmt, pad=True)) == pytest.approx(model, rel=0.01)


def _record_layer(recipe: str, m: int, n: int, k: int) -> int:
    """The bytes of one training step's quantization: LowbitLinearFunction forward and backward on CPU
    in bf16, with the GEMMs (``_mm``, ``lowbit_mm``) run outside the recording."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, dtype=torch.bfloat16, generator=gen).requires_grad_(True)
    w = torch.randn(n, k, dtype=torch.bfloat16, generator=gen).requires_grad_(True)
    go = torch.randn(m, n, dtype=torch.bfloat16, generator=gen)
    r = get_recipe(recipe)
    stats = torch.zeros(2, 3) if r.scaling is not None else None

    def unrecorded(f):
        def call(*args, **kwargs):
            with _disable_current_modes():
                return f(*args, **kwargs)

        return call

    mp = pytest.MonkeyPatch()
    for name in ("_mm", "lowbit_mm"):
        mp.setattr(gemm, name, unrecorded(getattr(gemm, name)))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the CPU emulates the GEMMs and says so
            with _Traffic() as rec:
                out = gemm.LowbitLinearFunction.apply(x, w, r, None, None, None, stats, True)
                torch.autograd.grad(out, (x, w), go)
    finally:
        mp.undo()
    return rec.bytes


@pytest.mark.parametrize("recipe", [*RECIPES, "fp8_tensorwise scaling=dynamic"])
def test_a_layer_steps_unfused_quantization_is_the_models(recipe) -> None:
    m, n, k = 256, 512, 1024
    model = quantize_bytes(recipe, m, n, k, "unfused")
    assert _record_layer(recipe, m, n, k) == pytest.approx(model, rel=0.02)


def test_the_fused_paths_per_format() -> None:
    m, n, k = 4096, 4096, 4096
    per_elem = {
        (r, p): quantize_bytes(r, m, n, k, p) / (m * k + n * k + m * n)
        for r in RECIPES
        for p in QUANTIZE_PATHS
    }
    # tensorwise and rowwise: an amax pass and a cast-transpose pass, 2 + 2 + 1 + 1 bytes (Triton)
    assert per_elem[("fp8_tensorwise", "triton")] == pytest.approx(6.0)
    assert per_elem[("fp8_rowwise", "triton")] == pytest.approx(6.0)  # no transposed bf16 copy
    # 1x128 / 128x128 blocks: one pass, no amax pass, plus fp32 scales
    assert per_elem[("fp8_blockwise", "triton")] < 4.1
    # MX and NVFP4 have no Triton kernel: eager CUDA runs them unfused; compiled fuses them
    assert per_elem[("mxfp8", "triton")] == per_elem[("mxfp8", "unfused")] > 80
    assert per_elem[("mxfp8", "fused")] == pytest.approx(2 * (2 + 1 + 1 / 32))
    for r in RECIPES:
        assert per_elem[(r, "fused")] < per_elem[(r, "unfused")] / 4, r
    assert quantize_bytes("bf16", m, n, k) == 0.0


def test_gemm_cost_prices_the_path() -> None:
    b200 = TARGETS["b200"]
    costs = {p: gemm_cost(b200, "mxfp8", 2048, 1024, 1024, p) for p in QUANTIZE_PATHS}
    assert costs["fused"] < costs["triton"] == costs["unfused"]
    assert gemm_cost(b200, "mxfp8", 2048, 1024, 1024) == costs["triton"]
    assert gemm_cost(b200, "bf16", 64, 64, 64, "unfused") == gemm_cost(b200, "bf16", 64, 64, 64, "fused")
    peak = TARGETS["b200-peak"]  # no memory terms: the path does not matter
    assert gemm_cost(peak, "mxfp8", 64, 64, 64, "unfused") == gemm_cost(peak, "mxfp8", 64, 64, 64, "fused")


def test_the_rule_that_picks_the_path(monkeypatch) -> None:
    monkeypatch.delenv("MIXPREC_FUSED_QUANTIZE", raising=False)
    assert quantize_path() == "triton" and quantize_path(compiled=True) == "fused"
    monkeypatch.setenv("MIXPREC_FUSED_QUANTIZE", "0")
    assert quantize_path() == "unfused" and quantize_path(compiled=True) == "fused"
    assert quantize_path("triton") == "triton"  # an explicit path wins
    with pytest.raises(
        ValueError, match=r"quantize must be one of 'fused', 'triton', 'unfused'.*got 'eager'"
    ):
        quantize_path("eager")
    with pytest.raises(ValueError, match="got 'eager'"):
        gemm_cost(TARGETS["h100"], "fp8_rowwise", 64, 64, 64, "eager")


def test_auto_filter_takes_the_path(monkeypatch) -> None:
    monkeypatch.delenv("MIXPREC_FUSED_QUANTIZE", raising=False)
    lin = torch.nn.Linear(4096, 4096, device="meta")
    args = {"tokens_per_step": 4096, "target": "b200", "min_gain": 0.2}
    # mxfp8 at 4096^3 gains on b200 compiled (0.71x bf16), not with eager's pure-torch MX quantizer (3.6x)
    assert auto_filter("mxfp8", compiled=True, **args)(lin, "l") is True
    assert auto_filter("mxfp8", quantize="fused", **args)(lin, "l") is True
    assert auto_filter("mxfp8", **args)(lin, "l") is False
    with pytest.raises(ValueError, match="got 'fast'"):
        auto_filter("mxfp8", quantize="fast", **args)
    with pytest.raises(ValueError, match="compiled must be True or False, got 1"):
        auto_filter("mxfp8", compiled=1, **args)
