"""benchmarks/gpu_fp8.py's quantize level with the fused kernels running (Triton's interpreter on CPU
tensors), so the rows a device run prints are checked before one: pure torch, fused, and the float64
scale division's A/B (``fused f64``) for the formats it names."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),  # numpy's, in the interpreter
]

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_quantize_rows_time_the_fused_kernels_and_their_float64_division(interpret, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location("gpu_fp8_under_test", BENCHMARKS / "gpu_fp8.py")
    gpu_fp8 = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_fp8_under_test", gpu_fp8)
    spec.loader.exec_module(gpu_fp8)
    args = argparse.Namespace(
        device="cpu", json=None, rounds=1, steps=1, warmup=0, compile_backend="inductor",
        quant_shape="64,256", quant_repeats=2,
    )  # fmt: skip
    results = gpu_fp8.Results(args)
    gpu_fp8.run_quantize(results, args)
    rows = {(q["format"], q["path"]): q for q in results.quantize}
    f64 = {fmt for fmt, path in rows if path == "fused f64"}
    assert f64 == set(gpu_fp8.F64_SCALE_FORMATS)
    gpu_fp8_differs = "the fused result differs from the pure-torch quantizers'"
    for fmt in gpu_fp8.QUANT_FORMATS:
        fused = rows[fmt, "fused"]
        # the interpreter's fp8 cast is wrong at binade edges (tested apart in test_triton_quantize), so a
        # fused row may differ from torch's here, but only as that mismatch, never as an exception
        assert fused.get("error", gpu_fp8_differs) == gpu_fp8_differs, fused
        assert ("error" in fused) == (not fused["bitwise"])
        assert fused["median_ms"] > 0 and fused["repeats"] == 2
        if fmt in f64:
            row = rows[fmt, "fused f64"]
            # the same kernels but for the division: their results agree with torch's exactly as often
            assert row["median_ms"] > 0 and row["bitwise"] == fused["bitwise"] and "vs_pure" in row
            # and the two divisions give the same bits (what the float32 division was built to do)
            x = (torch.randn(64, 256, generator=torch.Generator().manual_seed(1)) * 300).to(torch.bfloat16)
            for a, b in zip(
                interpret.quantize(x, fmt, transpose=True), gpu_fp8._f64_scale_quantize(x, fmt), strict=True
            ):
                assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
                assert torch.equal(a.scale, b.scale)
