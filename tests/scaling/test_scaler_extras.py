"""GradScaler beyond torch: skip counters, the collapse warning, min-scale errors, static/no scaling,
several optimizers, and the state_dict round trip with mixprec's own fields."""

from __future__ import annotations

import warnings

import pytest
import torch

from mixprec.scaling import DynamicScale, GradScaler, NoScale, StaticScale

from .helpers import assert_untouched, backward, model_and_optimizer, snapshot


def test_several_optimizers_skip_on_their_own():
    torch.manual_seed(0)
    first, second = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    opt_first = torch.optim.SGD(first.parameters(), lr=0.1)
    opt_second = torch.optim.SGD(second.parameters(), lr=0.1)
    scaler = GradScaler()
    scaler.scale(first(torch.ones(1, 2)).sum() + second(torch.ones(1, 2)).sum()).backward()
    second.bias.grad[1] = float("inf")
    before_first, before_second = first.weight.detach().clone(), second.weight.detach().clone()
    scaler.step(opt_first)
    scaler.step(opt_second)
    scaler.update()
    assert not torch.equal(first.weight, before_first) and torch.equal(second.weight, before_second)
    assert scaler.get_scale() == 2.0**15 and scaler.skipped_steps == 1 and scaler.last_step_skipped


def test_skip_counters_for_lr_schedulers():
    model, optimizer = model_and_optimizer()
    scaler = GradScaler()
    pattern = [None, float("inf"), float("-inf"), None, float("nan"), None]
    seen = []
    for poison in pattern:
        backward(scaler, model, poison)
        scaler.step(optimizer)
        scaler.update()
        seen.append(scaler.last_step_skipped)
    assert seen == [p is not None for p in pattern] and scaler.skipped_steps == 3
    assert scaler.state_dict()["skipped_steps"] == 3


def test_warns_once_after_a_long_run_of_skips_and_keeps_a_positive_scale():
    model, optimizer = model_and_optimizer()
    scaler = GradScaler(warn_after_skips=20)
    with pytest.warns(RuntimeWarning, match="non-finite at any scale") as record:
        for _ in range(200):  # torch's scale would be 0.0 well before this
            backward(scaler, model, float("nan"))
            scaler.step(optimizer)
            scaler.update()
    assert len([w for w in record if issubclass(w.category, RuntimeWarning)]) == 1
    assert "last 20 optimizer steps were all skipped" in str(record[0].message)
    assert scaler.get_scale() > 0 and scaler.skipped_steps == 200


@pytest.mark.parametrize("path", ["step", "unscale_+step", "with a fused optimizer", "after a load"])
def test_the_skip_warning_fires_at_exactly_warn_after_skips_on_every_path(path):
    # The host reads the run of skips only once it may have reached warn_after_skips (a bound it keeps
    # without syncing: 0 after an iteration it knows was clean, else one more per iteration); the warning
    # must still come at the 5th skip in a row, not earlier nor later, whichever path ran the steps.
    torch.manual_seed(0)
    model, other = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    optimizers = [torch.optim.AdamW(model.parameters(), lr=0.1)]
    if path == "with a fused optimizer":  # its skips are decided in its kernel, never on the host
        optimizers.append(torch.optim.AdamW(other.parameters(), lr=0.1, fused=True))
    scaler = GradScaler(warn_after_skips=5)
    if path == "after a load":  # 3 skips in a row before the checkpoint
        scaler.load_state_dict({**GradScaler().state_dict(), "skipped_steps": 3, "_skip_run": 3})
    pattern = [True] * 3 + [False] + [True] * 6 if path != "after a load" else [True] * 4
    warned_at = []
    for i, poison in enumerate(pattern):
        model.zero_grad()
        other.zero_grad()
        scaler.scale(model(torch.ones(4, 3)).square().mean() + other(torch.ones(4, 3)).sum()).backward()
        if poison:
            model.weight.grad[0, 0] = float("inf")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for optimizer in optimizers:
                if path == "unscale_+step":
                    scaler.unscale_(optimizer)
                scaler.step(optimizer)
            scaler.update()
        warned_at += [(i, str(w.message)) for w in caught if issubclass(w.category, RuntimeWarning)]
    expected = 1 if path == "after a load" else 8  # the 5th skip in a row
    assert [i for i, _ in warned_at] == [expected] and "last 5 optimizer steps" in warned_at[0][1]


def test_raise_at_min_scale_through_the_scaler():
    model, optimizer = model_and_optimizer()
    scaler = GradScaler(rule=DynamicScale(4.0, min_scale=1.0, raise_at_min_scale=True))
    with pytest.raises(RuntimeError, match="already at min_scale=1"):
        for _ in range(5):
            backward(scaler, model, float("inf"))
            scaler.step(optimizer)
            scaler.update()
    assert scaler.get_scale() == 1.0


@pytest.mark.parametrize("rule", [StaticScale(128.0), NoScale()], ids=["static", "none"])
def test_static_and_no_scaling_still_skip_non_finite_steps(rule):
    model, optimizer = model_and_optimizer()
    scaler = GradScaler(rule=rule)
    scale = rule.init_scale
    backward(scaler, model)
    expected = model.weight.grad / scale
    scaler.unscale_(optimizer)
    assert torch.equal(model.weight.grad, expected)
    scaler.step(optimizer)
    scaler.update()
    before = snapshot(model, optimizer)
    backward(scaler, model, float("inf"))
    scaler.step(optimizer)
    scaler.update()
    assert_untouched(before, model, optimizer)
    assert scaler.get_scale() == scale and scaler.skipped_steps == 1


@pytest.mark.parametrize("growth", ["interval", "headroom"])
def test_scaler_state_dict_round_trips_field_by_field(growth):
    model, optimizer = model_and_optimizer()
    scaler = GradScaler(init_scale=2.0**8, growth_interval=2, growth=growth, hysteresis=2, max_scale=2.0**30)
    for poison in (None, float("inf"), None, float("nan"), float("nan"), None):
        backward(scaler, model, poison)
        scaler.step(optimizer)
        scaler.update()
    saved = scaler.state_dict()
    assert saved["skipped_steps"] == 3 and saved["_hysteresis_tracker"] == 0
    created = GradScaler(growth=growth)
    created.scale(torch.ones(()))  # state tensors exist before loading
    lazy = GradScaler(growth=growth)  # state tensors are created after loading, from the loaded values
    for fresh in (created, lazy):
        fresh.load_state_dict(saved)
        for key, value in saved.items():
            assert fresh.state_dict()[key] == value, key
    lazy.scale(torch.ones(()))
    assert lazy.state_dict() == saved


@pytest.mark.parametrize("fused", [False, True])
def test_without_underflow_restart_the_rule_is_torchs_on_all_zero_gradients(fused):
    """All-zero gradients at a scale below 1: the default rule restarts at init_scale, and
    ``underflow_restart=False`` follows torch's scaler bit for bit instead (no amax measured at all)."""
    results = {}
    for name, scaler in {
        "torch": torch.amp.GradScaler("cpu", growth_interval=3),
        "off": GradScaler(rule=DynamicScale(growth_interval=3, underflow_restart=False)),
        "on": GradScaler(rule=DynamicScale(growth_interval=3)),
    }.items():
        scaler.scale(torch.ones(()))
        scaler.update(0.25)  # as after a long run of overflows
        param = torch.nn.Parameter(torch.ones(4))
        optimizer = torch.optim.Adam([param], lr=0.1, fused=fused)
        scales = []
        for _ in range(4):
            optimizer.zero_grad()
            scaler.scale((param * 0.0).sum()).backward()
            scaler.step(optimizer)
            scaler.update()
            scales.append(scaler.get_scale())
        results[name] = scales
    assert results["off"] == results["torch"] == [0.25, 0.25, 0.5, 0.5]
    assert results["on"][0] == 2.0**16  # restarted: zeros under a finite loss are underflow


def test_underflow_restart_is_checked_and_round_trips():
    with pytest.raises(TypeError, match="underflow_restart must be True or False"):
        DynamicScale(underflow_restart="no")
    rule = DynamicScale(underflow_restart=False)
    assert rule.amax_use == "none" and DynamicScale().amax_use == "when_free"
    restored = DynamicScale()
    restored.load_state_dict(rule.state_dict())
    assert restored.underflow_restart is False
