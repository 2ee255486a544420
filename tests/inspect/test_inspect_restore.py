"""Every diagnostic hands the model back exactly; nothing is hooked unless a diagnostic runs."""

import importlib

import pytest
import torch
from inspect_helpers import assert_no_hooks, assert_restored, snapshot
from torch import nn

import mixprec.inspect
from mixprec.autocast import autocast
from mixprec.inspect import demo, find_nonfinite, trace_dtypes, underflow_report
from mixprec.inspect._modules import LossInputError


class Busy(nn.Module):
    """Batch norm (running stats move in training), dropout (draws from the RNG), an eval-mode child."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)
        self.norm = nn.BatchNorm1d(32)
        self.drop = nn.Dropout(0.2)
        self.frozen = nn.Sequential(nn.Linear(32, 32), nn.Dropout(0.5)).eval()
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        return self.head(self.frozen(self.drop(self.norm(self.fc(x)))))


def _with_old_grads(model):
    torch.manual_seed(3)
    for p in list(model.parameters())[::2]:
        p.grad = torch.randn_like(p)
    return model


DIAGNOSTICS = {
    "find_nonfinite forward": lambda m, x: find_nonfinite(m, x),
    "find_nonfinite backward": lambda m, x: find_nonfinite(m, x, loss_fn=demo.scaled_loss(2.0**8)),
    "find_nonfinite overflowing": lambda m, x: find_nonfinite(m, x * 1e5, loss_fn=demo.scaled_loss(2.0**8)),
    "underflow_report": lambda m, x: underflow_report(m, x, loss_fn=demo.tiny_loss),
}


@pytest.mark.parametrize("name", list(DIAGNOSTICS))
def test_model_is_restored_exactly(name):
    model = _with_old_grads(Busy())
    user_hook = model.fc.register_forward_hook(lambda *args: None)
    inputs = demo.demo_inputs()
    before = snapshot(model)
    DIAGNOSTICS[name](model, inputs)
    assert_restored(model, before)
    assert len(model.fc._forward_hooks) == 1  # the user's own hook is still there
    user_hook.remove()
    assert_no_hooks(model)


def test_input_that_requires_grad_keeps_its_grad():
    inputs = demo.demo_inputs().requires_grad_()
    inputs.grad = torch.ones_like(inputs)
    old = inputs.grad
    find_nonfinite(demo.healthy_model(), inputs, loss_fn=demo.scaled_loss(1.0))
    underflow_report(demo.healthy_model(), inputs, loss_fn=demo.tiny_loss)
    assert inputs.grad is old and torch.equal(old, torch.ones_like(inputs))


def test_restored_after_an_exception_in_loss_fn():
    model = _with_old_grads(demo.healthy_model())
    before = snapshot(model)

    def broken(model, x):
        raise KeyError("boom")

    # the first call of the user's loss is re-raised naming the signature, the KeyError chained
    for run in (find_nonfinite, underflow_report):
        with pytest.raises(LossInputError, match=r"loss_fn raised KeyError: 'boom'") as caught:
            run(model, demo.demo_inputs(), loss_fn=broken)
        assert isinstance(caught.value.__cause__, KeyError)
    assert_restored(model, before)


def test_trace_leaves_nothing_behind():
    model = Busy().eval()  # the trace runs nothing itself; eval keeps batch norm's buffers still
    before = snapshot(model)
    with trace_dtypes(model), autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        assert torch._C._len_torch_function_stack() == 1  # the trace; a default region pushes none
        model(demo.demo_inputs())
    assert_restored(model, before)
    assert_no_hooks(model)


def test_nothing_is_hooked_unless_a_diagnostic_runs():
    importlib.reload(mixprec.inspect)
    model = demo.healthy_model()
    trace = trace_dtypes(model)  # created, not entered: inactive
    inputs = demo.demo_inputs()
    assert_no_hooks(model)
    expected = model(inputs)
    with autocast("cpu", dtype=torch.bfloat16):
        model(inputs)
    assert_no_hooks(model)
    assert trace.counts == {}
    assert torch.equal(model(inputs), expected)
