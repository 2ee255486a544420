"""plan_precision(measure="local"): one-pass per-layer estimates against a hand computation, the pass
count, refusals, JSON, and the whole-plan budget still measured."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from test_plan_budget import _relative_loss_change, _teacher
from test_plan_precision import _same_state, _task, loss_fn
from torch import nn

from mixprec.lowbit import LowbitLinear
from mixprec.plan import PrecisionPlan, plan_precision


def _two_layers():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    g = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(32, 8, generator=g) * 3, torch.randint(0, 4, (32,), generator=g)) for _ in range(2)
    ]
    return model, batches


def _bf16(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    w, b = linear.weight.bfloat16(), linear.bias.bfloat16()
    return F.linear(x.bfloat16(), w, b).float()


def _by_hand(model: nn.Sequential, batches: list, quantized) -> dict[str, dict[str, float]]:
    """Per layer: sum_b |<g_y, dy>| / sum_b L_b, the same with 0.5 R sum_r <g_r, dy_r>^2 added, and the
    layer's own weight-gradient change over the norm of both layers' weight gradients."""
    layers = {"0": model[0], "2": model[2]}
    first, second = dict.fromkeys(layers, 0.0), dict.fromkeys(layers, 0.0)
    dw = {name: 0.0 for name in layers}
    gw_ref = [torch.zeros_like(m.weight) for m in layers.values()]
    total = 0.0
    for x, y in batches:
        y1 = model[0](x)
        y2 = model[2](torch.relu(y1))
        loss = F.cross_entropy(y2, y)
        total += loss.item()
        g1, g2, w1, w2 = torch.autograd.grad(loss, [y1, y2, model[0].weight, model[2].weight])
        gw_ref[0] += w1
        gw_ref[1] += w2
        for name, inp, out, g in (("0", x, y1, g1), ("2", torch.relu(y1), y2, g2)):
            layer = layers[name]
            inp = inp.detach()
            y_q = quantized(layer, inp)
            per_row = (g.double() * (y_q - out).detach().double()).sum(1)
            t1 = per_row.sum().item()
            first[name] += abs(t1)
            second[name] += abs(t1 + 0.5 * len(per_row) * per_row.square().sum().item())
            (gw_q,) = torch.autograd.grad(y_q, [layer.weight], g)
            dw[name] = dw[name] + (gw_q - g.T @ inp)  # dL/dW = g_y^T x at the layer's own precision
    norm = sum(float(g.square().sum()) for g in gw_ref) ** 0.5
    return {
        name: {
            "loss_first_order": first[name] / total,
            "loss_second_order": second[name] / total,
            "weight_grad": float(dw[name].norm()) / norm,
        }
        for name in layers
    }


@pytest.mark.parametrize("fmt", ["bf16", "mxfp8"])
def test_local_estimates_equal_a_hand_computation(fmt):
    model, batches = _two_layers()
    if fmt == "bf16":
        quantized = _bf16
    else:  # the module plan_precision swaps in for a low-bit format, run here on the kept operands
        quantized = lambda layer, x: LowbitLinear.from_linear(layer, fmt, None)(x)  # noqa: E731
    expected = _by_hand(model, batches, quantized)
    plan = plan_precision(
        model, batches, loss_fn, formats=(fmt,), budget=0.5, exhaustive=True, measure="local"
    )
    for name, want in expected.items():
        got = plan.layers[name]["divergence"][fmt]
        assert want["loss_first_order"] > 0
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-12), (name, key)
        assert got["loss"] == got["loss_first_order"]


def test_local_runs_one_full_pass_before_the_whole_plan_measurements():
    model, batches = _task()
    exact = plan_precision(model, batches, loss_fn, budget=0.5, cost="b200-peak", exhaustive=True)
    local = plan_precision(
        model, batches, loss_fn, budget=0.5, cost="b200-peak", exhaustive=True, measure="local"
    )
    assert local.measure == "local" and exact.measure == "exact"
    assert local.passes == 1 + len(local.rounds)
    assert exact.passes == 1 + 4 * 3 + len(exact.rounds)  # 4 layers x 3 formats, one pass each
    # The estimates still single out the outlier-fed layer: kept out of 4 bits.
    assert local.formats["fc3"] != "nvfp4", local.table()
    assert local.low_precision_share() >= 0.5, local.table()


def test_local_plans_budget_is_a_measured_fact():
    model, batches = _teacher()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for budget in (0.003, 0.01):
        plan = plan_precision(model, batches, loss_fn, budget=budget, cost="b200-peak", measure="local")
        oracle = _relative_loss_change(model, plan, batches)
        assert oracle <= budget, plan.table()
        assert oracle == pytest.approx(plan.measured["loss"], rel=1e-4, abs=1e-7)
    assert _same_state(model, before)
    assert all(p.grad is None for p in model.parameters())


def test_local_plan_round_trips_json_and_a_version_2_document_still_loads():
    model, batches = _task()
    plan = plan_precision(model, batches[:1], loss_fn, budget=0.5, measure="local")
    assert PrecisionPlan.from_json(plan.to_json()) == plan
    old = json.loads(plan.to_json())
    old.pop("measure")
    old["version"] = 2
    assert PrecisionPlan.from_json(json.dumps(old)).measure == "exact"


@pytest.mark.parametrize("bad", ["fast", "", None, 1])
def test_bad_measure_is_refused_and_the_model_is_unchanged(bad):
    model, batches = _task()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=f"measure must be 'exact' or 'local', got {bad!r}"):
        plan_precision(model, batches[:1], loss_fn, measure=bad)
    assert _same_state(model, before)
    assert all(type(m) is nn.Linear for m in (model.fc1, model.fc2, model.fc3, model.head))


def test_a_plan_over_the_gradient_bound_switches_local_estimates_to_exact_measurement():
    # the local weight-gradient estimate leaves the other layers out, so it undercounts: the first plan
    # on it measures over a tight grad_budget, and the planner then measures every layer exactly
    model, batches = _teacher()
    kwargs = {"budget": 0.01, "grad_budget": 0.2, "cost": "b200-peak"}
    local = plan_precision(model, batches[:2], loss_fn, measure="local", **kwargs)
    exact = plan_precision(model, batches[:2], loss_fn, measure="exact", **kwargs)
    assert local.measure == "local+exact"
    assert [r.get("switched_to_exact") for r in local.rounds][:1] == [1.0]
    assert local.formats == exact.formats
    assert local.measured["weight_grad"] <= 0.2
    for fqn, info in local.layers.items():  # every estimate was replaced by its exact measurement
        for fmt, d in info["divergence"].items():
            assert d["loss"] == exact.layers[fqn]["divergence"][fmt]["loss"]
            assert "loss_first_order" not in d
    assert PrecisionPlan.from_json(local.to_json()) == local
