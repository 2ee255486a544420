"""The scaling math and the delayed recipe, step by step; config validation."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mixprec import formats
from mixprec.float8 import Float8Config, Float8Linear
from mixprec.lowbit.history import amax_to_scale, delayed_scale, push_amax, to_float8

E4M3, E5M2 = formats.FP8_E4M3FN, formats.FP8_E5M2


@pytest.mark.parametrize(
    ("kwargs", "name", "error"),
    [
        ({"scaling": "static"}, "scaling", ValueError),
        ({"scaling": None}, "scaling", ValueError),
        ({"amax_history_len": 0}, "amax_history_len", ValueError),
        ({"amax_history_len": -3}, "amax_history_len", ValueError),
        ({"amax_history_len": 2.5}, "amax_history_len", TypeError),
        ({"amax_history_len": True}, "amax_history_len", TypeError),
        ({"margin": -1}, "margin", ValueError),
        ({"margin": 0.5}, "margin", TypeError),
        ({"amax_compute_algo": "mean"}, "amax_compute_algo", ValueError),
        ({"emulate": "yes"}, "emulate", TypeError),
    ],
)
def test_config_errors_name_the_argument(kwargs, name, error) -> None:
    with pytest.raises(error, match=name):
        Float8Config(**kwargs)


def test_config_is_a_hashable_value() -> None:
    assert Float8Config(scaling="delayed") == Float8Config(scaling="delayed")
    assert len({Float8Config(), Float8Config(), Float8Config(margin=1)}) == 2
    with pytest.raises(TypeError, match="config"):
        Float8Linear(4, 4, config={"scaling": "delayed"})


def test_scale_maps_amax_to_the_format_max() -> None:
    amax = torch.tensor(3.5)
    assert float(amax_to_scale(amax, E4M3)) == pytest.approx(448 / 3.5, rel=1e-7)
    assert float(amax_to_scale(amax, E5M2, margin=2)) == pytest.approx(57344 / 3.5 / 4, rel=1e-7)
    assert math.isfinite(float(amax_to_scale(torch.tensor(0.0), E4M3)))  # all-zero tensor: EPS


def test_cast_saturates_both_formats_and_keeps_nan() -> None:
    x = torch.tensor([1.0, -1e9, 1e9, float("inf"), float("nan")])
    for fmt in (E4M3, E5M2):
        y = to_float8(x, torch.tensor(1.0), fmt).float()
        assert y[:4].tolist() == [1.0, -fmt.max, fmt.max, fmt.max]
        assert math.isnan(y[4])


def test_history_push_is_newest_first_and_skips_non_finite() -> None:
    history = torch.zeros(3)
    for value in (1.0, 2.0, float("inf"), 3.0, float("nan"), 4.0):
        push_amax(history, torch.tensor(value))
    assert history.tolist() == [4.0, 3.0, 2.0]


def test_delayed_scale_from_history_max_or_most_recent() -> None:
    history = torch.tensor([2.0, 8.0, 4.0])
    current = torch.tensor(100.0)
    assert float(delayed_scale(history, current, E4M3, 0, "max")) == 448 / 8
    assert float(delayed_scale(history, current, E4M3, 1, "most_recent")) == 448 / 2 / 2
    assert float(delayed_scale(torch.zeros(3), current, E4M3, 0, "max")) == pytest.approx(4.48)
    assert math.isnan(float(delayed_scale(history, torch.tensor(float("inf")), E4M3, 0, "max")))


def _step(layer: Float8Linear, x: torch.Tensor) -> tuple[torch.Tensor, float]:
    """One forward and backward; the relative error of the output against fp32."""
    x = x.detach().requires_grad_()
    out = layer(x)
    out.sum().backward()
    ref = F.linear(x, layer.weight, layer.bias)
    return out, float((out - ref).detach().norm() / ref.detach().norm())


def test_a_100x_spike_saturates_its_step_and_rescales_the_next() -> None:
    torch.manual_seed(0)
    layer = Float8Linear(32, 16, config=Float8Config(scaling="delayed", amax_history_len=4))
    xs = [torch.randn(8, 32) for _ in range(5)]
    xs[3] = xs[3] * 100.0  # the spike arrives at step 3
    errors, scales = [], []
    for step, x in enumerate(xs):
        history_before = layer.amax_history[0].clone()
        _, error = _step(layer, x)
        errors.append(error)
        scales.append(layer.last_scale()["input"])
        amax = float(x.abs().max())
        assert layer.amax_history[0, 0] == amax  # the step's amax is pushed after use
        expected = 448 / (float(history_before.max()) if step else amax)
        assert scales[-1] == pytest.approx(expected, rel=1e-6)
    # step 3 was cast with the scale of the quiet steps: ~100x too large, so most of it saturates
    spike = xs[3].abs() * scales[3]
    assert (spike > 448).float().mean() > 0.5
    assert errors[3] > 0.5 and max(errors[:3]) < 0.1
    # step 4 sees the spike in its history: its scale is ~100x smaller, and it no longer saturates
    assert scales[4] == pytest.approx(448 / float(xs[3].abs().max()), rel=1e-6)
    assert scales[4] < scales[2] / 30
    assert (xs[4].abs() * scales[4] > 448).sum() == 0


def test_dynamic_scaling_absorbs_the_same_spike() -> None:
    torch.manual_seed(0)
    layer = Float8Linear(32, 16)
    _, error = _step(layer, torch.randn(8, 32) * 100.0)
    assert error < 0.1
    assert layer.amax_history is None and "amax_history" not in layer.state_dict()


def test_grad_output_history_advances_in_backward_with_e5m2() -> None:
    layer = Float8Linear(8, 4, config=Float8Config(scaling="delayed", amax_history_len=2))
    x = torch.randn(3, 8)
    out = layer(x)
    assert layer.amax_history[2].tolist() == [0.0, 0.0]
    out.backward(torch.full_like(out, 0.5))
    assert layer.amax_history[2].tolist() == [0.5, 0.0]
    assert layer.last_scale()["grad_output"] == 57344 / 0.5


def test_eval_mode_reads_the_history_without_writing() -> None:
    layer = Float8Linear(8, 4, config=Float8Config(scaling="delayed"))
    layer(torch.randn(2, 8)).sum().backward()
    before = layer.amax_history.clone()
    layer.eval()
    with torch.no_grad():
        layer(torch.randn(2, 8) * 50)
    assert torch.equal(layer.amax_history, before)
    assert layer.last_scale()["input"] == pytest.approx(448 / float(before[0].max()))


def test_non_finite_input_gives_non_finite_output_and_spares_the_history() -> None:
    for scaling in ("dynamic", "delayed"):
        layer = Float8Linear(8, 4, config=Float8Config(scaling=scaling))
        layer(torch.randn(2, 8)).sum().backward()
        history = None if layer.amax_history is None else layer.amax_history.clone()
        x = torch.randn(2, 8)
        x[0, 3] = float("inf")
        out = layer(x)
        assert not torch.isfinite(out).all()  # an overflow is not hidden by saturation
        if history is not None:
            assert torch.equal(layer.amax_history[0], history[0])
