"""mixprec.float8 keeps torchao.float8's public contract: recipes by name, power-of-two scales, from_float,
refusing a root Linear with children, and torchao's ``quantize_`` for inference after training."""

from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import torch
from torch import nn

from mixprec.float8 import Float8Config, Float8Linear, convert_to_float8_training

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    ao = pytest.importorskip("torchao.float8")
    from torchao.quantization import Float8WeightOnlyConfig, quantize_


def _run(model: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:
    x = x.clone().requires_grad_()
    out = model(x)
    out.backward(grad)
    return [out.detach(), x.grad, model[0].weight.grad]


@pytest.mark.parametrize("pow2", [False, True], ids=["fp32_scales", "pow2_scales"])
@pytest.mark.parametrize("name", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_recipes_by_name_match_torchao_bitwise(name, pow2) -> None:
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(64, 48))
    theirs_config = ao.Float8LinearConfig.from_recipe_name(name)
    assert (
        Float8Config.from_recipe_name(name).round_scales_to_power_of_2
        == theirs_config.round_scales_to_power_of_2
    )
    theirs_config = dataclasses.replace(theirs_config, emulate=True, round_scales_to_power_of_2=pow2)
    theirs = ao.convert_to_float8_training(copy.deepcopy(base), config=theirs_config)
    config = Float8Config.from_recipe_name(name, emulate=True, round_scales_to_power_of_2=pow2)
    ours = convert_to_float8_training(copy.deepcopy(base), config=config)
    x, grad = torch.randn(2, 16, 64), torch.randn(2, 16, 48)
    for name_, o, m in zip(
        ("out", "grad_x", "grad_w"), _run(theirs, x, grad), _run(ours, x, grad), strict=True
    ):
        assert torch.equal(m, o), name_


def test_recipe_name_errors_and_delayed_rowwise_is_refused() -> None:
    with pytest.raises(ValueError, match="recipe_name must be one of 'tensorwise', 'rowwise'"):
        Float8Config.from_recipe_name("columnwise")
    with pytest.raises(ValueError, match="needs 'tensorwise'"):
        Float8Config(recipe="rowwise", scaling="delayed")
    with pytest.raises(TypeError, match="round_scales_to_power_of_2 must be a bool"):
        Float8Config(round_scales_to_power_of_2=1)
    assert Float8Config.from_recipe_name(ao.Float8LinearRecipeName.ROWWISE).recipe == "rowwise"


def test_from_float_is_from_linear() -> None:
    linear = nn.Linear(16, 8)
    module = Float8Linear.from_float(linear, Float8Config.from_recipe_name("rowwise"))
    assert module.weight is linear.weight and module.config.recipe == "rowwise"


def test_a_root_linear_with_children_is_refused_not_silently_stripped() -> None:
    root = nn.Linear(4, 4)
    root.extra = nn.Linear(4, 4)
    for error in (ValueError, AssertionError):  # mixprec's bad-input error and torchao's
        with pytest.raises(error, match=r"Does not support a root nn.Linear with children.*\['extra'\]"):
            convert_to_float8_training(root)
    assert type(root) is nn.Linear and type(root.extra) is nn.Linear


@pytest.mark.parametrize("name", ["tensorwise", "rowwise"])
def test_train_then_torchao_quantize_for_inference(name) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    convert_to_float8_training(model, config=Float8Config.from_recipe_name(name))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(16, 64)).square().mean().backward()
        optimizer.step()
    plain = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    plain.load_state_dict(model.state_dict())
    quantize_(model, Float8WeightOnlyConfig())
    quantize_(plain, Float8WeightOnlyConfig())
    x = torch.randn(16, 64)
    with torch.no_grad():
        assert torch.equal(model(x), plain(x))  # the quantized weights run torchao's own inference linear
