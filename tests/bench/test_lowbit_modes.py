"""The bench's lowbit modes convert the model's Linear layers to a recipe and train under bf16 autocast."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mixprec.bench import MODES
from mixprec.lowbit import LowbitLinear

LOWBIT = [name for name in MODES if name.startswith("lowbit-")]


def test_every_named_recipe_has_a_mode_marked_emulated() -> None:
    assert LOWBIT == [
        f"lowbit-{r}"
        for r in (
            "fp8-rowwise",
            "fp8-rowwise-gw-hp",
            "fp8-blockwise",
            "mxfp8",
            "mxfp8-floor",
            "mxfp4",
            "nvfp4",
        )
    ]
    assert all("emulated on a CPU" in MODES[name].summary for name in LOWBIT)


@pytest.mark.parametrize("name", LOWBIT)
def test_lowbit_modes_convert_and_train(name) -> None:
    torch.manual_seed(0)
    mode = MODES[name].create("cpu")
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    mode.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    four_bit = name.endswith("fp4")
    assert [isinstance(model[i], LowbitLinear) for i in (0, 2, 4)] == (
        [False, True, False] if four_bit else [True] * 3
    )
    assert model[2].recipe.name == MODES[name].options["recipe"]
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    before = model[2].weight.detach().clone()
    losses = [float(mode.train_step(x, y, lambda o, t: (o.float() - t).pow(2).mean())) for _ in range(3)]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert not torch.equal(before, model[2].weight)
    assert MODES[name].unavailable("cpu") is None
