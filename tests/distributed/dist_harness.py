"""Run a scenario of dist_scenarios.py on gloo ranks, one process each, and load what every rank saved."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
SCENARIOS = HERE / "dist_scenarios.py"


def _skip_reason() -> str | None:
    if not dist.is_available():
        return "torch.distributed is not available in this torch build"
    if not dist.is_gloo_available():
        return "torch.distributed has no gloo backend in this build"
    return None


SKIP_REASON = _skip_reason()
requires_gloo = pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")


def worker_env() -> dict[str, str]:
    """One thread per process (the machine is shared), the source tree importable, no warning noise."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "MIXPREC_TEST_THREADS": "1"}


def run_ranks(
    scenario: str, tmp_path: Path, world_size: int = 2, timeout: float = 90
) -> list[dict[str, Any]]:
    """Start ``world_size`` processes running ``scenario``; return each rank's saved results, rank order.

    A rank that fails or hangs fails the test with every rank's output; no process outlives the call.
    """
    logs = [tmp_path / f"rank{rank}.log" for rank in range(world_size)]
    command = [sys.executable, str(SCENARIOS), scenario, str(world_size), str(tmp_path)]
    procs = []
    for rank, log in enumerate(logs):
        with open(log, "w") as out:
            procs.append(
                subprocess.Popen(
                    [*command, str(rank)], stdout=out, stderr=subprocess.STDOUT, env=worker_env()
                )
            )
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if any(proc.returncode != 0 for proc in procs):
        outputs = "\n".join(
            f"--- rank {rank} (exit {proc.returncode}) ---\n{log.read_text()[-4000:]}"
            for rank, (proc, log) in enumerate(zip(procs, logs, strict=True))
        )
        pytest.fail(f"scenario {scenario!r} failed or timed out after {timeout}s:\n{outputs}")
    return [torch.load(tmp_path / f"rank{rank}.pt", weights_only=True) for rank in range(world_size)]
