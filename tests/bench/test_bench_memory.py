"""The bench's memory per component (issue 30 item 4): read off the tensors of one step, in the records,
the JSON and the table."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mixprec.bench import Job, report, run_job
from mixprec.bench.memory import COMPONENTS, SavedBytes, component_bytes

MODES = ("fp32", "O2-bf16", "bf16-true", "bf16-true-kahan")


@pytest.fixture(scope="module")
def results():
    return {m: run_job(Job("tabular-regression", m, size="tiny", steps=3)) for m in MODES}


def test_saved_bytes_are_the_linears_inputs_of_a_linear_stack() -> None:
    model = nn.Sequential(nn.Linear(30, 20), nn.Linear(20, 5))
    x = torch.randn(16, 30)
    with SavedBytes(model) as saved:
        model(x).sum().backward()
    assert saved.nbytes == 16 * (30 + 20) * 4  # x and the first layer's output; weights left out


def test_components_count_masters_grads_state_and_kahan_buffers() -> None:
    import mixprec

    model = nn.Linear(64, 32).to(torch.bfloat16)
    opt = mixprec.CompensatedOptimizer(
        torch.optim.AdamW(model.parameters()), method="kahan", state_format="int8"
    )
    model(torch.randn(4, 64, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    got = component_bytes(model, opt, 0)
    n = 64 * 32 + 32
    assert got["weights"] == got["gradients"] == 2 * n
    # int8 moments: 1 byte each + an fp32 scale per 256 values (8 blocks + 1), a step, then Kahan buffers
    assert got["optimizer_state"] == 2 * (64 * 32) + 2 * 8 * 4 + 2 * 32 + 2 * 4 + 2 * 4 + 2 * n


def test_each_mode_reports_its_components(results) -> None:
    m = {mode: r.memory_bytes for mode, r in results.items()}
    params = m["fp32"]["weights"] // 4
    assert m["fp32"]["gradients"] == m["fp32"]["weights"] == 4 * params
    assert m["bf16-true"]["weights"] == m["bf16-true"]["gradients"] == 2 * params
    assert m["O2-bf16"]["weights"] == 6 * params and m["O2-bf16"]["gradients"] == 2 * params  # fp32 masters
    assert m["bf16-true-kahan"]["optimizer_state"] > m["bf16-true"]["optimizer_state"]  # the Kahan buffers
    assert all(0 < r["activations"] for r in m.values())
    assert m["bf16-true"]["activations"] < m["fp32"]["activations"]


def test_records_and_table_carry_the_components(results) -> None:
    records = report.make_records(list(results.values()))
    for record, result in zip(records, results.values(), strict=True):
        assert {c: record[f"{c}_bytes"] for c in COMPONENTS} == result.memory_bytes
    table = report.format_table(list(results.values()))
    assert "memory per component (KiB, one step, read off the tensors)" in table
    section = table.split("memory per component", 1)[1].splitlines()
    kib = [f"{v / 1024:.1f}" for v in results["O2-bf16"].memory_bytes.values()]
    assert next(li for li in section if li.startswith("O2-bf16")).split()[1:5] == kib
