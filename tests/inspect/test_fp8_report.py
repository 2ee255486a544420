"""mixprec.inspect.fp8.fp8_report: per-layer fp8 losses, the suggested filter, the model left as it was."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mixprec.float8 import Float8Config, convert_to_float8_training
from mixprec.inspect.fp8 import fp8_report, plot_fp8_report


class Outlier(nn.Module):
    """Multiplies one input feature by 1e7: the dynamic scale of the next layer's input is set by it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.cat([torch.full((1,), 1e7), torch.ones(x.shape[-1] - 1)])


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), Outlier(), nn.Linear(32, 8))


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).float().pow(2).mean()


def test_figures_match_a_hand_computation() -> None:
    model = _model()
    x = torch.randn(4, 16)
    report = fp8_report(model, x, loss_fn=_loss)
    first = report.layers["0"]
    assert first.input.format == "fp8_e4m3fn" and first.grad_output.format == "fp8_e5m2"
    assert first.input.amax == float(x.abs().max())
    assert first.input.scale == pytest.approx(448 / float(x.abs().max()), rel=1e-6)
    w = model[0].weight.detach()
    q = (w * first.weight.scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() / first.weight.scale
    assert first.weight.error == pytest.approx(float((q - w).norm() / w.norm()), rel=1e-5)
    assert first.input.saturate == 0.0  # the dynamic scale maps the amax onto the format's max
    hidden = model[2](model[1](model[0](x))).detach()
    scaled = hidden * (448 / hidden.abs().max())
    flushed = ((hidden != 0) & (scaled.abs() < 2.0**-10)).sum() / (hidden != 0).sum()
    assert report.layers["3"].input.underflow == pytest.approx(float(flushed))


def test_the_outlier_layer_is_suggested_for_bf16_and_the_filter_skips_it() -> None:
    model = _model()
    report = fp8_report(model, torch.randn(4, 16), loss_fn=_loss)
    assert report.layers["3"].input.underflow > 0.5
    # the outlier also scales the gradient flowing back into layer 0: its e5m2 grad_output underflows
    assert report.keep_in_bf16() == ["0", "3"]
    assert report.reasons("3") == [f"input underflow {report.layers['3'].input.underflow:.2%} > 1.00%"]
    assert [r.split()[:2] for r in report.reasons("0")] == [["grad_output", "underflow"]]
    plain = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    assert fp8_report(plain, torch.randn(4, 16), loss_fn=_loss).keep_in_bf16() == []
    convert_to_float8_training(model, module_filter_fn=report.module_filter_fn())
    assert type(model[0]) is nn.Linear and type(model[3]) is nn.Linear
    text = report.table()
    assert "keep in bf16: 0 (grad_output underflow" in text and "grad_output" in text
    assert report.to_dict()["keep_in_bf16"] == ["0", "3"]


def test_delayed_history_that_lags_shows_as_saturation_and_the_model_is_restored() -> None:
    torch.manual_seed(1)
    model = convert_to_float8_training(
        nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4)), config=Float8Config(scaling="delayed")
    )
    model(torch.randn(8, 16)).sum().backward()
    before = copy.deepcopy(model.state_dict())
    grads = [p.grad.clone() for p in model.parameters()]
    report = fp8_report(model, torch.randn(8, 16) * 100, loss_fn=_loss)  # a 100x spike
    assert report.layers["0"].input.saturate > 0.5
    assert report.layers["0"].input.scale == pytest.approx(448 / float(before["0.amax_history"][0].max()))
    assert "0" in report.keep_in_bf16()
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key  # histories not advanced by the measurement
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))


@pytest.mark.parametrize("name", ["max_flushed", "max_saturated", "max_error"])
def test_bad_threshold_names_itself(name: str) -> None:
    with pytest.raises(ValueError, match=name):
        fp8_report(_model(), torch.randn(2, 16), loss_fn=_loss, **{name: 1.5})


def test_the_thresholds_have_lowbit_reports_names_only() -> None:
    model = _model()
    x = torch.randn(4, 16)
    new = fp8_report(model, x, loss_fn=_loss, max_flushed=0.99, max_saturated=0.2)
    assert (new.max_flushed, new.max_saturated) == (0.99, 0.2) and new.keep_in_bf16() == []
    assert fp8_report(model, x, loss_fn=_loss).keep_in_bf16() == ["0", "3"]  # the values are the ones used
    for old in ("max_underflow", "max_saturate"):  # the names before lowbit_report's: gone, not aliased
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{old}'"):
            fp8_report(model, x, loss_fn=_loss, **{old: 0.5})
        with pytest.raises(AttributeError, match=old):
            getattr(new, old)


def test_model_without_linear_layers_is_refused() -> None:
    with pytest.raises(ValueError, match="nn.Linear"):
        fp8_report(nn.Sequential(nn.ReLU()), torch.randn(2, 3), loss_fn=lambda m, x: m(x).sum())


def test_plot_writes_a_png(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    report = fp8_report(_model(), torch.randn(4, 16), loss_fn=_loss)
    path = plot_fp8_report(report, tmp_path / "fp8.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(TypeError, match="report"):
        plot_fp8_report({"layers": {}}, tmp_path / "x.png")
