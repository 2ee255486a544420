"""plan_precision on models users bring (issue 33 item 5): an unused head (listed as not run, kept as is),
a meta-device model, frozen layers (fine-tuning)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mixprec.plan import PrecisionPlan, plan_precision


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(16, 32, generator=g), torch.randn(16, 4, generator=g)) for _ in range(2)]


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.mse_loss(model["used"](batch[0]), batch[1])


def test_a_linear_loss_fn_never_calls_stays_out_of_the_plan_and_as_it_is() -> None:
    torch.manual_seed(0)
    model = nn.ModuleDict(
        {
            "used": nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)),
            "unused_head": nn.Linear(32, 8),
        }
    )
    head = model["unused_head"]
    with pytest.warns(UserWarning, match=r"loss_fn never called \['unused_head'\]"):
        plan = plan_precision(model, _batches(), _loss)  # was: KeyError: 'unused_head'
    assert set(plan.formats) == set(plan.reasons) == {"used.0", "used.2"}
    assert plan.not_run == ["unused_head"]
    row = [line for line in plan.table().splitlines() if line.startswith("unused_head")]
    assert len(row) == 1 and row[0].endswith("not run, kept as is")
    assert PrecisionPlan.from_json(plan.to_json()).not_run == ["unused_head"]
    plan.apply(model)
    assert model["unused_head"] is head and type(head) is nn.Linear


def test_a_meta_device_model_is_refused_with_mixprecs_message() -> None:
    with torch.device("meta"):
        model = nn.ModuleDict({"used": nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))})
    with pytest.raises(ValueError, match=r"4 tensor\(s\) are on the meta device \(first: 'used.0.weight'\)"):
        plan_precision(model, _batches(), _loss)


@pytest.mark.parametrize("measure", ["exact", "local"])
@pytest.mark.parametrize("frozen", [0, 2])
def test_a_frozen_linear_is_planned_and_its_weight_has_no_gradient(measure: str, frozen: int) -> None:
    # was: RuntimeError: One of the differentiated Tensors does not require grad (a fine-tuning model)
    torch.manual_seed(0)
    model = nn.ModuleDict({"used": nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))})
    model["used"][frozen].requires_grad_(False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = plan_precision(model, _batches(), _loss, measure=measure, exhaustive=True, cost="b200-peak")
    assert set(plan.formats) == {"used.0", "used.2"}
    for fqn in plan.formats:  # every format measured: a frozen first layer too (no output gradient kept)
        assert all(d["loss"] > 0 for fmt, d in plan.layers[fqn]["divergence"].items() if fmt != "fp32")
    assert plan.measured["loss"] <= 0.01
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not model["used"][frozen].weight.requires_grad and model["used"][frozen].weight.grad is None


def test_from_json_given_a_path_says_it_takes_the_text(tmp_path) -> None:
    # was: json.JSONDecodeError "Expecting value: line 1 column 1 (char 0)", naming neither
    with pytest.raises(ValueError, match=r"from_json takes the JSON text.*read_text\(\)\); got 'plan.json'"):
        PrecisionPlan.from_json("plan.json")


def test_module_filter_fn_refuses_an_unknown_format() -> None:
    # was: module_filter_fn("MXFP8") matched no layer, so convert_to_lowbit_training converted nothing
    torch.manual_seed(0)
    model = nn.ModuleDict({"used": nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))})
    plan = plan_precision(model, _batches(), _loss, formats=("mxfp8", "bf16"), cost="b200-peak", budget=0.5)
    with pytest.raises(ValueError, match=r"unknown low-bit recipe 'MXFP8'; named recipes: .*mxfp8"):
        plan.module_filter_fn("MXFP8")
    chosen = [f for f, fmt in plan.formats.items() if fmt == "mxfp8"]
    assert chosen and all(plan.module_filter_fn("mxfp8")(model.get_submodule(f), f) for f in chosen)
    assert not any(plan.module_filter_fn("nvfp4")(model.get_submodule(f), f) for f in plan.formats)
