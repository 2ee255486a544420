"""growth="headroom": reach a good scale in a few steps where the interval rule needs thousands."""

from __future__ import annotations

import itertools
import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mixprec.scaling
from mixprec import formats
from mixprec.scaling import HeadroomScale

from .helpers import found

FP16_MAX = formats.FP16.max


def fp16_backward(
    param: torch.nn.Parameter, true_grad: torch.Tensor, scale: float, spike: float = math.inf
) -> None:
    """What an fp16 backward hands over: the scaled gradient rounded to fp16 (tiny values flush to zero,
    large ones overflow to inf). ``spike``: an activation gradient that overflows above that scale."""
    scaled = (true_grad * scale).half().float()
    if scale > spike:
        scaled[0] = math.inf
    param.grad = scaled


def train(scaler, true_grad, steps, spike=math.inf):
    param = torch.nn.Parameter(torch.zeros_like(true_grad))
    optimizer = torch.optim.SGD([param], lr=0.0)
    scales, underflow = [], []
    for _ in range(steps):
        scaler.scale(torch.ones(()))
        fp16_backward(param, true_grad, scaler.get_scale(), spike)
        underflow.append((param.grad == 0).float().mean().item())
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, underflow


def tiny_gradients():
    generator = torch.Generator().manual_seed(0)
    return torch.randn(10_000, generator=generator) * 1e-12  # amax ~4e-12: at 2**16 most flush to 0 in fp16


def test_tiny_gradients_reach_a_good_scale_in_a_few_steps():
    true_grad = tiny_gradients()
    amax = true_grad.abs().max().item()
    good = formats.max_safe_scale(amax, formats.FP16, margin=32.0)  # the largest scale with 5 doublings spare
    headroom, headroom_underflow = train(mixprec.scaling.GradScaler(growth="headroom"), true_grad, 5)
    interval, interval_underflow = train(mixprec.scaling.GradScaler(), true_grad, 5)
    assert headroom[0] == good and headroom[-1] == good  # one update, then stable
    assert interval[-1] == 2.0**16
    doublings = math.log2(good / 2.0**16)
    assert doublings >= 30  # the interval rule needs >= 30 * 2000 = 60,000 clean steps for the same
    assert interval_underflow[-1] > 0.3 and headroom_underflow[-1] < 0.001  # share of gradients lost to 0
    assert amax * headroom[-1] * 32.0 <= FP16_MAX < amax * headroom[-1] * 32.0 * 2


def test_still_backs_off_on_overflow_and_does_not_jump_back():
    true_grad = tiny_gradients()
    # An activation gradient overflows above 2**30, well below where the parameter gradients would allow.
    scales, _ = train(mixprec.scaling.GradScaler(growth="headroom"), true_grad, 60, spike=2.0**30)
    peak = scales.index(max(scales))
    assert peak == 0 and scales[0] > 2.0**40  # the first jump, from the parameter gradients alone
    assert all(t <= s for s, t in itertools.pairwise(scales))  # from there only down: never jumps back up
    skipped = sum(1 for s, t in itertools.pairwise(scales) if t < s)
    assert skipped == math.log2(scales[0] / 2.0**30)  # one back-off per doubling above the spike
    assert scales[-1] == 2.0**30 and scales[-20:] == [scales[-1]] * 20  # settled, no more overflow


def test_interval_growth_still_applies():
    scaler = mixprec.scaling.GradScaler(growth="headroom", growth_interval=2)
    scales, _ = train(scaler, torch.zeros(4), 4)  # all-zero gradients carry no headroom information
    assert scales == [2.0**16, 2.0**17, 2.0**17, 2.0**18]


@settings(max_examples=200, deadline=None)
@given(
    amax_exponent=st.floats(-60, 20),
    scale_exponent=st.integers(-10, 60),
    margin=st.sampled_from([1.0, 2.0, 32.0, 100.0]),
    growth_factor=st.sampled_from([2.0, 4.0, 1.5]),
    fmt=st.sampled_from(["fp16", "bf16", "e4m3"]),
    cap_exponent=st.one_of(st.none(), st.integers(0, 80)),
)
def test_headroom_jump_is_the_largest_safe_one(
    amax_exponent, scale_exponent, margin, growth_factor, fmt, cap_exponent
):
    amax, scale = 2.0**amax_exponent, 2.0**scale_exponent
    cap = None if cap_exponent is None else max(2.0**cap_exponent, scale)
    rule = HeadroomScale(scale, growth_factor, 0.5, 10**6, format=fmt, margin=margin, max_scale=cap)
    rule.ensure_state(torch.device("cpu"))
    rule.update(found(False), torch.tensor(amax))
    new = rule.get_scale()
    limit = formats.get(fmt).max
    assert new >= scale and new <= (cap or math.inf) and math.isfinite(new)
    if new > scale:
        assert amax * new * margin <= limit
    next_up = new * growth_factor
    assert amax * next_up * margin > limit or next_up > (cap or torch.finfo(torch.float32).max)
    rule.update(found(True), torch.tensor(math.nan))  # overflow backs off as in DynamicScale
    assert rule.get_scale() == new * 0.5
