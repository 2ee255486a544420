"""Every report takes the planner's ``loss_fn(model, batch)``, and only that: a one-argument
``loss_fn(output)`` is refused before the model runs, with the wrapper that makes it one."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from mixprec.inspect import demo, find_nonfinite, fp8_report, lowbit_report, underflow_report
from mixprec.inspect._modules import LossInputError, _required_positional, model_loss
from mixprec.plan import plan_precision


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


# A user's torch-style losses and inputs (the README trial): each fails inside the user's loss_fn, and the
# failure names the signature mixprec calls and what it passed, the original chained.
TORCH_STYLE = {
    "cross_entropy(out, y)": torch.nn.functional.cross_entropy,  # TypeError: ... not Sequential
    "criterion(out, y)": lambda out, y: (out - y).pow(2).sum(),  # AttributeError: Sequential has no 'sum'
}
PLANNER = {"plan_precision": lambda m, x, loss: plan_precision(m, [x], loss, formats=("bf16",), budget=0.5)}


@pytest.mark.parametrize("loss_name", sorted(TORCH_STYLE))
@pytest.mark.parametrize("name", [*sorted(REPORTS), "find_nonfinite", "plan_precision"])
def test_a_torch_style_loss_names_the_signature_and_what_was_passed(name: str, loss_name: str) -> None:
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    run = {**REPORTS, **PLANNER}.get(name, lambda m, x, loss: find_nonfinite(m, x, loss_fn=loss))
    batch = (_x(), torch.randint(0, 8, (4,)))
    expected = (
        rf"{name}: loss_fn raised (TypeError|AttributeError): .*mixprec calls it as "
        r"loss_fn\(model, batch\) -> scalar tensor, here with model=Sequential \(an nn.Module\) and "
        r"batch=tuple of 2 \[Tensor of shape \(4, 16\) \(float32\), Tensor of shape \(4,\) \(int64\)\]"
    )
    with pytest.raises(LossInputError, match=expected) as caught:
        run(model, batch, TORCH_STYLE[loss_name])
    assert isinstance(caught.value, TypeError) and isinstance(caught.value, ValueError)
    assert isinstance(caught.value.__cause__, (TypeError, AttributeError))  # the original, chained
    assert all(p.grad is None for p in model.parameters())  # the failed call left the model as it was
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("name", [*sorted(REPORTS), "find_nonfinite", "plan_precision"])
def test_a_loss_that_is_not_a_scalar_tensor_is_named(name: str) -> None:
    run = {**REPORTS, **PLANNER}.get(name, lambda m, x, loss: find_nonfinite(m, x, loss_fn=loss))
    not_reduced = r"must return a one-element tensor, got \(4, 8\): reduce it"
    with pytest.raises(ValueError, match=not_reduced):
        run(_model(), _x(), lambda model, x: model(x))
    with pytest.raises(ValueError, match=r"one-element tensor, got float 1.5"):
        run(_model(), _x(), lambda model, x: 1.5)


@pytest.mark.parametrize("batches", [_x(), {"x": _x()}, 3])
def test_plan_precision_refuses_one_batch_for_batches(batches: object) -> None:
    model = _model()
    got = {torch.Tensor: r"Tensor of shape \(4, 16\)", dict: "dict of 1", int: "int 3"}[type(batches)]
    with pytest.raises(
        LossInputError, match=rf"batches must be an iterable of batches.*got one {got}.*\[batch\]"
    ):
        plan_precision(model, batches, lambda m, x: m(x).sum(), formats=("bf16",), budget=0.5)
    with pytest.raises(LossInputError, match=r"check_batches must be an iterable of batches"):
        plan_precision(
            model, [_x()], lambda m, x: m(x).sum(), check_batches=_x(), formats=("bf16",), budget=0.5
        )


def test_a_loss_that_runs_is_not_wrapped_on_later_passes() -> None:
    # only the first call is the dialect check: an error of the user's own in a later call stays theirs
    calls = []

    def loss_fn(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        if len(calls) > 1:
            raise KeyError("the user's own bug")
        return model(x).square().mean()

    with pytest.raises(KeyError, match="the user's own bug"):
        plan_precision(_model(), [_x()], loss_fn, formats=("bf16",), budget=0.5)
