"""underflow_report: gradient underflow per module vs the loss scale, and the scale that avoids it."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from mixprec import formats
from mixprec.inspect import GradStats, Log2Histogram, UnderflowReport, demo, underflow_report


@pytest.fixture(scope="module")
def reports():
    torch.set_num_threads(1)
    inputs = demo.demo_inputs()
    return {
        scale: underflow_report(demo.healthy_model(), inputs, loss_fn=demo.tiny_loss, scale=scale)
        for scale in (1.0, 2.0**16)
    }


def test_gradients_underflow_at_scale_1_and_not_at_2_16(reports):
    low, high = reports[1.0], reports[2.0**16]
    acts_low, acts_high = low.overall_activations, high.overall_activations
    # At scale 1 most activation gradients are lost to fp16: a third flushed to zero, the rest subnormal.
    assert acts_low.underflow > 0.6 and acts_low.flushed_fraction > 0.25
    assert low.overall_parameters.underflow > 0.5
    # At 2^16 nothing is flushed and only the far tail (under 2%) is still subnormal.
    assert acts_high.flushed == 0 and high.overall_parameters.flushed == 0
    assert acts_high.underflow < 0.02 and high.overall_parameters.underflow < 0.03
    # "Already zero" (ReLU) is the same at both scales and not counted as underflow.
    assert acts_low.already_zero == acts_high.already_zero > 0
    assert f"{acts_low.underflow:.1%} of activation gradients" in str(low)
    assert str(low).startswith("At loss scale 2^0,") and str(high).startswith("At loss scale 2^16,")


def test_per_module_entries_and_table(reports):
    report = reports[1.0]
    assert list(report.activations) == [f"blocks.{i}.{part}" for i in range(4) for part in ("fc", "act")] + [
        "head"
    ]
    assert list(report.parameters) == [f"blocks.{i}.fc" for i in range(4)] + ["head"]
    assert report.activations["blocks.0.fc"].count == 8 * 32
    assert report.parameters["head"].count == 33
    # Gradients shrink on the way back: the first block loses more than the last.
    assert (
        report.parameters["blocks.0.fc"].flushed_fraction > report.parameters["blocks.3.fc"].flushed_fraction
    )
    table = report.table()
    assert "blocks.0.act" in table and table.splitlines()[-1].startswith("overall")


def test_recommended_scale_meets_target_without_overflow(reports):
    report = reports[1.0]
    scale = report.recommended_scale
    assert scale is not None and 2.0**16 < scale <= report.max_safe_scale
    assert report.underflow_at(scale) <= report.target < report.underflow_at(scale / 2)
    assert report.overall.amax * scale * report.margin <= formats.FP16.max
    assert f"scale {int(math.log2(scale))}" not in str(report) and f"2^{int(math.log2(scale))}" in str(report)


def test_histogram_figures_match_the_exact_count_at_powers_of_two(reports):
    low, high = reports[1.0], reports[2.0**16]
    exact = high.overall_activations
    assert low.underflow_at(2.0**16, "activation") == pytest.approx(exact.underflow, abs=1e-12)
    assert low.flushed_at(2.0**16, "activation") == 0.0
    assert low.underflow_at(1.0, "activation") == pytest.approx(low.overall_activations.underflow, abs=1e-12)
    assert low.flushed_at(1.0) == pytest.approx(low.overall.flushed_fraction, abs=1e-12)
    with pytest.raises(ValueError, match="kind must be one of"):
        low.underflow_at(1.0, "weights")


def test_bf16_loses_nothing_and_fp8_has_no_safe_scale():
    inputs, model = demo.demo_inputs(), demo.healthy_model()
    bf16 = underflow_report(model, inputs, loss_fn=demo.tiny_loss, dtype=torch.bfloat16)
    assert bf16.overall.underflow == 0 and bf16.recommended_scale == 1.0
    e4m3 = underflow_report(model, inputs, loss_fn=demo.scaled_loss(1.0), dtype="e4m3")
    assert e4m3.format is formats.FP8_E4M3FN and e4m3.recommended_scale is None
    assert "no power-of-two scale" in str(e4m3)


def test_arguments_are_checked():
    model, inputs = demo.healthy_model(), demo.demo_inputs()
    for kwargs, message in [
        ({"scale": 0.0}, "scale must be"),
        ({"scale": math.inf}, "scale must be"),
        ({"target": 1.0}, "target must be"),
        ({"margin": 0.5}, "margin must be"),
        ({"dtype": "fp12"}, "unknown format"),
    ]:
        with pytest.raises(ValueError, match=message):
            underflow_report(model, inputs, loss_fn=demo.tiny_loss, **kwargs)


def test_a_nonfinite_loss_is_refused_and_the_model_is_unchanged():
    # was: a report of 0.0% underflow and "scale 2^0 keeps underflow at 0.00%" for a model whose weights
    # were nan (every gradient nan, none counted)
    model, inputs = demo.healthy_model(), demo.demo_inputs()
    with torch.no_grad():
        model.blocks[0].fc.weight[0, 0] = float("nan")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"loss_fn returned nan .* no finite gradients .*find_nonfinite"):
        underflow_report(model, inputs, loss_fn=demo.tiny_loss)
    after = model.state_dict()
    assert all(_same(v, before[k]) for k, v in after.items())
    assert all(p.grad is None for p in model.parameters())


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def test_shared_module_counts_both_calls():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(self.fc(x)).sum(dim=1, keepdim=True)

    report = underflow_report(Twice(), torch.randn(2, 4), loss_fn=lambda m, x: m(x).sum())
    assert report.activations["fc"].count == 2 * 2 * 4
    assert isinstance(report, UnderflowReport)


values = (
    st.floats(min_value=-(2.0**100), max_value=2.0**100, width=32)
    | st.builds(lambda m, e: m * 2.0**e, st.floats(-1, 1, width=32), st.integers(-149, 20))
    | st.sampled_from(
        [0.0, -0.0, 2.0**-25, 2.0**-24, 2.0**-14, 2.0**-15, 65504.0, 65520.0, math.inf, -math.inf]
    )
)


@settings(max_examples=60, deadline=None)
@given(st.lists(values, min_size=1, max_size=40), st.sampled_from([1.0, 2.0**-3, 2.0**10, 3.0]))
def test_grad_stats_agree_with_the_format_element_by_element(data, scale):
    fmt = formats.FP16
    stats = GradStats.measure(torch.tensor(data, dtype=torch.float32), fmt, scale)
    floats = [float(torch.tensor(v, dtype=torch.float32)) for v in data]
    assert stats.count == len(data)
    assert stats.already_zero == sum(v == 0 for v in floats)
    assert stats.flushed == sum(fmt.underflows(v, scale) for v in floats)
    assert stats.subnormal == sum(fmt.is_subnormal(v, scale) and v != 0 for v in floats)
    assert stats.overflow == sum(fmt.overflows(v, scale) for v in floats)


@settings(max_examples=40, deadline=None)
@given(st.lists(values, min_size=0, max_size=40), st.integers(-150, 130))
def test_log2_histogram_counts_and_round_trips(data, bound):
    histogram = Log2Histogram()
    tensor = torch.tensor(data, dtype=torch.float32)
    histogram.add(tensor)
    finite = [float(v) for v in tensor if math.isfinite(v) and v != 0]
    assert histogram.count_below(bound) == sum(abs(v) < 2.0**bound for v in finite)
    assert histogram.total == len(data)
    copy = Log2Histogram.from_dict(histogram.to_dict())
    assert torch.equal(copy.counts, histogram.counts)
    assert (copy.zeros, copy.nonfinite) == (histogram.zeros, histogram.nonfinite)


def test_log2_histogram_rejects_bad_records():
    with pytest.raises(ValueError, match="not a log2 histogram"):
        Log2Histogram.from_dict({"counts": [1]})
    with pytest.raises(ValueError, match="outside float32's range"):
        Log2Histogram.from_dict({"low": 127, "counts": [1, 2]})
