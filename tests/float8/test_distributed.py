"""DDP with delayed scaling on two gloo processes: one all-reduce agrees every amax, ranks scale alike."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is needed"
)
WORKER = Path(__file__).resolve().parent / "dist_worker.py"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("fp8_ddp")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(rank), "2", str(out)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
        )
        for rank in range(2)
    ]
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=120)[0].decode(errors="replace"))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)
    return [torch.load(out / f"rank{rank}.pt") for rank in range(2)]


def test_one_all_reduce_per_step_for_every_history(ranks: list[dict]) -> None:
    for rank in ranks:
        assert rank["collectives"] == [1, 1, 1]
        assert rank["reduced"] == [6, 6, 6]  # 2 layers x (input, weight, grad_output)


def test_agreed_amax_is_the_max_over_ranks_and_histories_are_identical(ranks: list[dict]) -> None:
    for step in range(3):
        local = torch.stack([rank["local"][step] for rank in ranks])
        assert not torch.equal(local[0], local[1])  # the ranks really saw different amaxes
        agreed = local.amax(dim=0)
        for rank in ranks:
            assert torch.equal(rank["synced"][step][:, :, 0], agreed)
        assert torch.equal(ranks[0]["synced"][step], ranks[1]["synced"][step])


def test_ranks_use_the_same_scales_after_the_first_step(ranks: list[dict]) -> None:
    assert not torch.equal(ranks[0]["scales"][0], ranks[1]["scales"][0])  # step 0: each its own amax
    for step in (1, 2):
        assert torch.equal(ranks[0]["scales"][step], ranks[1]["scales"][step])
