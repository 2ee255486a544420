"""Every report takes the planner's ``loss_fn(model, batch)``, and only that: a one-argument
``loss_fn(output)`` is refused before the model runs, with the wrapper that makes it one."""

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


@pytest.mark.parametrize("name", [*sorted(REPORTS), "find_nonfinite"])
def test_the_output_form_is_refused_before_the_model_runs(name: str) -> None:
    calls = []
    model = _model()
    model.register_forward_hook(lambda *args: calls.append(1))
    before = [p.clone() for p in model.parameters()]
    run = REPORTS.get(name, lambda m, x, loss: find_nonfinite(m, x, loss_fn=loss))
    refused = rf"{name}: loss_fn takes one required argument.*loss_fn\(model, batch\).*lambda model, x:"
    with pytest.raises(TypeError, match=refused):
        run(model, _x(), lambda out: out.float().square().mean())
    assert calls == [] and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


def test_find_nonfinite_takes_the_model_form() -> None:
    inputs = demo.demo_inputs()
    report = find_nonfinite(demo.backward_overflow_model(), inputs, loss_fn=demo.scaled_loss(2.0**8))
    assert report is not None


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
