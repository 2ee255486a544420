"""examples/ddp_train.py runs under torchrun with two gloo ranks and ends with identical replicas."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from dist_harness import requires_gloo, worker_env

pytestmark = requires_gloo

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ddp_train.py"


@pytest.mark.parametrize("extra", [[], ["--master-weights", "--dtype", "bfloat16"]], ids=["amp", "master"])
def test_ddp_example_under_torchrun(extra: list[str]) -> None:
    pytest.importorskip("sklearn", reason="the example trains on sklearn's digits")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    done = subprocess.run(
        [*launcher, str(EXAMPLE), "--steps", "60", *extra],
        capture_output=True, text=True, timeout=120, env=worker_env(), check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ranks 2 " in done.stdout
    assert "replicas identical: True" in done.stdout
    match = re.search(r"test accuracy ([0-9.]+)", done.stdout)
    assert match and float(match.group(1)) > 0.8, done.stdout


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_ddp_lm_example_under_torchrun(dtype: str) -> None:
    """The bench's lm workload, data-parallel on 2 gloo ranks (tiny sizes): replicas stay identical."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    tiny = ["--steps", "4", "--width", "64", "--layers", "1", "--context", "32", "--corpus-bytes", "200000"]
    done = subprocess.run(
        [*launcher, str(EXAMPLE.with_name("ddp_lm.py")), *tiny, "--dtype", dtype],
        capture_output=True, text=True, timeout=180, env=worker_env(), check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"ranks 2  dtype {dtype}" in done.stdout
    assert "replicas identical: True" in done.stdout
    loss = float(re.search(r"val loss ([0-9.]+)", done.stdout).group(1))  # type: ignore[union-attr]
    assert loss < 4.6  # below uniform guessing over the byte-level vocabulary (ln 100)
