"""cost="measured": each layer shape's GEMMs timed on the model's device, formats interleaved, the median.

Timings are never asserted: a scripted timer stands in for the clock, so the costs are known exactly.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixprec.plan import PrecisionPlan, plan_precision
from mixprec.plan.cost import MeasuredCost, resolve_cost

FORMATS = ["nvfp4", "mxfp8", "bf16", "fp32"]


class Scripted:
    """A timer returning, per format, the next of its scripted seconds; it records each call in order
    and runs the step (so the step itself is exercised, and its gradients' shapes checked)."""

    def __init__(self, script: dict[str, list[float]] | None = None, base: dict[str, float] | None = None):
        self.script = {fmt: list(times) for fmt, times in (script or {}).items()}
        self.base = base or {}
        self.calls: list[tuple[str, tuple[int, int, int]]] = []

    def __call__(self, fmt, shape, run) -> float:
        m, n, k = shape
        grad_x, grad_w = run()
        assert grad_x.shape == (m, k) and grad_w.shape == (n, k)
        self.calls.append((fmt, shape))
        return self.script[fmt].pop(0) if fmt in self.script else self.base[fmt]


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(2)]


def loss_fn(model: nn.Module, batch) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_cost_is_the_median_of_rounds_interleaved_across_formats():
    script = {"nvfp4": [5.0, 1.0, 3.0], "mxfp8": [2.0, 9.0, 4.0], "bf16": [7.0, 6.0, 8.0], "fp32": [1, 1, 2]}
    timer = Scripted(script)
    cost = MeasuredCost("cpu", torch.float32, FORMATS, warmup=1, repeats=3, _timer=timer)
    assert cost("mxfp8", 8, 12, 16) == 4.0  # the first call times every format of the shape
    assert [fmt for fmt, _ in timer.calls] == FORMATS * 3  # round by round, each format once per round
    assert {shape for _, shape in timer.calls} == {(8, 12, 16)}
    assert (cost("nvfp4", 8, 12, 16), cost("bf16", 8, 12, 16), cost("fp32", 8, 12, 16)) == (3.0, 7.0, 1.0)
    assert cost.samples[("cpu", "nvfp4", 8, 12, 16)] == [5.0, 1.0, 3.0]
    assert len(timer.calls) == 12  # cached: asking again times nothing


def test_a_format_outside_the_list_is_timed_alone_and_a_new_shape_times_all_again():
    timer = Scripted(base={"nvfp4": 3.0, "bf16": 2.0, "mxfp4": 1.5})
    cost = MeasuredCost("cpu", torch.float32, ["nvfp4", "bf16"], warmup=0, repeats=2, _timer=timer)
    cost("bf16", 4, 4, 16)
    assert cost("mxfp4", 4, 4, 16) == 1.5
    assert [fmt for fmt, _ in timer.calls] == ["nvfp4", "bf16"] * 2 + ["mxfp4"] * 2
    cost("nvfp4", 4, 8, 16)
    assert [shape for _, shape in timer.calls[-4:]] == [(4, 8, 16)] * 4


def test_measuring_leaves_torch_global_rng_alone():
    before = torch.random.get_rng_state()
    MeasuredCost("cpu", torch.float32, ["nvfp4", "bf16"], warmup=1, repeats=1)("nvfp4", 4, 8, 32)
    assert torch.equal(torch.random.get_rng_state(), before)


def test_plan_with_measured_cost_chooses_by_those_costs_and_measures_each_shape_once():
    model, batches = _mlp(), _batches()
    args = {"formats": ("nvfp4", "mxfp8", "bf16"), "budget": 0.5, "max_flushed": 1.0}
    roofline = plan_precision(model, batches, loss_fn, cost="b200-peak", **args)
    assert "nvfp4" in roofline.formats.values()  # where nvfp4 is cheapest the plan uses it
    timer = Scripted(base={"nvfp4": 10.0, "mxfp8": 1.0, "bf16": 2.0, "fp32": 4.0})
    cost = MeasuredCost("cpu", torch.float32, ["nvfp4", "mxfp8", "bf16", "fp32"], repeats=3, _timer=timer)
    plan = plan_precision(model, batches, loss_fn, cost=cost, **args)
    assert plan.target == "measured:cpu"
    assert "nvfp4" not in plan.formats.values() and "mxfp8" in plan.formats.values()
    assert plan.layers["0"]["cost"] == {"nvfp4": 10.0, "mxfp8": 1.0, "bf16": 2.0, "fp32": 4.0}
    shapes = [shape for _, shape in timer.calls]
    assert shapes.count((16, 32, 32)) == shapes.count((16, 4, 32)) == 3 * 4  # two layers, measured once
    assert PrecisionPlan.from_json(plan.to_json()).target == "measured:cpu"


def test_plan_with_cost_measured_runs_on_cpu_and_records_it():
    model, batches = _mlp(), _batches()
    before = _state(model)
    plan = plan_precision(model, batches, loss_fn, formats=("mxfp8", "bf16"), budget=0.5, cost="measured")
    assert plan.target == "measured:cpu"
    for info in plan.layers.values():
        assert set(info["cost"]) == {"mxfp8", "bf16", "fp32"}
        assert all(c > 0 for c in info["cost"].values())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert PrecisionPlan.from_json(plan.to_json()) == plan


def test_default_cost_is_b200_on_a_cpu_model():
    assert resolve_cost(None, _mlp())[0] == "b200"
    assert resolve_cost(None)[0] == "b200"
    plan = plan_precision(_mlp(), _batches()[:1], loss_fn, formats=("mxfp8", "bf16"), budget=0.5)
    assert plan.target == "b200"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_default_cost_is_measured_on_a_cuda_model():
    model = _mlp().cuda()
    batches = [(x.cuda(), y.cuda()) for x, y in _batches()]
    name, cost = resolve_cost(None, model, ["bf16"])
    assert name == f"measured:cuda:{torch.cuda.get_device_name()}"
    assert cost("bf16", 64, 64, 64) > 0
    plan = plan_precision(model, batches, loss_fn, formats=("fp8_rowwise", "bf16"), budget=0.5)
    assert plan.target == name


def test_unknown_cost_name_lists_measured_and_leaves_the_model_unchanged():
    model = _mlp()
    before = _state(model)
    with pytest.raises(ValueError, match=r"unknown cost target 'a100'; known: .*measured"):
        plan_precision(model, _batches(), loss_fn, cost="a100")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(type(m) is nn.Linear for m in model if not isinstance(m, nn.ReLU))


@pytest.mark.parametrize(
    ("kwargs", "match"), [({"repeats": 0}, "repeats must be"), ({"warmup": -1}, "warmup")]
)
def test_bad_repeats_or_warmup_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MeasuredCost("cpu", **kwargs)
