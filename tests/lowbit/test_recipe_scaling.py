"""One engine configuration (issue 41): a Recipe's per-tensor scaling is data on it, Float8Config builds
the Recipe without text, LowbitLinearFunction takes explicit arguments, and each MXFP8 name means one
rounding."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mixprec import lowbit
from mixprec.float8 import Float8Config, convert_to_float8_training
from mixprec.lowbit import RECIPES, Recipe, TensorScaling, get_format, get_recipe
from mixprec.lowbit.gemm import LowbitLinearFunction

TENSORWISE = RECIPES["fp8_tensorwise"]


@pytest.mark.parametrize(
    "scaling",
    [
        TensorScaling(),
        TensorScaling(delayed=True),
        TensorScaling(delayed=True, margin=3, amax_compute_algo="most_recent"),
        TensorScaling(margin=1),
    ],
)
def test_a_per_tensor_recipe_round_trips_through_its_text(scaling: TensorScaling) -> None:
    recipe = TENSORWISE.with_(scaling=scaling)
    text = str(recipe)
    assert f"scaling={scaling.kind}" in text and recipe.name is None
    assert Recipe.parse(text) == recipe and hash(Recipe.parse(text)) == hash(recipe)
    assert get_recipe(f"fp8_tensorwise {text.split(' sr=off rht=off ')[1]}") == recipe


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("fp8_rowwise scaling=dynamic", r"tensorwise fp8 format, got fprop_x=fp8_rowwise"),
        ("fp8_rowwise_gw_hp scaling=delayed", r"wgrad_go=hp"),
        ("fp8_tensorwise margin=2", r"margin= or amax= without scaling="),
        ("fp8_tensorwise scaling=sometimes", r"scaling='sometimes'"),
        ("fp8_tensorwise scaling=dynamic margin=-1", r"margin='-1' must be an int >= 0"),
        ("fp8_tensorwise scaling=delayed amax=mean", r"amax='mean' must be one of max, most_recent"),
        ("nvfp4 scaling=dynamic", r"tensorwise fp8 format"),
    ],
)
def test_a_bad_per_tensor_recipe_is_refused_naming_the_value(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        get_recipe(text)


def test_scaling_must_be_a_tensor_scaling_and_takes_no_block_switches() -> None:
    with pytest.raises(TypeError, match="scaling must be a TensorScaling or None, got str"):
        TENSORWISE.with_(scaling="delayed")
    with pytest.raises(ValueError, match="takes sr=off and rht=off"):
        TENSORWISE.with_(sr=True, scaling=TensorScaling())
    with pytest.raises(ValueError, match="amax_compute_algo must be one of"):
        TensorScaling(amax_compute_algo="mean")
    with pytest.raises(TypeError, match="delayed must be a bool"):
        TensorScaling(delayed="yes")


@pytest.mark.parametrize(
    ("config", "scaling"),
    [
        (Float8Config(), TensorScaling()),
        (Float8Config(scaling="delayed", margin=2), TensorScaling(True, 2, "max")),
        (
            Float8Config(scaling="delayed", amax_compute_algo="most_recent"),
            TensorScaling(True, 0, "most_recent"),
        ),
        (Float8Config.from_recipe_name("rowwise"), None),
    ],
)
def test_float8_config_builds_its_recipe_with_the_scaling_as_data(config, scaling) -> None:
    recipe = config.resolved_lowbit_recipe
    assert recipe.scaling == scaling and config.tensor_scaling == scaling
    assert Recipe.parse(str(recipe)) == recipe  # the text is derived from the Recipe, and reads back
    if scaling is None:
        assert config.lowbit_recipe == recipe.operands_str()
        assert recipe == RECIPES["fp8_rowwise"]
    else:
        assert config.lowbit_recipe is None
        assert recipe == TENSORWISE.with_(scaling=scaling)


def test_explicit_arguments_match_the_layer_bitwise() -> None:
    torch.manual_seed(0)
    model = convert_to_float8_training(
        nn.Sequential(nn.Linear(32, 16)), config=Float8Config(scaling="delayed")
    )
    layer = model[0]
    x = torch.randn(8, 32, requires_grad=True)
    out = layer(x)
    out.square().sum().backward()
    history = torch.zeros(3, 16)
    stats = torch.zeros(2, 3)
    x2 = x.detach().clone().requires_grad_()
    w = layer.weight.detach().clone().requires_grad_()
    recipe, gemms = layer.config.resolved_lowbit_recipe, layer.config.gemm_options
    again = LowbitLinearFunction.apply(x2, w, recipe, None, gemms, history, stats, True) + layer.bias
    again.square().sum().backward()
    assert torch.equal(again, out)
    assert torch.equal(x2.grad, x.grad) and torch.equal(w.grad, layer.weight.grad)
    assert torch.equal(history, layer.amax_history) and torch.equal(stats, layer.fp8_stats)


def test_a_per_tensor_recipe_without_its_buffers_is_refused() -> None:
    x, w = torch.randn(4, 32), torch.randn(16, 32)
    with pytest.raises(ValueError, match="needs a float32\\[2, 3\\] stats buffer"):
        LowbitLinearFunction.apply(x, w, TENSORWISE.with_(scaling=TensorScaling()))
    delayed = TENSORWISE.with_(scaling=TensorScaling(delayed=True))
    with pytest.raises(ValueError, match="scaling=delayed needs its float32\\[3, L\\] amax history"):
        LowbitLinearFunction.apply(x, w, delayed, None, None, None, torch.zeros(2, 3))


def test_mxfp8_means_the_round_up_rule_and_the_format_names_say_their_rounding() -> None:
    assert get_format("mxfp8_floor").rule is lowbit.ScaleRounding.FLOOR
    assert get_format("mxfp8_rceil").rule is lowbit.ScaleRounding.RCEIL
    assert set(vars(RECIPES["mxfp8"]).values()) - {False, None} == {"mxfp8_rceil"}
    assert set(vars(RECIPES["mxfp8_floor"]).values()) - {False, None} == {"mxfp8_floor"}
    assert lowbit.activations.ACTIVATION_FORMATS["mxfp8"] == "mxfp8_rceil"
    with pytest.raises(ValueError, match="'mxfp8' is a recipe.*'mxfp8_rceil'.*'mxfp8_floor'"):
        get_format("mxfp8")
    with pytest.raises(ValueError, match="fprop_x='mxfp8': 'mxfp8' is a recipe"):
        get_recipe("fprop=mxfp8,mxfp8 dgrad=hp,hp wgrad=hp,hp")
    with pytest.raises(ValueError, match="'mxfp8' is a recipe"):
        lowbit.quantize(torch.randn(4, 32), "mxfp8")
