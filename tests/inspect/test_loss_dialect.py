"""Every report takes the planner's ``loss_fn(model, batch)``; the old ``loss_fn(output)`` still works for a
release, with a DeprecationWarning, and measures exactly the same."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from mixprec.inspect import demo, find_nonfinite, fp8_report, lowbit_report, underflow_report
from mixprec.inspect._modules import _required_positional, model_loss


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


def _x() -> torch.Tensor:
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(1))


REPORTS = {
    "fp8_report": lambda m, x, loss: fp8_report(m, x, loss_fn=loss).table(),
    "lowbit_report": lambda m, x, loss: lowbit_report(m, x, loss_fn=loss, recipe="mxfp8").table(),
    "underflow_report": lambda m, x, loss: underflow_report(m, x, loss_fn=loss, scale=8.0).table(),
}


@pytest.mark.parametrize("name", sorted(REPORTS))
def test_the_output_form_warns_and_measures_the_same(name: str) -> None:
    run = REPORTS[name]
    new = run(_model(), _x(), lambda m, x: m(x).float().square().mean())
    warned = rf"{name}: loss_fn\(output\) is deprecated.*loss_fn\(model, batch\)"
    with pytest.warns(DeprecationWarning, match=warned):
        old = run(_model(), _x(), lambda out: out.float().square().mean())
    assert old == new


def test_find_nonfinite_both_forms_find_the_same_op() -> None:
    inputs = demo.demo_inputs()
    new = find_nonfinite(demo.backward_overflow_model(), inputs, loss_fn=demo.scaled_loss(2.0**8))
    with pytest.warns(DeprecationWarning, match="find_nonfinite: loss_fn"):
        old = find_nonfinite(
            demo.backward_overflow_model(), inputs, loss_fn=lambda out: out.float().square().mean() * 2.0**8
        )
    assert new is not None and old == new


def test_the_model_form_gets_the_batch_as_given() -> None:
    seen = []

    def loss_fn(model: nn.Module, batch: dict) -> torch.Tensor:
        seen.append(sorted(batch))
        return model(batch["x"]).sum()

    fp8_report(_model(), {"x": _x(), "y": 0}, loss_fn=loss_fn)
    assert seen == [["x", "y"]]  # a dict batch is the loss's to unpack, not splatted into the model


def test_which_form_a_callable_is() -> None:
    assert _required_positional(lambda out: out) == 1
    assert _required_positional(lambda model, batch: model) == 2
    assert _required_positional(lambda out, scale=2.0: out) == 1  # an optional argument is not the batch
    assert _required_positional(lambda *args: args) is None  # unknown: taken as the model form
    assert _required_positional(functools.partial(lambda model, batch, k: model, k=1)) == 2
    refused = r"lowbit_report: loss_fn must be callable loss_fn\(model, batch\).*got 3"
    with pytest.raises(TypeError, match=refused):
        model_loss(3, "lowbit_report")
