"""plan_precision(..., max_memory=...): the memory model against the bytes a real step holds, the formats
a tight bound picks, the infeasible bound's error, the JSON versions and what the plan hands the user
(issue 30 item 4)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import mixprec
from mixprec.optim.state_formats import state_nbytes
from mixprec.plan import PrecisionPlan, plan_precision
from mixprec.plan.memory import MemoryModel, parse_bytes

ROWS = 96


def _stack(dtype: torch.dtype = torch.bfloat16) -> nn.Sequential:
    """Linears only: every saved activation is a linear's input, so the model's count is exact."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(300, 70), nn.Linear(70, 40, bias=False), nn.Linear(40, 5)).to(dtype)


def _optimizer(model: nn.Module, update: str, state_format: str | None):
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if update == "masters":
        return mixprec.MixedPrecisionOptimizer(inner, scaler=None, state_format=state_format)
    kwargs = {"state_format": state_format} if state_format else {"state_dtype": torch.float32}
    return mixprec.CompensatedOptimizer(inner, method=update, **kwargs)


def _held_bytes(model: nn.Module, opt, update: str) -> dict[str, int]:
    """What one step leaves allocated, read off the tensors themselves."""
    size = lambda t: t.numel() * t.element_size()  # noqa: E731
    weights = sum(size(p) for p in model.parameters())
    if update == "masters":
        weights += sum(size(m) for m in opt.master_params)
    state = state_nbytes(opt.optimizer) + sum(size(c) for c in getattr(opt, "compensation", []))
    return {
        "weights": weights,
        "gradients": sum(size(p.grad) for p in model.parameters()),
        "optimizer_state": state,
    }


@pytest.mark.parametrize("state_format", [None, "bf16", "int8", "fp8"])
@pytest.mark.parametrize("update", ["kahan", "stochastic", "masters"])
def test_weights_gradients_and_state_match_a_real_step_exactly(update: str, state_format: str | None) -> None:
    model = _stack()
    predicted = MemoryModel.of(model, {}, update).components(state_format, None)
    opt = _optimizer(model, update, state_format)
    model(torch.randn(ROWS, 300, dtype=torch.bfloat16)).float().square().mean().backward()
    opt.step()
    held = _held_bytes(model, opt, update)
    assert {k: predicted[k] for k in held} == held


@pytest.mark.parametrize("fmt", [None, "fp8", "mxfp8"])
def test_saved_activations_match_the_bytes_autograd_keeps(fmt: str | None) -> None:
    model = _stack(torch.float32)
    rows = {name: ROWS for name in ("0", "1", "2")}
    predicted = MemoryModel.of(model, rows).components(None, fmt)["activations"]
    x = torch.randn(ROWS, 300)
    if fmt is None:
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            root = t._base if t._base is not None else t
            if not isinstance(root, nn.Parameter):  # the weights are held by the model anyway
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(x).sum().backward()
        measured = sum(seen.values())
    else:
        with mixprec.lowbit.save_activations(fmt, module=model) as saved:
            loss = model(x).sum()
        loss.backward()
        assert saved.quantized == 3
        measured = saved.packed_bytes
    assert predicted == measured


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)).to(torch.bfloat16)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [tuple(torch.randn(32, 64, generator=g).to(torch.bfloat16) for _ in range(2))]  # type: ignore[misc]


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.mse_loss(model(batch[0]).float(), batch[1].float())


def _plan(**kwargs) -> PrecisionPlan:
    return plan_precision(_mlp(), _batches(), _loss, formats=("bf16",), tokens_per_step=8192, **kwargs)


def test_without_a_bound_the_first_listed_formats_are_planned_and_memory_reported() -> None:
    plan = _plan()
    assert (plan.state_format, plan.activation_format) == (None, None)
    c = plan.memory["components"]
    assert c["activations"] == 8192 * (64 + 256) * 2  # two bf16 inputs of 8192 rows
    assert c["total"] == sum(c[k] for k in ("weights", "gradients", "optimizer_state", "activations"))
    assert "state_format=None, save_activations=None" in plan.table()


def test_a_tight_bound_picks_smaller_formats_and_fits() -> None:
    free = _plan().memory
    totals = {(o["state_format"], o["activation_format"]): o["total"] for o in free["options"]}
    bound = totals[("bf16", "fp8")]  # below fp32 moments with any activations, above the 8-bit states'
    plan = _plan(max_memory=bound)
    chosen = (plan.state_format, plan.activation_format)
    assert chosen != (None, None)
    assert plan.memory["components"]["total"] == totals[chosen] <= bound
    # it keeps the most bytes among the pairs that fit: no fitting pair quantizes less
    assert totals[chosen] == max(t for t in totals.values() if t <= bound)
    assert plan.memory["max_memory"] == bound
    assert f"max_memory {bound / 2**20:.2f} MiB" in plan.table()


def test_an_infeasible_bound_names_the_least_memory() -> None:
    least = min(o["total"] for o in _plan().memory["options"])
    with pytest.raises(ValueError, match=rf"below the least memory these formats reach: {least} bytes"):
        _plan(max_memory=least - 1)


def test_a_bound_below_the_parameters_alone_is_refused_before_any_pass() -> None:
    calls = []

    def loss(model: nn.Module, batch) -> torch.Tensor:
        calls.append(1)
        return _loss(model, batch)

    with pytest.raises(ValueError, match="weights, gradients and optimizer state alone"):
        plan_precision(_mlp(), _batches(), loss, formats=("bf16",), tokens_per_step=64, max_memory="10kB")
    assert calls == []


@pytest.mark.parametrize(
    "value, expected",
    [(4096, 4096), ("2GiB", 2**31), ("512MB", 512 * 10**6), ("1.5 KiB", 1536), ("7b", 7)],
)
def test_sizes_parse(value: int | str, expected: int) -> None:
    assert parse_bytes(value) == expected


@pytest.mark.parametrize("value", [0, -3, True, 1.5, "2 parsecs", "GiB", "", None, "0MB"])
def test_bad_sizes_are_refused_by_name(value: object) -> None:
    with pytest.raises(ValueError, match=r"max_memory must be an int number of bytes > 0 or a string like"):
        parse_bytes(value)


def test_bad_candidate_formats_are_refused() -> None:
    with pytest.raises(ValueError, match=r"state_formats must be .* \(unknown: \['int4'\]\)"):
        _plan(state_formats=("int4",))
    with pytest.raises(ValueError, match=r"activation_formats must be"):
        _plan(activation_formats=())
    with pytest.raises(ValueError, match=r"weight_update must be one of"):
        _plan(weight_update="sgd")


def test_json_round_trips_and_a_version_4_plan_still_loads() -> None:
    plan = _plan(max_memory=_plan().memory["components"]["total"] - 1)
    again = PrecisionPlan.from_json(plan.to_json())
    assert again == plan and again.activation_format == plan.activation_format
    old = json.loads(plan.to_json())
    old["version"] = 4
    for key in ("state_format", "activation_format", "memory"):
        del old[key]
    loaded = PrecisionPlan.from_json(json.dumps(old))
    assert loaded.memory is None and loaded.state_format is None and loaded.formats == plan.formats
    assert "memory (" not in loaded.table() and loaded.optimizer_kwargs() == {"state_format": None}


def test_what_the_plan_hands_over_holds_the_bytes_it_predicted() -> None:
    free = _plan().memory["options"]
    bound = min(
        o["total"] for o in free if o["activation_format"] is not None and o["state_format"] == "int8"
    )
    plan = _plan(max_memory=bound)
    assert plan.state_format in ("int8", "fp8") and plan.activation_format is not None
    model = _mlp()
    opt = mixprec.CompensatedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-3), **plan.optimizer_kwargs()
    )
    x = torch.randn(8192, 64, dtype=torch.bfloat16)
    with plan.save_activations(model) as saved:
        loss = model(x).float().square().mean()
    loss.backward()
    opt.step()
    assert saved.fmt == plan.activation_format and saved.quantized >= 2  # both linears' inputs, GELU's too
    held = _held_bytes(model, opt, "kahan")
    assert {k: plan.memory["components"][k] for k in held} == held
