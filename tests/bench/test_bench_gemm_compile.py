"""The GEMM-bound ``lm-gemm`` workload (GPU-sized, refused on a CPU above tiny) and ``--compile``.

A compiled run is a real ``torch.compile`` (inductor) of the tiny lm on this CPU; its losses are checked
against the same run eager.
"""

from __future__ import annotations

import math

import pytest
import torch

from mixprec.bench.budget import fit
from mixprec.bench.jobs import make_plan, resolve_workloads
from mixprec.bench.models import CharGPT
from mixprec.bench.progress import COMPILE_S, START_S, estimate_s, start_s
from mixprec.bench.report import make_records
from mixprec.bench.runner import Job, run_job
from mixprec.bench.workloads import SIZES, WORKLOADS


def test_lm_gemm_is_a_gemm_bound_gpt_at_every_size_but_tiny():
    spec = WORKLOADS["lm-gemm"]
    for size in SIZES:
        p = spec.presets[size].params
        if size == "tiny":
            assert spec.presets[size].cpu
            continue
        assert p["width"] >= 2048 and p["context"] >= 1024 and not spec.presets[size].cpu
        with torch.device("meta"):
            model = CharGPT(96, p["context"], p["width"], p["layers"], p["heads"])
        linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
        tokens = p["batch"] * p["context"]
        gemm = 6 * linear * tokens  # the linears' three training GEMMs
        attention = 6 * 2 * p["layers"] * p["batch"] * p["context"] ** 2 * p["width"]  # QK^T and PV, x3
        assert gemm / (gemm + attention) > 0.9  # the step is the linears' GEMMs


def test_lm_gemm_runs_only_when_named():
    assert "lm-gemm" not in resolve_workloads([])
    assert "lm-gemm" not in resolve_workloads(["all"])
    assert resolve_workloads(["lm-gemm"]) == ["lm-gemm"]


@pytest.mark.parametrize("size", ["quick", "default", "large"])
def test_lm_gemm_is_refused_on_a_cpu_with_its_cost_and_the_ways_out(size):
    with pytest.raises(
        ValueError, match=rf"'lm-gemm' at size '{size}' is sized for a GPU: one step is about 2 min"
    ) as e:
        make_plan(workloads=["lm-gemm"], modes=["fp32"], size=size, device="cpu")
    assert "--device cuda" in str(e.value) and "--size tiny" in str(e.value)


def test_lm_gemm_tiny_plans_on_a_cpu():
    plan = make_plan(workloads=["lm-gemm"], modes=["fp32", "torch-amp-bf16"], size="tiny", device="cpu")
    assert {job.workload for job in plan.jobs} == {"lm-gemm"}


def test_compiled_plan_marks_every_job_and_its_estimate_counts_the_compile():
    plan = make_plan(
        workloads=["lm"], modes=["fp32", "torch-amp-bf16"], size="tiny", device="cpu", compiled=True
    )
    assert plan.jobs and all(job.compiled for job in plan.jobs)  # the A/A run too: the same for every mode
    assert any("--compile" in note for note in plan.notes)
    eager = [Job(job.workload, job.mode, job.size, replica=job.replica) for job in plan.jobs]
    assert start_s(plan.jobs[0]) == START_S + COMPILE_S and start_s(eager[0]) == START_S
    assert math.isclose(estimate_s(plan.jobs, 1.0) - estimate_s(eager, 1.0), COMPILE_S * len(plan.jobs))
    # a budget that fits the eager runs but not their compiles cuts the compiled ones' rounds
    large = [Job("lm", mode, "large", compiled=c) for mode in ("fp32", "bf16-true") for c in (False, True)]
    budget = estimate_s(large[0::2], 1.0) + 1.0
    assert fit(large[0::2], budget, 1.0)[1] == 1.0 and fit(large[1::2], budget, 1.0)[1] < 1.0


def test_a_compiled_run_trains_as_the_eager_one_through_dynamo():
    torch._dynamo.reset()
    tiny = {"size": "tiny", "steps": 3}
    eager = run_job(Job("lm", "fp32", **tiny))
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled = run_job(Job("lm", "fp32", compiled=True, **tiny))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > before  # the model went through dynamo
    losses = [h["loss"] for h in compiled.history]
    torch.testing.assert_close(losses, [h["loss"] for h in eager.history], rtol=1e-4, atol=1e-5)
    assert math.isclose(compiled.final_loss, eager.final_loss, rel_tol=1e-4)
    assert (
        compiled.memory_bytes is not None
        and compiled.memory_bytes["weights"] == eager.memory_bytes["weights"]
    )
    # the bench JSON says which run was compiled
    records = make_records([eager, compiled])
    assert [r["compiled"] for r in records] == [False, True] and compiled.compiled and not eager.compiled
