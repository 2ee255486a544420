"""plan_precision's bounds as measured facts: the loss budget, the gradient budget, the check batches and
the forward-flush limit, each checked against losses and gradients computed here from scratch."""

from __future__ import annotations

import copy

import pytest
import torch
from test_plan_precision import _Bf16, loss_fn  # the planner tests' bf16 layer and loss
from torch import nn

from mixprec.inspect.demo import OutlierMLP
from mixprec.plan import plan_precision


def _teacher(seed: int = 0, channel_sigma: float = 0.0, outlier: bool = True):
    """OutlierMLP (or a plain 64-128-128-10 ReLU MLP) after 40 AdamW steps on labels drawn from a random
    teacher, its inputs' channels of lognormal scale (``channel_sigma``), and 6 batches of 64."""
    g = torch.Generator().manual_seed(seed)
    scales = torch.exp(torch.randn(64, generator=g) * channel_sigma)
    teacher = torch.randn(64, 10, generator=g)
    x = torch.randn(64 * 46, 64, generator=g) * scales
    y = torch.multinomial(torch.softmax((x / scales) @ teacher, 1), 1, generator=g).squeeze(1)
    batches = list(zip(x.split(64), y.split(64), strict=True))
    torch.manual_seed(seed)
    if outlier:
        model = OutlierMLP()
    else:
        model = nn.Sequential(
            nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10)
        )
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    for batch in batches[6:]:
        opt.zero_grad()
        loss_fn(model, batch).backward()
        opt.step()
    model.zero_grad(set_to_none=True)
    return model, batches[:6]


def _relative_loss_change(model: nn.Module, plan, batches: list) -> float:
    """The oracle: the plan applied to a copy (bf16 layers' GEMMs in bf16), losses from scratch."""
    quantized = plan.apply(copy.deepcopy(model))
    for fqn, fmt in plan.formats.items():
        if fmt == "bf16":
            setattr(quantized, fqn, _Bf16(quantized.get_submodule(fqn)))
    with torch.no_grad():
        ref = [loss_fn(model, b).item() for b in batches]
        got = [loss_fn(quantized, b).item() for b in batches]
    return sum(abs(a - b) for a, b in zip(got, ref, strict=True)) / sum(ref)


@pytest.fixture(scope="module")
def teacher():
    return _teacher()


def test_the_budget_bounds_the_measured_loss_change_of_the_whole_plan(teacher):
    model, batches = teacher
    for budget in (0.002, 0.01, 0.05):
        plan = plan_precision(model, batches[:2], loss_fn, budget=budget, cost="b200-peak")
        oracle = _relative_loss_change(model, plan, batches[:2])
        assert oracle <= budget, (budget, plan.table())
        assert oracle == pytest.approx(plan.measured["loss"], rel=1e-4, abs=1e-7)
        assert plan.rounds[-1]["measured"] == plan.measured["loss"]
    assert plan.low_precision_share() > 0.5  # the loose budget buys low-bit layers, the loss alone decides


def test_check_batches_bound_the_plan_on_batches_it_was_not_measured_on(teacher):
    model, batches = teacher
    budget = 0.004
    # Check batches of 4x the inputs' scale: every low-bit layer's effect there is larger than on the
    # planning batches, so the plan must be tightened until it fits on them too.
    checks = [(x * 4, y) for x, y in batches[2:4]]
    plain = plan_precision(model, batches[:2], loss_fn, budget=budget, cost="b200-peak")
    checked = plan_precision(
        model, batches[:2], loss_fn, budget=budget, cost="b200-peak", check_batches=checks
    )
    assert _relative_loss_change(model, plain, checks) > budget, plain.table()
    assert checked.measured["check_loss"] == pytest.approx(
        _relative_loss_change(model, checked, checks), rel=1e-4
    )
    assert checked.measured["check_loss"] <= budget and checked.measured["loss"] <= budget
    assert _relative_loss_change(model, checked, batches[:2]) <= budget
    assert len(checked.rounds) > 1 and checked.relative_cost() > plain.relative_cost()


def _weight_grad_change(model: nn.Module, plan, batches: list) -> float:
    """The oracle: ``||G - G_ref|| / ||G_ref||`` over every planned layer's weight gradient, summed over
    ``batches``, by autograd on the plan applied to a copy (bf16 layers' GEMMs in bf16)."""
    quantized = plan.apply(copy.deepcopy(model))
    for fqn, fmt in plan.formats.items():
        if fmt == "bf16":
            setattr(quantized, fqn, _Bf16(quantized.get_submodule(fqn)))
    grads = []
    for m in (model, quantized):
        layers = [m.get_submodule(f) for f in plan.formats]
        params = [(layer.linear if isinstance(layer, _Bf16) else layer).weight for layer in layers]
        total = [torch.zeros_like(p) for p in params]
        for b in batches:
            for t, g in zip(total, torch.autograd.grad(loss_fn(m, b), params), strict=True):
                t += g
        grads.append(total)
    num = sum(float((q - r).square().sum()) for r, q in zip(*grads, strict=True))
    return (num / sum(float(r.square().sum()) for r in grads[0])) ** 0.5


def test_grad_budget_bounds_the_measured_weight_gradient_change():
    model, batches = _teacher(outlier=False)  # OutlierMLP's 300x gain makes even bf16 move its gradients
    fmts = ("mxfp8", "bf16")  # no stochastic rounding: the oracle's gradients are the planner's
    free = plan_precision(model, batches[:2], loss_fn, formats=fmts, budget=0.05, cost="b200-peak")
    grad_budget = free.measured["weight_grad"] / 2
    bound = plan_precision(
        model, batches[:2], loss_fn, formats=fmts, budget=0.05, cost="b200-peak", grad_budget=grad_budget
    )
    assert bound.measured["weight_grad"] <= grad_budget < free.measured["weight_grad"], bound.table()
    assert bound.measured["loss"] <= 0.05 and bound.grad_budget == grad_budget
    assert bound.relative_cost() > free.relative_cost()
    for plan in (free, bound):
        oracle = _weight_grad_change(model, plan, batches[:2])
        assert oracle == pytest.approx(plan.measured["weight_grad"], rel=1e-3, abs=1e-6)


def test_a_format_that_flushes_a_layers_forward_input_is_not_a_candidate():
    model, batches = _teacher(channel_sigma=1.5)  # a few input channels 10-100x the others
    before = {k: v.clone() for k, v in model.state_dict().items()}
    limited = plan_precision(model, batches[:2], loss_fn, budget=0.05, cost="b200-peak")
    fc1 = limited.layers["fc1"]["divergence"]
    assert fc1["nvfp4"]["fprop_flushed"] > 0.15 >= fc1["mxfp8"]["fprop_flushed"]
    assert all(limited.layers[f]["divergence"]["nvfp4"]["fprop_flushed"] <= 0.15 for f in ("fc2", "fc3"))
    assert limited.formats["fc1"] != "nvfp4" and "flushes" in limited.reasons["fc1"], limited.table()
    assert fc1["nvfp4"]["loss"] is None  # ruled out from the captured operands, no pass
    full = plan_precision(model, batches[:2], loss_fn, budget=0.05, cost="b200-peak", exhaustive=True)
    assert full.formats == limited.formats and full.layers["fc1"]["divergence"]["nvfp4"]["loss"] > 0
    free = plan_precision(model, batches[:2], loss_fn, budget=0.05, cost="b200-peak", max_flushed=1.0)
    assert free.formats["fc1"] == "nvfp4", free.table()  # its loss change alone would have let it in
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_lazy_measurement_gives_the_exhaustive_plan_with_fewer_passes(teacher):
    model, batches = teacher
    for budget, fits_cheapest in ((0.004, False), (0.05, True)):
        lazy = plan_precision(model, batches[:2], loss_fn, budget=budget, cost="b200-peak")
        full = plan_precision(model, batches[:2], loss_fn, budget=budget, cost="b200-peak", exhaustive=True)
        assert lazy.formats == full.formats, (lazy.table(), full.table())
        assert lazy.measured["loss"] == full.measured["loss"]  # no random draws in a forward pass
        for fqn, info in lazy.layers.items():
            for fmt, d in info["divergence"].items():
                assert d["loss"] is None or d["loss"] == full.layers[fqn]["divergence"][fmt]["loss"]
        # One pass for the reference, one per (layer, format) measured (fp32 is the reference), one
        # per whole-plan measurement.
        assert full.passes == 1 + 4 * 3 + len(full.rounds)
        if fits_cheapest:  # every layer's cheapest format fits: 4 layer passes instead of 12
            assert set(lazy.formats.values()) == {"nvfp4"} and lazy.passes == 1 + 4 + 1
        else:
            assert lazy.passes == full.passes
