"""examples/ddp_lm.py (the bench's lm workload, data-parallel) warns about CPU fp16 and shows progress."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ddp_lm.py"
TINY = ["--steps", "3", "--width", "32", "--layers", "1", "--context", "16", "--corpus-bytes", "100000"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU warning")
def test_fp16_on_cpu_warns_and_reports_progress() -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), *TINY, "--dtype", "float16"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stderr.startswith("warning: --dtype float16 on a CPU: CPUs have no fast fp16 matmul kernel")
    assert "use --dtype bfloat16 on a CPU" in done.stderr
    assert "step 1/3:" in done.stderr and "step 3/3:" in done.stderr and "s left" in done.stderr
    assert "ranks 1  dtype float16" in done.stdout
