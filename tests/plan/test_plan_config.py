"""PlanConfig: the planner's settings as one checked value; and `compiled`, the path each format is priced at.

Compiled costs are timed for real on the CPU (torch.compile with inductor, or aot_eager where only the
bookkeeping is under test); what the plan records is checked against a scripted timer, whose costs are
known exactly.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixprec.plan import PlanConfig, PrecisionPlan, plan_precision
from mixprec.plan.cost import TARGETS, MeasuredCost, gemm_cost, resolve_cost


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(2)]


def loss_fn(model: nn.Module, batch) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


class Fixed:
    """A timer returning fixed seconds per format; it runs each step so the step is exercised."""

    def __init__(self, seconds: dict[str, float]):
        self.seconds = seconds
        self.grads: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, fmt, shape, run) -> float:
        self.grads[fmt] = run()
        return self.seconds[fmt]


def test_config_and_keyword_options_give_the_same_plan():
    options = {"formats": ("mxfp8", "bf16"), "budget": 0.5, "cost": "b200", "tokens_per_step": 4096}
    by_kwargs = plan_precision(_mlp(), _batches(), loss_fn, **options)
    by_config = plan_precision(_mlp(), _batches(), loss_fn, PlanConfig(**options))
    assert dataclasses.replace(by_kwargs, seconds=0.0, step_seconds=0.0) == dataclasses.replace(
        by_config, seconds=0.0, step_seconds=0.0
    )


def test_config_normalizes_sequences_and_numbers():
    config = PlanConfig(formats=["bf16", "mxfp8", "bf16"], budget=1, state_formats=[None, None, "int8"])
    assert config.formats == ("bf16", "mxfp8") and config.state_formats == (None, "int8")
    assert config.budget == 1.0 and isinstance(config.budget, float)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.budget = 0.5  # type: ignore[misc]


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"budget": 0.0}, r"budget must be > 0 .* got 0\.0"),
        ({"budget": float("nan")}, r"budget must be a finite number > 0 .* got nan"),
        ({"formats": ("mxfp8", "fp7")}, r"unknown format 'fp7'; known: .*mxfp8.*bf16"),
        ({"formats": "mxfp8"}, r"formats must be a non-empty sequence of format names, got 'mxfp8'"),
        ({"max_flushed": 1.5}, r"max_flushed must be a share in \(0, 1\], got 1\.5"),
        ({"max_rounds": 0}, r"max_rounds must be an int >= 1, got 0"),
        ({"measure": "fast"}, r"measure must be 'exact' or 'local', got 'fast'"),
        ({"max_memory": "2 parsecs"}, r"max_memory must be .*'2GiB'.*got '2 parsecs'"),
        (
            {"state_formats": ("fp4",)},
            r"state_formats must be a non-empty list of None and .*unknown: \['fp4'\]",
        ),
        (
            {"weight_update": "sgd"},
            r"weight_update must be one of \('kahan', 'stochastic', 'masters'\), got 'sgd'",
        ),
        ({"tokens_per_step": 0}, r"tokens_per_step must be a positive int .* got 0"),
        ({"cost": "a100"}, r"unknown cost target 'a100'; known: .*measured"),
        ({"compiled": "yes"}, r"compiled must be True or False, got 'yes'"),
        ({"seed": "a"}, r"seed must be an int .* got 'a'"),  # was accepted, then torch's RuntimeError
        ({"seed": 1.5}, r"seed must be an int .* got 1\.5"),
        ({"exhaustive": "no"}, r"exhaustive must be True or False, got 'no'"),  # was taken as True
        ({"max_cost": 0.5}, r"not both: pass budget=None with max_cost=0\.5"),
        ({"budget": None}, r"budget=None needs max_cost"),
    ],
)
def test_config_refuses_bad_values_naming_them(options, match):
    with pytest.raises(ValueError, match=match):
        PlanConfig(**options)
    with pytest.raises(ValueError, match=match):  # the keyword options build the same config
        plan_precision(_mlp(), _batches(), loss_fn, **options)


def test_cost_of_another_type_is_a_type_error():
    with pytest.raises(TypeError, match=r"cost must be a target name, a callable .* got 3"):
        PlanConfig(cost=3)  # type: ignore[arg-type]


def test_unknown_option_or_config_with_options_is_refused():
    with pytest.raises(
        TypeError, match=r"unexpected keyword argument\(s\) 'budgte'; accepted: formats, budget"
    ):
        plan_precision(_mlp(), _batches(), loss_fn, budgte=0.1)
    with pytest.raises(
        TypeError, match=r"a config or keyword options, not both: got config and \['budget'\]"
    ):
        plan_precision(_mlp(), _batches(), loss_fn, PlanConfig(), budget=0.1)
    with pytest.raises(TypeError, match=r"config must be a mixprec.plan.PlanConfig, got dict"):
        plan_precision(_mlp(), _batches(), loss_fn, {"budget": 0.1})  # type: ignore[arg-type]


def test_compiled_measured_cost_times_the_compiled_layer_under_its_own_keys():
    torch._dynamo.reset()
    formats = ["mxfp8", "bf16", "fp32"]
    eager_timer, compiled_timer = Fixed(dict.fromkeys(formats, 1.0)), Fixed(dict.fromkeys(formats, 2.0))
    eager = MeasuredCost("cpu", torch.float32, formats, warmup=1, repeats=1, _timer=eager_timer)
    compiled = MeasuredCost(
        "cpu",
        torch.float32,
        formats,
        warmup=1,
        repeats=1,
        compiled=True,
        backend="aot_eager",
        _timer=compiled_timer,
    )
    assert eager.__name__ == "measured:cpu" and compiled.__name__ == "measured:cpu:compiled"
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert [compiled(f, 16, 32, 32) for f in formats] == [2.0] * 3
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > frames  # dynamo captured the layers
    assert [eager(f, 16, 32, 32) for f in formats] == [1.0] * 3
    assert set(compiled.samples) == {("cpu:compiled", f, 16, 32, 32) for f in formats}
    for fmt in formats:  # the same layer and inputs: the compiled path computes what the eager one does
        for a, b in zip(compiled_timer.grads[fmt], eager_timer.grads[fmt], strict=True):
            torch.testing.assert_close(a, b)


def test_compiled_measured_cost_needs_a_warmup():
    with pytest.raises(ValueError, match=r"needs warmup >= 1 \(the first call compiles\), got 0"):
        MeasuredCost("cpu", compiled=True, warmup=0)


def test_plan_prices_at_the_compiled_or_the_eager_measurement():
    formats = ["mxfp8", "bf16", "fp32"]
    eager = MeasuredCost(
        "cpu", formats=formats, repeats=1, _timer=Fixed({"mxfp8": 3.0, "bf16": 2.0, "fp32": 4.0})
    )
    compiled = MeasuredCost(
        "cpu",
        formats=formats,
        repeats=1,
        compiled=True,
        backend="aot_eager",
        _timer=Fixed({"mxfp8": 1.0, "bf16": 2.0, "fp32": 4.0}),
    )
    args = {"formats": ("mxfp8", "bf16"), "budget": 0.5, "max_flushed": 1.0, "tokens_per_step": 16}
    eager_plan = plan_precision(_mlp(), _batches(), loss_fn, cost=eager, **args)
    compiled_plan = plan_precision(_mlp(), _batches(), loss_fn, cost=compiled, compiled=True, **args)
    assert eager_plan.target == "measured:cpu" and compiled_plan.target == "measured:cpu:compiled"
    assert eager_plan.layers["0"]["cost"] == {"mxfp8": 3.0, "bf16": 2.0, "fp32": 4.0}
    assert compiled_plan.layers["0"]["cost"] == {"mxfp8": 1.0, "bf16": 2.0, "fp32": 4.0}
    assert set(eager_plan.formats.values()) == {"bf16"}  # eager mxfp8 costs more than bf16 here
    assert set(compiled_plan.formats.values()) == {"mxfp8"}  # compiled it costs less, and fits the budget
    assert PrecisionPlan.from_json(compiled_plan.to_json()).target == "measured:cpu:compiled"


def test_plan_with_cost_measured_and_compiled_times_compiled_layers_on_cpu():
    torch._dynamo.reset()
    name, cost = resolve_cost("measured", _mlp(), ["bf16"], compiled=True)
    assert name == "measured:cpu:compiled" and isinstance(cost, MeasuredCost) and cost.backend == "inductor"
    plan = plan_precision(
        _mlp(),
        _batches()[:1],
        loss_fn,
        formats=("bf16",),
        budget=0.5,
        cost="measured",
        compiled=True,
        tokens_per_step=16,
    )
    assert plan.target == "measured:cpu:compiled"
    assert all(c > 0 for info in plan.layers.values() for c in info["cost"].values())


def test_compiled_prices_a_roofline_targets_quantization_fused(monkeypatch):
    monkeypatch.delenv("MIXPREC_FUSED_QUANTIZE", raising=False)
    args = {"formats": ("mxfp8", "bf16"), "budget": 0.5, "cost": "h100", "tokens_per_step": 4096}
    eager = plan_precision(_mlp(), _batches(), loss_fn, **args)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a target name has a compiled figure: no warning
        compiled = plan_precision(_mlp(), _batches(), loss_fn, compiled=True, **args)
    assert compiled.target == eager.target == "h100"
    for fqn, info in compiled.layers.items():
        shape = (info["priced_rows"], *info["shape"][1:])
        h100 = TARGETS["h100"]
        assert info["cost"]["mxfp8"] == gemm_cost(h100, "mxfp8", *shape, quantize="fused")
        assert eager.layers[fqn]["cost"]["mxfp8"] == gemm_cost(h100, "mxfp8", *shape, quantize="triton")
        assert info["cost"]["mxfp8"] < eager.layers[fqn]["cost"]["mxfp8"]  # MX has no Triton kernel
    unfused = plan_precision(_mlp(), _batches(), loss_fn, quantize="unfused", **args)
    monkeypatch.setenv("MIXPREC_FUSED_QUANTIZE", "0")
    switched = plan_precision(_mlp(), _batches(), loss_fn, **args)
    assert {f: i["cost"] for f, i in switched.layers.items()} == {
        f: i["cost"] for f, i in unfused.layers.items()
    }


def test_compiled_with_a_callable_cost_warns_and_prices_its_figure():
    cost = lambda fmt, m, n, k: 1.0 if fmt == "bf16" else 0.5  # noqa: E731
    args = {"formats": ("mxfp8", "bf16"), "budget": 0.5, "cost": cost, "tokens_per_step": 4096}
    with pytest.warns(UserWarning, match=r"compiled=True, but the cost '<lambda>' has one figure per format"):
        compiled = plan_precision(_mlp(), _batches(), loss_fn, compiled=True, **args)
    assert all(i["cost"]["mxfp8"] == 0.5 for i in compiled.layers.values())


def test_a_bad_quantize_path_is_refused_by_name():
    with pytest.raises(
        ValueError, match=r"quantize must be one of 'fused', 'triton', 'unfused'.*got 'inductor'"
    ):
        PlanConfig(quantize="inductor")
