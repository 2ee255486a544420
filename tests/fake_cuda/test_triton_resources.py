"""``benchmarks/triton_resources.py``: every Triton kernel mixprec launches, compiled for sm_90 with ptxas.

The recording must reach every kernel of the kernel modules (a new kernel the script does not launch
fails here), and each compiled launch must fit an SM (registers within the 255 a thread may hold).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


def test_every_kernel_is_recorded_compiled_and_fits_an_sm(monkeypatch):
    monkeypatch.delenv("MIXPREC_FUSED_QUANTIZE", raising=False)
    monkeypatch.delenv("MIXPREC_FUSED_OPTIM", raising=False)
    import triton_resources

    rows = triton_resources.measure(90)
    assert {(r["module"], r["kernel"]) for r in rows} == triton_resources.kernel_names()
    for r in rows:
        assert 0 < r["registers"] <= 255 and r["blocks_per_sm"] >= 1, r
        assert 0 < r["occupancy"] <= 1, r
    quantize = {r["constexprs"].get("MODE") for r in rows if r["kernel"] == "cast"}
    assert quantize == {0, 1, 2}  # one scale from the amax, a given one, one per row
    stats = {r["constexprs"].get("STATS") for r in rows if r["kernel"] == "cast"}
    assert stats == {False, True}  # a dynamic per-tensor layer's cast records its amax and scale
