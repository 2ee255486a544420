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
