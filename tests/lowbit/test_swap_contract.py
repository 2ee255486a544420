"""One contract for every module swap (issue 33 items 4 and 5): a second conversion with another setting
is refused (naming the layers and both settings) and changes nothing, the same setting again is a no-op,
a non-bool filter is a TypeError in both swaps, and a swap that converts nothing says so."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from mixprec.float8 import Float8Config, Float8Linear, convert_to_float8_training
from mixprec.lowbit import LowbitLinear, convert_to_lowbit_training
from mixprec.plan.result import PrecisionPlan


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))


def _kinds(model: nn.Module) -> list[str]:
    def kind(m: nn.Module) -> str:
        return str(getattr(m, "recipe", None) or getattr(getattr(m, "config", None), "scaling", ""))

    return [f"{type(m).__name__}:{kind(m)}" for m in model.modules() if isinstance(m, nn.Linear)]


def test_float8_twice_with_another_config_is_refused_and_keeps_the_first() -> None:
    model = convert_to_float8_training(_mlp(), config=Float8Config())
    before = _kinds(model)
    with pytest.raises(ValueError) as err:
        convert_to_float8_training(model, config=Float8Config(scaling="delayed"))
    text = str(err.value)
    assert "'0' (Float8Linear, Float8Config())" in text and "'2' (Float8Linear, Float8Config())" in text
    assert "asks for Float8Config(scaling='delayed')" in text and "Nothing was converted" in text
    assert _kinds(model) == before and all(
        m.amax_history is None for m in model if isinstance(m, Float8Linear)
    )


def test_float8_twice_with_the_same_config_is_a_silent_no_op() -> None:
    model = convert_to_float8_training(_mlp(), config=Float8Config(scaling="delayed"))
    layers = [model[0], model[2]]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        convert_to_float8_training(model, config=Float8Config(scaling="delayed"))
    assert [model[0], model[2]] == layers


def test_lowbit_twice_with_another_recipe_is_refused_and_the_same_is_a_no_op() -> None:
    model = convert_to_lowbit_training(_mlp(), "fp8_rowwise")
    first = model[0]
    with pytest.raises(ValueError, match=r"'0' \(LowbitLinear, recipe .*fp8.*asks for recipe .*mxfp8"):
        convert_to_lowbit_training(model, "mxfp8")
    assert model[0] is first and model[0].recipe == first.recipe
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        convert_to_lowbit_training(model, "fp8_rowwise")
    assert model[0] is first


@pytest.mark.parametrize("first", ["float8", "lowbit"])
def test_one_swap_over_the_other_is_refused(first: str) -> None:
    model = _mlp()
    if first == "float8":
        convert_to_float8_training(model)
        with pytest.raises(ValueError, match=r"convert_to_lowbit_training: 2 layer.*Float8Linear"):
            convert_to_lowbit_training(model, "mxfp8")
        assert all(isinstance(model[i], Float8Linear) for i in (0, 2))
    else:
        convert_to_lowbit_training(model, "mxfp8")
        with pytest.raises(ValueError, match=r"convert_to_float8_training: 2 layer.*LowbitLinear"):
            convert_to_float8_training(model)
        assert all(type(model[i]) is LowbitLinear for i in (0, 2))


def test_a_filter_that_leaves_converted_layers_out_does_not_conflict() -> None:
    model = convert_to_float8_training(_mlp(), module_filter_fn=lambda m, fqn: fqn == "0")
    convert_to_lowbit_training(model, "mxfp8", module_filter_fn=lambda m, fqn: fqn == "2")
    assert isinstance(model[0], Float8Linear) and isinstance(model[2], LowbitLinear)


def test_a_plan_over_a_float8_model_is_refused_and_changes_nothing() -> None:
    model = convert_to_float8_training(_mlp())
    plan = PrecisionPlan({"0": "mxfp8", "2": "bf16"}, {}, {"0": "test", "2": "test"}, 0.01, {})
    with pytest.raises(ValueError, match=r"Plan.apply: 2 layer.*Float8Linear.*this plan's formats"):
        plan.apply(model)
    assert all(isinstance(model[i], Float8Linear) for i in (0, 2))


def test_a_plan_re_sets_its_own_layers() -> None:
    model = _mlp()
    PrecisionPlan({"0": "mxfp8", "2": "bf16"}, {}, {"0": "t", "2": "t"}, 0.01, {}).apply(model)
    PrecisionPlan({"0": "bf16", "2": "nvfp4"}, {}, {"0": "t", "2": "t"}, 0.01, {}).apply(model)
    assert type(model[0]) is nn.Linear and isinstance(model[2], LowbitLinear)


@pytest.mark.parametrize(
    "value", ["False", None, 1, torch.tensor(True)], ids=["str", "None", "int", "tensor"]
)
def test_a_non_bool_filter_result_is_a_type_error_in_both_swaps(value: object) -> None:
    for convert in (
        lambda m, f: convert_to_lowbit_training(m, "mxfp8", module_filter_fn=f),
        lambda m, f: convert_to_float8_training(m, module_filter_fn=f),
    ):
        model = _mlp()
        with pytest.raises(
            TypeError, match=r"must return True or False, got .* for '0'; nothing was converted"
        ):
            convert(model, lambda mod, fqn: value)
        assert [type(m) for m in model] == [nn.Linear, nn.GELU, nn.Linear]


@pytest.mark.parametrize("swap", ["float8", "lowbit"])
def test_a_swap_that_converts_nothing_warns(swap: str) -> None:
    def convert(model: nn.Module, **kw: object) -> None:
        if swap == "float8":
            convert_to_float8_training(model, **kw)
        else:
            convert_to_lowbit_training(model, "mxfp8", **kw)

    with pytest.warns(UserWarning, match="converted nothing: Sequential has no nn.Linear the filter accepts"):
        convert(nn.Sequential(nn.Conv2d(3, 3, 1), nn.ReLU()))
    with pytest.warns(UserWarning, match="converted nothing"):
        convert(_mlp(), module_filter_fn=lambda m, fqn: False)
