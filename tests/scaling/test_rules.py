"""Update rules: validation, torch's rule as oracle, hysteresis/min/max against a plain model, state_dicts."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mixprec.scaling import DynamicScale, HeadroomScale, NoScale, StaticScale
from mixprec.scaling.rules import FLOAT32_TINY

from .helpers import f32, found, no_host_sync

CPU = torch.device("cpu")
flags = st.lists(st.booleans(), min_size=1, max_size=60)


def run(rule, sequence, amax=None):
    rule.ensure_state(CPU)
    history = []
    for flag in sequence:
        rule.update(found(flag), None if amax is None else torch.tensor(amax))
        history.append(rule.get_scale())
    return history


# -- validation ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"growth_factor": 1.0}, "growth_factor"),
        ({"growth_factor": 0.5}, "growth_factor"),
        ({"backoff_factor": 1.0}, "backoff_factor"),
        ({"backoff_factor": 0.0}, "backoff_factor"),
        ({"backoff_factor": -0.5}, "backoff_factor"),
        ({"init_scale": 0.0}, "init_scale"),
        ({"init_scale": -1.0}, "init_scale"),
        ({"init_scale": math.inf}, "init_scale"),
        ({"init_scale": math.nan}, "init_scale"),
        ({"growth_interval": 0}, "growth_interval"),
        ({"growth_interval": 2.5}, "growth_interval"),
        ({"hysteresis": 0}, "hysteresis"),
        ({"min_scale": 0.0}, "min_scale"),
        ({"max_scale": -2.0}, "max_scale"),
        ({"min_scale": 8.0, "max_scale": 4.0, "init_scale": 4.0}, "min_scale"),
        ({"max_scale": 1024.0}, "init_scale"),
        ({"min_scale": 2.0**20}, "init_scale"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(kwargs, named):
    with pytest.raises(ValueError, match=named):
        DynamicScale(**kwargs)


def test_setters_validate_too():
    rule = DynamicScale()
    with pytest.raises(ValueError, match=r"growth_factor must be > 1, got 0\.9"):
        rule.growth_factor = 0.9
    with pytest.raises(ValueError, match=r"backoff_factor must be in \(0, 1\), got 2"):
        rule.backoff_factor = 2
    with pytest.raises(ValueError, match="growth_interval"):
        rule.growth_interval = -3


def test_headroom_arguments_are_validated():
    with pytest.raises(ValueError, match="margin"):
        HeadroomScale(margin=0.5)
    with pytest.raises(ValueError, match="unknown format 'fp17'"):
        HeadroomScale(format="fp17")


# -- torch's rule as the oracle -----------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(
    sequence=flags,
    init_exponent=st.integers(-10, 30),
    init_mantissa=st.sampled_from([1.0, 1.5, 3.0 / 4.0 * 1.1]),
    growth_factor=st.sampled_from([2.0, 1.5, 4.0, 1.1, 3.0]),
    backoff_factor=st.sampled_from([0.5, 0.25, 0.3, 0.9, 1 / 3]),
    growth_interval=st.integers(1, 5),
)
def test_dynamic_scale_matches_torch_update_bit_for_bit(
    sequence, init_exponent, init_mantissa, growth_factor, backoff_factor, growth_interval
):
    init = init_mantissa * 2.0**init_exponent
    rule = DynamicScale(init, growth_factor, backoff_factor, growth_interval)
    rule.ensure_state(CPU)
    scale = torch.full((), init, dtype=torch.float32)
    tracker = torch.zeros((), dtype=torch.int32)
    for flag in sequence:
        torch._amp_update_scale_(scale, tracker, found(flag), growth_factor, backoff_factor, growth_interval)
        rule.update(found(flag))
        if scale.item() < FLOAT32_TINY:  # torch heads for 0 here; mixprec stops at the floor
            assert rule.get_scale() == f32(FLOAT32_TINY)
            return
        assert rule.get_scale() == scale.item()
        assert rule.get_growth_tracker() == tracker.item()


def reference(sequence, init, growth, backoff, interval, hysteresis, low, high):
    """The documented algorithm in plain Python floats (rounded to float32 like the tensor)."""
    scale, tracker, left, out = f32(init), 0, hysteresis, []
    for flag in sequence:
        if flag:
            tracker, left = 0, max(left - 1, 0)
            if left == 0:
                scale = max(f32(scale * backoff), low)
        else:
            tracker += 1
            if tracker >= interval:
                tracker, left = 0, hysteresis
                if math.isfinite(f32(scale * growth)):
                    scale = min(f32(scale * growth), high)
        out.append(scale)
    return out


@settings(max_examples=150, deadline=None)
@given(
    sequence=flags,
    hysteresis=st.integers(1, 4),
    interval=st.integers(1, 4),
    low_exponent=st.one_of(st.none(), st.integers(-4, 8)),
    span=st.one_of(st.none(), st.integers(0, 8)),
)
def test_hysteresis_floor_and_cap_follow_the_documented_algorithm(
    sequence, hysteresis, interval, low_exponent, span
):
    low = None if low_exponent is None else 2.0**low_exponent
    high = None if span is None else 2.0 ** ((low_exponent or 0) + span)
    init = 2.0 ** ((low_exponent or 0) + (span or 0) // 2)
    rule = DynamicScale(init, 2.0, 0.5, interval, hysteresis=hysteresis, min_scale=low, max_scale=high)
    expected = reference(
        sequence, init, 2.0, 0.5, interval, hysteresis, low or f32(FLOAT32_TINY), high or math.inf
    )
    got = run(rule, sequence)
    assert got == expected
    assert all((low or 0) <= s <= (high or math.inf) and s > 0 for s in got)


@settings(max_examples=60, deadline=None)
@given(hysteresis=st.integers(2, 6), gap=st.integers(1, 5))
def test_isolated_overflows_within_hysteresis_do_not_back_off(hysteresis, gap):
    rule = DynamicScale(1024.0, growth_interval=1000, hysteresis=hysteresis)
    sequence = ([True] + [False] * gap) * (hysteresis - 1)
    assert run(rule, sequence)[-1] == 1024.0
    assert run(rule, [True])[-1] == 512.0  # the hysteresis-th overflow backs off


def test_scale_never_collapses_to_zero():
    rule = DynamicScale()
    history = run(rule, [True] * 400)
    assert min(history) == f32(FLOAT32_TINY) > 0
    assert math.isfinite(1 / history[-1])


def test_growth_stops_short_of_inf_as_in_torch():
    rule = DynamicScale(2.0**127, growth_interval=1)
    assert run(rule, [False] * 3) == [2.0**127] * 3


def test_lowering_the_interval_below_the_tracker_grows_at_the_next_good_step():
    rule = DynamicScale(8.0, growth_interval=10)
    run(rule, [False] * 5)
    rule.growth_interval = 3  # torch compares with ==, so its tracker would run on past 3 and never grow
    assert run(rule, [False]) == [16.0]


def test_raise_at_min_scale():
    # The scaler calls after_skip() when a step is skipped, before update() backs off.
    rule = DynamicScale(4.0, min_scale=2.0, raise_at_min_scale=True)
    rule.ensure_state(CPU)
    rule.after_skip()  # overflow at 4: back off to the floor, no error
    run(rule, [True])
    with pytest.raises(RuntimeError, match="min_scale=2"):
        rule.after_skip()  # overflow again at the floor: stuck
    quiet = DynamicScale(4.0, min_scale=4.0)
    quiet.ensure_state(CPU)
    quiet.after_skip()  # off by default


def test_update_does_not_sync():
    for rule in (
        DynamicScale(hysteresis=2, min_scale=1.0, max_scale=2.0**20),
        HeadroomScale(),
        StaticScale(8.0),
    ):
        rule.ensure_state(CPU)
        with no_host_sync():
            for flag in (True, False, False, True):
                rule.update(found(flag), torch.tensor(1e-3))


# -- static and none ----------------------------------------------------------------------------------


def test_static_and_no_scale_never_move():
    assert run(StaticScale(128.0), [True, False, True]) == [128.0] * 3
    assert run(NoScale(), [True, False]) == [1.0, 1.0]
    assert NoScale().is_identity and not StaticScale(1.0).is_identity
    with pytest.raises(ValueError, match="NoScale keeps the scale at 1"):
        NoScale().set_scale(2.0)
    with pytest.raises(ValueError, match="scale must be a finite number > 0, got -1"):
        StaticScale(-1)


# -- state_dict round trips ---------------------------------------------------------------------------


def configured_rules():
    return [
        StaticScale(96.0),
        NoScale(),
        DynamicScale(
            3.0, 1.5, 0.25, 7, hysteresis=3, min_scale=0.5, max_scale=2.0**12, raise_at_min_scale=True
        ),
        HeadroomScale(64.0, 4.0, 0.5, 9, format="bf16", margin=8.0, hysteresis=2, max_scale=2.0**40),
    ]


@pytest.mark.parametrize("index", range(4))
@pytest.mark.parametrize("created", [True, False])
def test_state_dict_round_trips_field_by_field(index, created):
    rule = configured_rules()[index]
    if created:
        run(rule, [False, True, False, False], amax=1e-4)
    saved = rule.state_dict()
    fresh = type(rule)() if isinstance(rule, (NoScale, DynamicScale)) else type(rule)(1.0)
    fresh.load_state_dict(saved)
    restored = fresh.state_dict()
    for key, value in saved.items():
        assert restored[key] == value, key
    fresh.ensure_state(CPU)  # lazily created tensors take the loaded values
    assert fresh.state_dict() == saved


def test_loading_a_different_rule_is_refused():
    with pytest.raises(ValueError, match="saved from a HeadroomScale rule; this scaler uses StaticScale"):
        StaticScale(2.0).load_state_dict(HeadroomScale().state_dict())
    HeadroomScale().load_state_dict(DynamicScale(8.0).state_dict())  # a subclass accepts its base


def test_loads_torch_keys():
    torch_keys = {"scale": 512.0, "growth_factor": 4.0, "backoff_factor": 0.25, "growth_interval": 11}
    rule = DynamicScale(hysteresis=2)
    rule.load_state_dict({**torch_keys, "_growth_tracker": 5})
    state = rule.state_dict()
    assert {k: state[k] for k in torch_keys} == torch_keys
    assert state["_growth_tracker"] == 5 and state["hysteresis"] == 2
    with pytest.raises(ValueError, match=r"state_dict\['scale'\]"):
        rule.load_state_dict({**torch_keys, "_growth_tracker": 0, "scale": 0.0})


@pytest.mark.parametrize("hysteresis", [1, 2])
def test_the_floor_applies_on_back_off_only(hysteresis):
    """A scale set below min_scale stays until an overflow backs off, which then lands on the floor."""
    rule = DynamicScale(4.0, min_scale=2.0, hysteresis=hysteresis)
    rule.ensure_state(torch.device("cpu"))
    rule.set_scale(1.0)
    rule.update(found(False))
    assert rule.get_scale() == 1.0
    for _ in range(hysteresis):
        rule.update(found(True))
    assert rule.get_scale() == 2.0
