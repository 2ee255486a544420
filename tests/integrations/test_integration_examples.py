"""The four integration examples (the README's) run and print what they promise."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_example(name: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name)],
        capture_output=True, text=True, timeout=300, env=env, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def losses(out: str, prefix: str = "") -> tuple[float, float]:
    match = re.search(rf"{prefix}loss ([0-9.]+) -> ([0-9.]+)", out)
    assert match, out
    return float(match.group(1)), float(match.group(2))


def test_lightning_example() -> None:
    pytest.importorskip("lightning")
    out = run_example("lightning_mixprec.py")
    before, after = losses(out)
    assert after < 0.7 * before
    assert "skipped_steps 1" in out
    assert "diagnosis: mixprec: step 11 skipped its optimizer step. Forward: the inputs of linear" in out


def test_hf_trainer_example() -> None:
    pytest.importorskip("transformers")
    out = run_example("hf_trainer_mixprec.py")
    before, after = losses(out, "bf16: ")
    assert after < 0.9 * before
    assert "transformer.h.0.mlp.c_fc matmuls ran in float32\n" in out
    assert "transformer.h.1.mlp.c_fc matmuls ran in bfloat16\n" in out
    assert "fp16: skipped_steps 1, loss_scale 4096" in out  # hysteresis=2: one overflow does not back off
    rates = re.search(
        r"learning_rate at steps 11, 12, 13, 14: ([0-9.e-]+), ([0-9.e-]+), ([0-9.e-]+), ([0-9.e-]+)", out
    )
    assert rates, out
    # the skipped step 12 left the LR alone: one pair of neighbours is equal (12-13 as 5.x logs the LR a
    # step ran with, 11-12 as 4.x logs the one after its scheduler step)
    pairs = [rates.group(i) == rates.group(i + 1) for i in (1, 2, 3)]
    assert pairs in ([False, True, False], [True, False, False]), out
    assert "scheduler steps 19 of 20" in out
    assert "diagnosis: mixprec: step 12 gave a non-finite loss." in out


def test_accelerate_example() -> None:
    pytest.importorskip("accelerate")
    out = run_example("accelerate_mixprec.py")
    before, after = losses(out)
    assert after < 0.8 * before
    assert "skipped_steps 1, loss_scale 65536" in out
    assert "scheduler steps 39 of 40" in out
    assert "diagnosis: mixprec: step 11 skipped its optimizer step." in out


def test_fabric_example() -> None:
    pytest.importorskip("lightning")
    out = run_example("fabric_mixprec.py")
    before, after = losses(out)
    assert after < 0.7 * before
    assert "loss_scale 65536, skipped_steps 1" in out  # hysteresis=2 held the scale
    assert "module 0 matmuls ran in torch.float16\n" in out
    assert "module 4 matmuls ran in torch.float32\n" in out
