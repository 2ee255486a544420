"""The float8 forward resolves its config once (issue 33 item 6): no recipe string is parsed (a config
builds its Recipe without text, issue 41) and no
``LinearMMConfig`` is built at each GEMM, over several forwards and backwards, while a fresh config
resolves exactly once, when it is built (so the counters below can count, and a compiled forward
traces no resolution: issue 39 item 3)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mixprec.float8.config as config_module
from mixprec import lowbit
from mixprec.float8 import Float8Config, convert_to_float8_training
from mixprec.lowbit.recipes import Recipe


@pytest.fixture
def counts(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    seen = {"parse": 0, "linear_mm_config": 0}
    parse, build = Recipe.parse.__func__, config_module.LinearMMConfig

    def counting_parse(cls: type, text: str) -> Recipe:
        seen["parse"] += 1
        return parse(cls, text)

    def counting_build(*args: object) -> object:
        seen["linear_mm_config"] += 1
        return build(*args)

    monkeypatch.setattr(Recipe, "parse", classmethod(counting_parse))
    monkeypatch.setattr(config_module, "LinearMMConfig", counting_build)
    return seen


def _steps(model: nn.Module, n: int = 4) -> None:
    for i in range(n):
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(i), requires_grad=True)
        model(x).square().sum().backward()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_several_forwards_parse_nothing(counts: dict[str, int], recipe: str) -> None:
    config = Float8Config.from_recipe_name(recipe)
    model = convert_to_float8_training(
        nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16)), config=config
    )
    first = dict(counts)  # the config was resolved when it was built
    _steps(model)
    assert counts == first, f"{recipe}: the forward re-resolved its config: {first} -> {counts}"


def test_a_config_change_resolves_the_new_config_once(counts: dict[str, int]) -> None:
    model = convert_to_float8_training(nn.Sequential(nn.Linear(32, 16)), config=Float8Config())
    _steps(model, 1)
    before = counts["parse"]
    model[0].config = Float8Config.from_recipe_name("rowwise")
    assert counts["parse"] == before  # the config builds its Recipe field by field, with no recipe text
    assert model[0].config.resolved_lowbit_recipe == lowbit.RECIPES["fp8_rowwise"]
    _steps(model)
    assert counts["parse"] == before  # and the steps parse nothing either
    before = counts["linear_mm_config"]
    model[0].config = Float8Config(emulate=True)
    _steps(model)
    assert counts["linear_mm_config"] == before + 1
    assert model[0].linear_mm_config.output.emulate
