"""Every example runs, briefly, and prints what it promises."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_example(name: str, *args: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args],
        capture_output=True, text=True, timeout=300, env=env, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_quickstart_reaches_fp32_accuracy() -> None:
    out = run_example("quickstart.py", "--epochs", "4")
    match = re.search(r"fp32 ([0-9.]+), mixprec bf16 ([0-9.]+)", out)
    assert match, out
    fp32, mixed = map(float, match.groups())
    assert fp32 > 0.85  # it trained
    assert abs(fp32 - mixed) <= 0.02
