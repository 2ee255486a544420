"""plan_precision: a measured format per linear layer, the plan as a value, and refusals."""

from __future__ import annotations

import copy
import itertools
import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixprec import lowbit
from mixprec.inspect.demo import OutlierMLP
from mixprec.lowbit import LowbitLinear
from mixprec.plan import Divergence, LayerMeasure, PrecisionPlan, Replan, plan_precision
from mixprec.plan.cost import TARGETS, gemm_cost
from mixprec.plan.solve import knapsack as _knapsack

BUDGET = 0.5


class _Bf16(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.linear.weight.bfloat16(), self.linear.bias.bfloat16()
        return F.linear(x.bfloat16(), w, b).float()


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def _task(seed: int = 0) -> tuple[OutlierMLP, list]:
    """The model after 150 fp32 AdamW steps on a fixed random 10-class problem, and 2 planning batches."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(10, 64, generator=g) * 2
    y = torch.randint(0, 10, (512,), generator=g)
    x = centers[y] + torch.randn(512, 64, generator=g) * 1.5
    torch.manual_seed(seed)
    model = OutlierMLP()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    for _step in range(150):
        idx = torch.randint(0, 384, (64,), generator=g)
        opt.zero_grad()
        loss_fn(model, (x[idx], y[idx])).backward()
        opt.step()
    model.zero_grad(set_to_none=True)
    return model, [(x[384:448], y[384:448]), (x[448:], y[448:])]


@pytest.fixture(scope="module")
def planned():
    model, batches = _task()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = plan_precision(model, batches, loss_fn, budget=BUDGET, cost="b200-peak")
    return model, batches, plan, before


def _same_state(model: nn.Module, before: dict[str, torch.Tensor]) -> bool:
    after = model.state_dict()
    return after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


def test_outlier_layer_stays_out_of_4bit_and_half_the_flops_go_below_bf16(planned):
    model, _batches, plan, before = planned
    assert set(plan.formats) == {"fc1", "fc2", "fc3", "head"}
    assert plan.formats["fc3"] not in ("nvfp4", "mxfp4"), plan.table()
    fc3 = plan.layers["fc3"]["divergence"]
    assert fc3["nvfp4"]["loss"] > max(plan.layers[f]["divergence"]["nvfp4"]["loss"] for f in ("fc1", "fc2"))
    assert plan.low_precision_share() >= 0.5, plan.table()
    assert _same_state(model, before)
    assert all(p.grad is None for p in model.parameters())
    assert all(type(m) is nn.Linear for m in (model.fc1, model.fc2, model.fc3, model.head))


def test_measured_divergence_fits_and_matches_an_independent_run(planned):
    model, batches, plan, _ = planned
    assert plan.measured["loss"] <= BUDGET
    # Oracle: the fp32 model and a copy converted by the plan (its bf16 layers' GEMMs run in bf16 here),
    # losses computed here from scratch.
    quantized = plan.apply(copy.deepcopy(model))
    for fqn, fmt in plan.formats.items():
        if fmt == "bf16":
            setattr(quantized, fqn, _Bf16(quantized.get_submodule(fqn)))
    with torch.no_grad():
        ref = [loss_fn(model, b).item() for b in batches]
        got = [loss_fn(quantized, b).item() for b in batches]
    loss_div = sum(abs(a - b) for a, b in zip(got, ref, strict=True)) / sum(ref)
    assert loss_div == pytest.approx(plan.measured["loss"], rel=1e-4, abs=1e-7)


def test_table_json_filter_apply_and_plot(planned, tmp_path):
    model, _batches, plan, _ = planned
    table = plan.table()
    for fqn, fmt in plan.formats.items():
        assert fqn in table and fmt in table
    assert "below bf16" in table and "reference steps" in table
    back = PrecisionPlan.from_json(plan.to_json())
    assert back == plan
    json.loads(plan.to_json())
    for fmt in set(plan.formats.values()) - {"bf16", "fp32"}:
        m = lowbit.convert_to_lowbit_training(
            copy.deepcopy(model), fmt, module_filter_fn=plan.module_filter_fn(fmt)
        )
        converted = {fqn for fqn, _ in lowbit.lowbit_linears(m)}
        assert converted == {f for f, planned in plan.formats.items() if planned == fmt}
    applied = plan.apply(copy.deepcopy(model))
    for fqn, fmt in plan.formats.items():
        module = applied.get_submodule(fqn)
        if fmt in ("bf16", "fp32"):
            assert type(module) is nn.Linear
        else:
            assert isinstance(module, LowbitLinear) and module.recipe == lowbit.get_recipe(fmt)
    # Re-planning: an all-bf16 plan puts the converted layers back to plain, parameter-sharing Linears.
    all_bf16 = PrecisionPlan(
        dict.fromkeys(plan.formats, "bf16"), plan.layers, plan.reasons, 1.0, plan.measured
    )
    weight = applied.fc1.weight
    all_bf16.apply(applied)
    assert type(applied.fc1) is nn.Linear and applied.fc1.weight is weight
    # A plan naming a missing layer or an unknown format is refused before anything is swapped.
    for bad in ({**plan.formats, "nope": "nvfp4"}, {**plan.formats, "head": "fp5"}):
        target = copy.deepcopy(model)
        wrong = PrecisionPlan(bad, plan.layers, plan.reasons, 1.0, plan.measured)
        with pytest.raises(ValueError, match="nope|fp5"):
            wrong.apply(target)
        assert all(type(m) is nn.Linear for m in (target.fc1, target.fc2, target.fc3, target.head))
    with pytest.raises(ValueError, match="not a mixprec precision plan"):
        PrecisionPlan.from_json(json.dumps({"formats": {}}))
    path = tmp_path / "plan.png"
    plan.plot(path)
    assert path.stat().st_size > 1000


def test_a_plan_of_an_already_converted_model_measures_it_as_plain_layers(planned):
    model, batches, plan, _ = planned
    converted = plan.apply(copy.deepcopy(model))
    again = plan_precision(converted, batches[:1], loss_fn, formats=("mxfp8", "bf16"), budget=BUDGET)
    assert set(again.formats) == set(plan.formats)
    assert {type(m) for m in (converted.fc1, converted.fc3)} <= {nn.Linear, LowbitLinear}


def test_no_mix_fits_falls_back_to_the_models_precision():
    model, batches = _task()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = plan_precision(model, batches[:1], loss_fn, formats=("nvfp4",), budget=1e-9, max_rounds=2)
    assert set(plan.formats.values()) == {"fp32"}
    assert plan.measured["loss"] == 0.0
    assert "kept in the model's precision" in plan.reasons["fc3"]
    assert _same_state(model, before)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"budget": 0.0}, ValueError, "budget must be > 0"),
        ({"budget": -1.0}, ValueError, "budget must be > 0"),
        ({"budget": "0.01"}, ValueError, "budget must be a finite number"),
        ({"budget": float("nan")}, ValueError, "budget must be a finite number"),
        ({"budget": True}, ValueError, "budget must be a finite number"),
        ({"grad_budget": 0.0}, ValueError, "grad_budget must be > 0"),
        ({"grad_budget": float("inf")}, ValueError, "grad_budget must be a finite number"),
        ({"max_flushed": 0.0}, ValueError, "max_flushed must be a share in"),
        ({"max_flushed": 1.5}, ValueError, "max_flushed must be a share in"),
        ({"check_batches": []}, ValueError, "check_batches is empty"),
        ({"formats": ("nvfp4", "fp7")}, ValueError, "unknown format 'fp7'"),
        ({"formats": ()}, ValueError, "formats must be a non-empty"),
        ({"cost": "a100"}, ValueError, "unknown cost target 'a100'"),
        ({"batches": []}, ValueError, "batches is empty"),
        ({"loss_fn": lambda m, b: m(b[0])}, ValueError, "one-element tensor"),
        (
            {"loss_fn": lambda m, b: loss_fn(m, b) * float("inf")},
            ValueError,
            "non-finite loss at high precision",
        ),
        (
            {"loss_fn": lambda m, b: loss_fn(m, b) * float("nan")},
            ValueError,
            "non-finite loss at high precision",
        ),
        ({"loss_fn": "cross_entropy"}, TypeError, "loss_fn must be callable"),
    ],
)
def test_bad_input_is_refused_and_the_model_is_unchanged(kwargs, error, match):
    model, batches = _task()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    args = {"batches": batches[:1], "loss_fn": loss_fn, **kwargs}
    with pytest.raises(error, match=match):
        plan_precision(model, args.pop("batches"), args.pop("loss_fn"), **args)
    assert _same_state(model, before)
    assert all(type(m) is nn.Linear for m in (model.fc1, model.fc2, model.fc3, model.head))
    assert all(p.grad is None for p in model.parameters())


def test_a_model_without_linears_or_that_is_one_is_refused():
    batch = (torch.randn(4, 8), torch.randint(0, 2, (4,)))
    with pytest.raises(ValueError, match="no nn.Linear"):
        plan_precision(nn.Sequential(nn.ReLU()), [batch], loss_fn)
    linear = nn.Linear(8, 2)
    before = {k: v.clone() for k, v in linear.state_dict().items()}
    with pytest.raises(ValueError, match="model itself is an nn.Linear"):
        plan_precision(linear, [batch], loss_fn)
    assert _same_state(linear, before)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        plan_precision("model", [batch], loss_fn)


def measures(layers: dict) -> dict[str, LayerMeasure]:
    """The solver's records of plain test layers (``cost``, ``flops``, ``divergence``: loss, weight_grad,
    fprop_flushed), which the brute-force checks read as dicts."""
    return {
        fqn: LayerMeasure(
            (1, 1, 1),
            1,
            info.get("flops", 0),
            info["cost"],
            {
                fmt: Divergence(d["loss"], d["weight_grad"], None, fprop_flushed=d["fprop_flushed"])
                for fmt, d in info["divergence"].items()
            },
        )
        for fqn, info in layers.items()
    }


def test_knapsack_is_the_brute_force_optimum():
    g = torch.Generator().manual_seed(1)
    fmts = ("a", "b", "c")
    for trial in range(40):
        layers = {}
        for i in range(4):
            losses, grads, costs, flushed = torch.rand(4, 3, generator=g).tolist()
            costs[1] = costs[0] if trial % 2 else costs[1]  # equal costs: the weight gradient decides
            layers[f"l{i}"] = {
                "cost": dict(zip(fmts, costs, strict=True)),
                "divergence": {
                    f: {"loss": s, "weight_grad": w, "fprop_flushed": x}
                    for f, s, w, x in zip(fmts, losses, grads, flushed, strict=True)
                },
            }
        budget, grad_limit, max_flushed = 0.4 + trial * 0.05, (0.7, math.inf)[trial % 3 > 0], 0.8
        best = None
        margin = 1 - 4 / (100 if math.isfinite(grad_limit) else 1000)  # 4 items, each rounded up a step
        for pick in itertools.product(fmts, repeat=4):
            ds = [layers[f"l{i}"]["divergence"][p] for i, p in enumerate(pick)]
            if any(d["fprop_flushed"] > max_flushed for d in ds):
                continue
            fits = sum(d["loss"] for d in ds) <= budget * margin
            fits &= sum(d["weight_grad"] ** 2 for d in ds) <= grad_limit**2 * margin
            key = (
                sum(layers[f"l{i}"]["cost"][p] for i, p in enumerate(pick)),
                sum(d["weight_grad"] for d in ds),
            )
            if fits and (best is None or key < best[0]):
                best = (key, pick)
        chosen = _knapsack(measures(layers), budget, grad_limit, max_flushed)
        if not chosen:
            assert best is None
            continue
        ds = [layers[f]["divergence"][p] for f, p in chosen.items()]
        assert sum(d["loss"] for d in ds) <= budget
        assert sum(d["weight_grad"] ** 2 for d in ds) <= grad_limit**2
        assert all(d["fprop_flushed"] <= max_flushed for d in ds)
        key = (sum(layers[f]["cost"][p] for f, p in chosen.items()), sum(d["weight_grad"] for d in ds))
        if best is not None:  # the DP's rounding admits a superset of the brute force's choices
            (cost, wgrad), _ = best
            assert key[0] < cost - 1e-12 or (key[0] <= cost + 1e-12 and key[1] <= wgrad + 1e-12)


def test_cost_model_fp4_gain_shrinks_on_small_matrices_and_hopper_has_no_fp4():
    b200, h100 = TARGETS["b200"], TARGETS["h100"]

    def ratio(target, fmt, size, quantize="fused"):  # the quantizers fused, as a compiled run takes them
        return gemm_cost(target, fmt, size, size, size, quantize) / gemm_cost(
            target, "bf16", size, size, size
        )

    # 9 vs 2.25 PFLOPS, plus the casts: NVFP4's wgrad operands are rotated to float32 (a batched matmul
    # inductor does not fuse into the cast) and quantized apart, ~16 bytes per operand element
    assert 0.36 < ratio(b200, "nvfp4", 16384) < 0.40
    # eager CUDA quantizes NVFP4 with the pure-torch ops (no Triton kernel): ~640 bytes per element
    assert ratio(b200, "nvfp4", 16384, "triton") > 5
    assert ratio(b200, "nvfp4", 16384) < ratio(b200, "nvfp4", 1024) < ratio(b200, "nvfp4", 64)
    assert ratio(b200, "fp8_rowwise", 16384) < ratio(b200, "fp8_rowwise", 256)
    assert ratio(h100, "nvfp4", 16384) > 1 and ratio(h100, "mxfp8", 16384) > 1
    assert ratio(h100, "fp8_rowwise", 16384) < 0.6
    assert ratio(TARGETS["b200-peak"], "nvfp4", 64) == pytest.approx(0.25)
    assert math.isfinite(ratio(b200, "fp32", 64))


def test_replan_from_a_plain_loop_replans_every_n_steps_and_switches_at_a_phase(planned):
    model, batches, _plan, _ = planned
    model = copy.deepcopy(model)
    calls = []

    def make_plan(m: nn.Module) -> PrecisionPlan:
        calls.append(m)
        return plan_precision(
            m, batches[:1], loss_fn, formats=("mxfp8", "bf16"), budget=BUDGET, cost="b200-peak"
        )

    replan = Replan(make_plan, every=3, phases={5: "bf16"})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    weight = model.fc1.weight
    for step in range(8):
        replan.step(model, step)
        opt.zero_grad()
        loss_fn(model, batches[0]).backward()
        opt.step()
    assert [s for s, _ in replan.history] == [0, 3, 5]  # every 3 until the bf16 phase fixes the formats
    assert len(calls) == 2 and all(m is model for m in calls)
    assert set(replan.history[-1][1].values()) == {"bf16"}
    assert all(type(m) is nn.Linear for m in (model.fc1, model.fc2, model.fc3, model.head))
    assert model.fc1.weight is weight and opt.state[weight]["step"] == 8
    with pytest.raises(ValueError, match="every must be"):
        Replan(make_plan, every=0)
    with pytest.raises(ValueError, match="unknown low-bit recipe 'fp5'"):
        Replan(make_plan, phases={3: "fp5"})


def test_replan_refused_plan_changes_nothing_and_a_first_phase_has_a_share():
    model, _ = _task()
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    good = PrecisionPlan(dict.fromkeys(names, "mxfp8"), {}, dict.fromkeys(names, "test"), 0.01, {})
    replan = Replan(lambda m: good, every=2, phases={4: "nvfp4"})
    replan.step(model, 0)
    other = nn.Sequential(nn.Linear(4, 4))  # a model the applied plan's layers are not in
    before = copy.deepcopy(other.state_dict())
    with pytest.raises(ValueError, match="not nn.Linear modules"):
        replan.step(other, 4)
    assert replan.plan is good and len(replan.history) == 1 and not replan._fixed
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())
    assert replan.step(model, 6) is good  # still re-planning every 2 steps: the refused phase fixed nothing
    # a fixed phase before any plan: every layer in one format, its low-precision share known without flops
    plan = Replan(lambda m: good, phases={0: "nvfp4"}).step(model, 0)
    assert plan is not None and set(plan.formats.values()) == {"nvfp4"}
    assert plan.low_precision_share() == 1.0
    assert Replan(lambda m: good, phases={0: "bf16"}).step(model, 0).low_precision_share() == 0.0


def test_a_phase_before_any_plan_resumes_from_its_state_dict_and_shows_its_table(planned):
    # was: load_state_dict raised "plan formats name layers without measurements" (a checkpoint taken
    # during a bf16 warm-up phase could not resume), and table()/relative_cost() raised KeyError
    model, batches, _plan, _ = planned
    model = copy.deepcopy(model)

    def make_plan(m: nn.Module) -> PrecisionPlan:
        return plan_precision(
            m, batches[:1], loss_fn, formats=("nvfp4", "bf16"), budget=BUDGET, cost="b200-peak"
        )

    replan = Replan(make_plan, phases={0: "bf16", 4: "replan"})
    replan.step(model, 0)
    resumed = Replan(make_plan, phases={0: "bf16", 4: "replan"})
    resumed.load_state_dict(replan.state_dict())
    assert resumed.plan.to_json() == replan.plan.to_json() and resumed.history == replan.history
    table = resumed.plan.table()
    assert "fc1" in table and "set without a measurement in their format (a Replan phase)" in table
    assert math.isnan(resumed.plan.relative_cost())
    resumed.step(model, 4)  # the planned formats, then a phase into one the plan never measured
    switched = Replan(make_plan, phases={1: "mxfp8_floor"})
    switched.step(model, 0)
    phase = switched.step(model, 1)
    assert phase is not None and "mxfp8_floor" not in phase.layers["fc1"]["divergence"]
    assert "fc1" in phase.table() and math.isnan(phase.relative_cost())
    phase.plot()
