"""convert_to_float8_training: which modules are swapped, the filter contract, errors that change nothing."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mixprec.float8 import Float8Config, Float8Linear, convert_to_float8_training, float8_linears, skip_fqns


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 16)
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
        self.head = nn.Linear(16, 10)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(idx)))


def test_filter_gets_module_and_fqn_and_false_keeps_the_module() -> None:
    model = Net()
    calls = []

    def keep_head(module: nn.Module, fqn: str) -> bool:
        calls.append((type(module).__name__, fqn))
        return fqn != "head"

    head = model.head
    assert convert_to_float8_training(model, module_filter_fn=keep_head) is model
    assert sorted(calls) == [("Linear", "body.0"), ("Linear", "body.2"), ("Linear", "head")]
    assert [fqn for fqn, _ in float8_linears(model)] == ["body.0", "body.2"]
    assert model.head is head and type(model.head) is nn.Linear


def test_parameters_are_shared_so_an_existing_optimizer_keeps_training() -> None:
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    params = {name: p for name, p in model.named_parameters()}
    keys = list(model.state_dict())
    convert_to_float8_training(model)
    assert {name: p for name, p in model.named_parameters()} == params
    assert list(model.state_dict()) == keys  # dynamic scaling adds no state
    before = model.body[0].weight.detach().clone()
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    optimizer.step()
    assert not torch.equal(model.body[0].weight, before)


def test_skip_fqns_filter_and_root_linear() -> None:
    model = convert_to_float8_training(Net(), module_filter_fn=skip_fqns(["head", "body.0"]))
    assert [fqn for fqn, _ in float8_linears(model)] == ["body.2"]
    root = convert_to_float8_training(nn.Linear(4, 4), config=Float8Config(scaling="delayed"))
    assert isinstance(root, Float8Linear) and root.amax_history.shape == (3, 16)
    with pytest.raises(TypeError, match="fqns"):
        skip_fqns("head")


def test_converting_twice_is_a_no_op_and_shared_modules_stay_shared() -> None:
    shared = nn.Linear(8, 8)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    convert_to_float8_training(model)
    assert isinstance(model[0], Float8Linear) and model[0] is model[2]
    first = model[0]
    convert_to_float8_training(model)
    assert model[0] is first


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"config": "delayed"}, "config"),
        ({"module_filter_fn": "head"}, "module_filter_fn"),
    ],
)
def test_bad_arguments_name_themselves_and_convert_nothing(kwargs, name) -> None:
    model = Net()
    before = copy.deepcopy(model)
    with pytest.raises(TypeError, match=name):
        convert_to_float8_training(model, **kwargs)
    assert [type(m) for m in model.modules()] == [type(m) for m in before.modules()]
    with pytest.raises(TypeError, match="model"):
        convert_to_float8_training("model")


def test_from_linear_keeps_device_dtype_and_training_mode() -> None:
    linear = nn.Linear(8, 4, dtype=torch.bfloat16).eval()
    new = Float8Linear.from_linear(linear, Float8Config(scaling="delayed"))
    assert new.weight is linear.weight and not new.training
    assert new.amax_history.dtype == torch.float32 and new.amax_history.device == linear.weight.device
    assert new(torch.randn(2, 8, dtype=torch.bfloat16)).dtype == torch.bfloat16
    assert "fp8=delayed(len=16,max,margin=0)" in repr(new)
