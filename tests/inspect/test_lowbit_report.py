"""`inspect.lowbit_report`: per layer and GEMM operand, error, flushed/saturated shares and outlier blocks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mixprec import lowbit
from mixprec.inspect.fp8 import fp8_report
from mixprec.inspect.lowbit import LowbitReport, lowbit_report


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 16))


def _inputs() -> torch.Tensor:
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    x[:, 5] *= 3000.0  # one outlier channel, as LLM activations have
    return x


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


@pytest.mark.parametrize(
    ("recipe", "share"), [("fp8_tensorwise", 1.0), ("fp8_rowwise", 1.0), ("mxfp8", 0.5), ("nvfp4", 0.25)]
)
def test_an_outlier_channel_sets_the_scale_of_exactly_the_blocks_holding_it(recipe, share) -> None:
    report = lowbit_report(_model(), _inputs(), loss_fn=_loss, recipe=recipe)
    first = report.layers["0"]
    assert (
        first["fprop_x"].outlier_blocks == share
    )  # per tensor: 1 block; rows: all; 1x32: 1 of 2; 1x16: 1 of 4
    assert first["fprop_w"].outlier_blocks == 0.0
    assert set(first) == set(lowbit.OPERANDS)


def test_error_and_flushed_share_are_those_of_the_operand_quantized_alone() -> None:
    x = _inputs()
    report = lowbit_report(_model(), x, loss_fn=_loss, recipe="fp8_tensorwise")
    back = lowbit.quantize(x, "fp8_tensorwise").dequantize()
    stats = report.layers["0"]["fprop_x"]
    assert stats.error == pytest.approx(((back - x).norm() / x.norm()).item(), rel=1e-6)
    assert stats.flushed == pytest.approx(((back == 0) & (x != 0)).float().mean().item(), rel=1e-6)
    assert stats.flushed > 0  # the outlier's scale flushes small values of the other channels
    assert report.layers["0"]["wgrad_x"].error == pytest.approx(
        stats.error, rel=1e-6
    )  # same tensor, transposed


def test_mx_floor_rule_saturation_is_measured_and_the_mxfp8_recipe_has_none() -> None:
    # nn.Linear's uniform init puts block amaxes near 0.12 = 1.97 * 2**-4: the floor rule's scale 2**-12
    # maps them to ~490 > 448 + 16, so every value above (448 + 16) * 2**-12 is clamped.
    weight = _model()[0].weight.detach()
    report = lowbit_report(_model(), _inputs(), loss_fn=_loss, recipe="mxfp8_floor")
    q = lowbit.quantize(weight, "mxfp8_floor")  # torchao's to_mx default, the floor rule
    over = (weight.reshape(64, 2, 32).abs() / q.block_descale()[:, :, None]) > 464
    assert report.layers["0"]["fprop_w"].saturated == pytest.approx(over.float().mean().item())
    assert report.layers["0"]["fprop_w"].saturated > 0.05
    assert report.layers["0"]["fprop_w"].worst_block_saturated >= report.layers["0"]["fprop_w"].saturated
    rounded_up = lowbit_report(_model(), _inputs(), loss_fn=_loss, recipe="mxfp8")  # scales rounded up
    assert all(s.saturated == 0.0 for s in rounded_up.layers["0"].values())


def test_fp8_report_is_the_per_tensor_case_of_the_lowbit_report() -> None:
    # On a plain model fp8_report's dynamic scale is fp8_tensorwise's: the same figures, from one code path.
    x = _inputs()
    mine = fp8_report(_model(), x, loss_fn=_loss, max_flushed=0.5, max_saturated=0.05, max_error=0.2)
    theirs = lowbit_report(_model(), x, loss_fn=_loss, recipe="fp8_tensorwise")
    for name, layer in mine.layers.items():
        for role, operand in (("input", "fprop_x"), ("weight", "fprop_w"), ("grad_output", "dgrad_go")):
            a, b = getattr(layer, role), theirs.layers[name][operand]
            assert (a.underflow, a.saturate, a.error) == (b.flushed, b.saturated, b.error), (name, role)
    assert mine.layers["0"].input.underflow > 0  # the outlier channel's scale flushes the others
    assert mine.keep_in_bf16() == theirs.keep_high_precision()


def test_the_stochastic_rounding_generator_of_a_converted_model_is_not_advanced() -> None:
    generator = torch.Generator().manual_seed(7)
    model = lowbit.convert_to_lowbit_training(_model(), "nvfp4", generator=generator)
    state = generator.get_state()
    lowbit_report(model, _inputs(), loss_fn=_loss, recipe="nvfp4")
    fp8_report(model, _inputs(), loss_fn=_loss)
    assert torch.equal(generator.get_state(), state)


def test_high_precision_operands_are_absent_and_the_filter_keeps_hurt_layers_out() -> None:
    report = lowbit_report(_model(), _inputs(), loss_fn=_loss, recipe="fp8_rowwise_gw_hp")
    assert "wgrad_x" not in report.layers["0"] and "fprop_x" in report.layers["0"]
    x = _inputs()
    x[:, 5] *= 100.0  # 3e5 sigma: under one e4m3 scale the other channels flush
    report = lowbit_report(_model(), x, loss_fn=_loss, recipe="fp8_tensorwise")
    assert report.layers["0"]["fprop_x"].flushed > 0.5
    assert report.keep_high_precision() == ["0"]  # the outlier layer flushes, the second one does not
    filter_fn = report.module_filter_fn()
    model = lowbit.convert_to_lowbit_training(_model(), "fp8_tensorwise", module_filter_fn=filter_fn)
    assert type(model[0]) is nn.Linear and isinstance(model[2], lowbit.LowbitLinear)
    assert "keep in high precision: 0 (" in report.table()
    assert report.to_dict()["keep"] == ["0"]


def test_the_model_is_handed_back_unchanged() -> None:
    model = _model()
    model(torch.randn(2, 64)).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    params = [p.detach().clone() for p in model.parameters()]
    assert isinstance(lowbit_report(model, _inputs(), loss_fn=_loss, recipe="nvfp4"), LowbitReport)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params, strict=True))
    assert not model._forward_hooks and not model[0]._forward_hooks


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="max_flushed must be a number in"):
        lowbit_report(_model(), _inputs(), loss_fn=_loss, recipe="mxfp8", max_flushed=2)
    with pytest.raises(ValueError, match="outlier_ratio must be a number > 1"):
        lowbit_report(_model(), _inputs(), loss_fn=_loss, recipe="mxfp8", outlier_ratio=1)
    with pytest.raises(ValueError, match="unknown low-bit recipe"):
        lowbit_report(_model(), _inputs(), loss_fn=_loss, recipe="mxfp3")
    with pytest.raises(ValueError, match="no nn.Linear"):
        lowbit_report(nn.Sequential(nn.ReLU()), _inputs(), loss_fn=_loss, recipe="mxfp8")


@pytest.mark.parametrize("autocast", [False, True])
def test_a_sequence_model_and_bf16_autocast_are_reported_and_their_gradients_left_alone(autocast) -> None:
    # A transformer's Linear sees (batch, seq, features): the capture's gradient hook returned the
    # gradient flattened to 2-D, which autograd refused ("hook '<lambda>' has changed the size of
    # value"), and on a 2-D bf16 output it returned it in float32 in place of the real gradient.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 16))
    x = torch.randn(4, 8, 64, generator=torch.Generator().manual_seed(1))
    x = x if not autocast else x[0]

    def loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return m(x).float().square().mean()

    loss(model, x).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    for report in (fp8_report(model, x, loss_fn=loss), lowbit_report(model, x, loss_fn=loss, recipe="mxfp8")):
        assert set(report.layers) == {"0", "2"}
    rows = x.numel() // 64
    assert lowbit_report(model, x, loss_fn=loss, recipe="fp8_rowwise").layers["2"]["dgrad_go"].blocks == rows
    loss(model, x).backward()
    assert all(torch.equal(p.grad, e) for p, e in zip(model.parameters(), expected, strict=True))
