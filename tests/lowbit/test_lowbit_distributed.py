"""NVFP4 training (SR and RHT on) under DDP and FSDP2 on two gloo processes equals its data-parallel
definition computed in one process: each rank's gradients from its own batch and generator, averaged."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lowbit_dist_worker as dist_worker

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is needed"
)


def _launch(wrapper: str, out: Path) -> list[list[torch.Tensor]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, str(Path(dist_worker.__file__)), "", "2", str(out), wrapper]
    procs = []
    for rank in range(2):
        cmd[2] = str(rank)
        procs.append(subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env))
    logs = []
    try:
        logs = [proc.communicate(timeout=180)[0].decode(errors="replace") for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)
    return [torch.load(out / f"{wrapper}{rank}.pt") for rank in range(2)]


def _reference() -> list[torch.Tensor]:
    models = [dist_worker.model_for(rank) for rank in range(2)]
    for step in range(dist_worker.STEPS):
        grads = []
        for rank, model in enumerate(models):
            model.zero_grad()
            model(dist_worker.batch(step, rank)).square().mean().backward()
            grads.append([p.grad for p in model.parameters()])
        with torch.no_grad():
            for i, (p0, p1) in enumerate(zip(models[0].parameters(), models[1].parameters(), strict=True)):
                update = (grads[0][i] + grads[1][i]) / 2
                p0 -= 0.05 * update
                p1.copy_(p0)
    return [p.detach() for p in models[0].parameters()]


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_data_parallel_nvfp4_equals_the_averaged_per_rank_gradients(wrapper, tmp_path: Path) -> None:
    ranks = _launch(wrapper, tmp_path)
    expected = _reference()
    for got in ranks:
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-7)
