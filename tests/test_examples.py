"""Every example runs, briefly, and prints what it promises."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.parametrize(
    ("api", "scale"), [("fp16_optimizer", "dynamic"), ("fp16_optimizer", "128"), ("amp", "dynamic")]
)
def test_apex_finetune_trains_bitwise_like_the_native_api(api: str, scale: str) -> None:
    out = run_example("apex_finetune.py", "--steps", "40", "--api", api, "--loss-scale", scale)
    assert "bitwise identical weights and losses: True" in out, out
    first, last = map(float, re.search(r"mixprec.apex +loss first ([0-9.]+), last ([0-9.]+)", out).groups())
    assert last < 0.7 * first  # it fine-tuned
    skipped = int(re.search(r"mixprec.apex .*skipped steps (\d+)", out).group(1))
    if api == "fp16_optimizer":  # apex's dynamic scale starts at 2**32, which overflows fp16 gradients
        assert (skipped > 0) == (scale == "dynamic")
