"""The fused Adam pass on a CUDA device, at 403M parameters (issue 40): no host sync per step beyond the
guard's one read, a number of kernel launches bounded by the chunks of ``rounding.CUDA_CHUNK`` values
(not by cache-sized ones: ~1,500 chunks, ~17,000 launches and, for stochastic rounding, a host read per
chunk), and a workspace of those bounds. ``FakeTensorMode`` allocates nothing, so the GPT shapes of
``benchmarks/optimizer_speed.py`` cost no memory here."""

from __future__ import annotations

import importlib.util
import os
import warnings
from pathlib import Path

import pytest
import torch

import mixprec
from fake_cuda import loops
from mixprec.optim.rounding import CUDA_CHUNK

pytestmark = pytest.mark.skipif(torch.version.cuda is None, reason="needs a CUDA build of torch (fake tier)")

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SHAPES = loops.gpt_shapes()  # 403M parameters
NUMEL = sum(torch.Size(shape).numel() for shape in SHAPES)
CHUNKS = -(-NUMEL // CUDA_CHUNK)  # 25
PIECES = CHUNKS + len(SHAPES) - 1  # each chunk edge inside a tensor adds a slice: 72 at most
CASES = {"kahan": ("kahan", None), "stochastic": ("stochastic", None), "int8": ("nearest", "int8")}
CASES["int8-stochastic"] = ("stochastic", "int8")


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bound(state_format: str | None) -> int:
    """Launches a step may take: 14 ops per chunk in torch's layout (copies in, the fused kernel, copies
    out, the rounding: 13 for Kahan with a bf16 second moment); a low-bit format decodes and encodes each
    tensor's slice of a chunk, about ten ops per moment; a few more per step (the step counters, the
    guard's norms)."""
    return (14 * CHUNKS if state_format is None else 24 * PIECES + 12 * CHUNKS) + 8


def test_the_shapes_are_the_speed_benchmarks() -> None:
    assert SHAPES == _script("optimizer_speed").shapes(2048, 8)
    assert NUMEL == 402_685_952


@pytest.mark.parametrize("guard", [False, True], ids=["no-guard", "guard"])
@pytest.mark.parametrize("case", CASES)
def test_a_403m_step_never_waits_for_the_device_and_launches_per_big_chunk(fake_hopper, case, guard) -> None:
    method, state_format = CASES[case]
    made = []

    def make(params):
        inner = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
        made.append(
            mixprec.CompensatedOptimizer(inner, method, state_format=state_format, skip_nonfinite=guard)
        )
        return made[0]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        counts = loops.optimizer_launches(fake_hopper, make, SHAPES, steps=2)
    assert [syncs for syncs, _ in counts] == [int(guard)] * 2  # the guard's one read of the norms
    assert counts[-1][1] <= _bound(state_format), fake_hopper.launches.most_common(8)
    assert "randint" not in fake_hopper.launches  # stochastic rounding draws no pool offsets on a GPU
    buffers = made[0].workspace.buffers.values()
    assert max(b.numel() for b in buffers) <= CUDA_CHUNK
    fp32 = [b for b in buffers if b.dtype == torch.float32]
    assert len(fp32) <= 5  # the documented workspace: at most five fp32 buffers of a chunk, 320 MiB
    assert sum(b.numel() * b.element_size() for b in buffers) <= 22 * CUDA_CHUNK  # + 2 bytes of bits


def test_the_launch_table_runs_and_counts_torch_beside_mixprec() -> None:
    rows = _script("fake_cuda_launches").main(["--width", "256", "--layers", "2", "--steps", "2"])["rows"]
    by = {row["config"]: row for row in rows}
    assert by["torch-fused"]["launches"][-1] == 2  # the step counters' add and the fused kernel
    assert all(row["syncs"] == ([1, 1] if row["config"].endswith("+guard") else [0, 0]) for row in rows)
    assert all(by[name]["launches"][-1] > 2 for name in by if name.startswith("mixprec"))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_on_the_triton_path_a_step_is_one_launch_per_tensor(monkeypatch) -> None:
    """Under the interpreter (real CPU tensors take the Triton kernels) every config steps each of a GPT
    block's six tensors in one launch; beside them the step counters' add and, for stochastic rounding, one
    seed per step; two ops per tensor are the interpreter's bias corrections (a GPU kernel's ``powf``)."""
    monkeypatch.delenv("MIXPREC_FUSED_OPTIM", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the script sets it for the count, then restores this
    args = ["--interpreted", "--width", "16", "--layers", "1", "--steps", "2"]
    rows = _script("fake_cuda_launches").main(args)["rows"]
    later = {row["config"]: row["launches"][-1] for row in rows}
    tensors = len(loops.gpt_shapes(16, 1))
    host = 1 + 2 * tensors  # the counters' add; pow and rsub per tensor
    assert later["torch-fused"] == 2
    assert later["mixprec-kahan"] == later["mixprec-int8"] == tensors + host
    assert later["mixprec-stochastic"] == tensors + host + 1
    assert later["mixprec-kahan+guard"] > later["mixprec-kahan"]  # the guard's norms
    assert os.environ["TRITON_INTERPRET"] == "0"
