"""ReplanSchedule, the framework-free core of the trainers' re-planning callbacks, in a plain loop.

The plans come from :func:`mixprec.plan.plan_precision` on a small MLP; variants are that real plan with
other formats (``dataclasses.replace``), so that each test controls what changes when.
"""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from torch import nn

from mixprec.lowbit import LowbitLinear, get_recipe
from mixprec.plan import PrecisionPlan, plan_precision
from mixprec.plan.schedule import METRIC, ReplanSchedule


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def batches(n: int = 12) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(n)]


@pytest.fixture(scope="module")
def plan() -> PrecisionPlan:
    return plan_precision(
        make_model(), batches(1), loss_fn, formats=("mxfp8", "bf16"), budget=0.5, cost="b200-peak"
    )


def formats_of(model: nn.Module) -> dict[str, str]:
    """What each linear layer of ``model`` runs in: its recipe's string, or "plain"."""
    return {
        fqn: str(m.recipe) if isinstance(m, LowbitLinear) else "plain"
        for fqn, m in model.named_modules()
        if isinstance(m, nn.Linear)
    }


def expected(plan_formats: dict[str, str]) -> dict[str, str]:
    return {
        f: "plain" if fmt in ("bf16", "fp32") else str(get_recipe(fmt)) for f, fmt in plan_formats.items()
    }


def test_a_plan_exists_with_low_bit_layers(plan: PrecisionPlan) -> None:
    assert set(plan.formats) == {"0", "2", "4"}
    assert "mxfp8" in plan.formats.values()  # otherwise the tests below would change nothing


def test_converting_between_formats_keeps_every_parameter_and_its_optimizer_state(
    plan: PrecisionPlan,
) -> None:
    model = make_model()
    params = list(model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = batches(5)
    sequence = [
        {f: "mxfp8" for f in plan.formats},
        {f: "nvfp4" for f in plan.formats},
        {f: "bf16" for f in plan.formats},
        {"0": "fp8_rowwise", "2": "bf16", "4": "nvfp4"},
    ]
    for i, fmts in enumerate(sequence):
        dataclasses.replace(plan, formats=fmts).apply(model)
        assert formats_of(model) == expected(fmts)
        assert all(a is b for a, b in zip(model.parameters(), params, strict=True))
        before = model[0].weight.detach().clone()
        opt.zero_grad()
        loss_fn(model, data[i]).backward()
        opt.step()
        assert not torch.equal(model[0].weight, before)  # the optimizer updates what the layer uses
        assert all(opt.state[p]["step"] == i + 1 for p in params)  # the state stayed attached


def lambda_schedule(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    """Warm-up for 3 steps, constant for 4, then exponential decay: the shape of a WSD schedule."""
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: (i + 1) / 3 if i < 3 else 1.0 if i < 7 else 0.8 ** (i - 6)
    )


def test_replans_every_n_steps_switches_when_the_lr_decays_and_calls_once_per_step(
    plan: PrecisionPlan,
) -> None:
    model, calls = make_model(), []

    def make_plan(m: nn.Module) -> PrecisionPlan:
        calls.append(len(calls))
        fmt = ("mxfp8", "nvfp4")[len(calls) % 2]
        return dataclasses.replace(plan, formats=dict.fromkeys(plan.formats, fmt))

    schedule = ReplanSchedule(make_plan, every=2, lr_decay="bf16", lr_fraction=0.9)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = lambda_schedule(opt)
    lrs, seen = [], []
    for step, batch in enumerate(batches(10)):
        lr = opt.param_groups[0]["lr"]
        lrs.append(lr)
        schedule.begin_step(model, step, lr)
        assert schedule.begin_step(model, step, lr) is None  # a second micro-batch of the same step
        seen.append(formats_of(model))
        assert schedule.metrics() == {METRIC: schedule.plan.low_precision_share()}
        loss_fn(model, batch).backward()
        opt.step()
        opt.zero_grad()
        scheduler.step()
    decay = next(s for s in range(1, 10) if lrs[s] < 0.9 * max(lrs[:s]))  # from this run's own LRs
    assert decay == 7
    assert schedule.decay_step == decay and schedule.peak_lr == max(lrs)
    assert [s for s, _ in schedule.replan.history] == [0, 2, 4, 6, decay]
    assert len(calls) == 4  # the decay phase fixes the formats: no re-plan at step 8
    for step, (at, fmts) in zip((0, 2, 4, 6, decay), schedule.replan.history, strict=True):
        assert at == step and seen[step] == expected(fmts)
    assert seen[-1] == expected(dict.fromkeys(plan.formats, "bf16"))
    assert schedule.metrics() == {METRIC: 0.0}


def test_a_checkpointed_schedule_resumes_with_its_plan_on_a_fresh_model(plan: PrecisionPlan) -> None:
    mixed = dataclasses.replace(plan, formats={"0": "mxfp8", "2": "nvfp4", "4": "bf16"})
    first = ReplanSchedule(lambda m: mixed, every=100, lr_decay="bf16")
    model = make_model()
    for step in range(3):
        first.begin_step(model, step, 1e-2)
    state = copy.deepcopy(first.state_dict())
    assert json.loads(json.dumps(state)) == state  # plain types, as a weights_only checkpoint needs
    restored = ReplanSchedule(lambda m: pytest.fail("no re-plan on resume"), every=100, lr_decay="bf16")
    restored.load_state_dict(state)
    fresh = make_model()
    assert set(formats_of(fresh).values()) == {"plain"}
    assert restored.begin_step(fresh, 3, 1e-2) is None  # nothing due at step 3, the saved plan applied
    assert formats_of(fresh) == expected(mixed.formats) and restored.plan == mixed
    assert restored.replan.history == first.replan.history and restored.peak_lr == 1e-2
    restored.begin_step(fresh, 4, 5e-3)  # the learning rate falls: the decay phase
    assert restored.decay_step == 4 and set(formats_of(fresh).values()) == {"plain"}


def test_bad_arguments_are_refused_by_name(plan: PrecisionPlan) -> None:
    ok = lambda m: plan  # noqa: E731
    for bad in (0.0, 1.5, True, "half", float("nan")):
        with pytest.raises(ValueError, match="lr_fraction must be"):
            ReplanSchedule(ok, lr_fraction=bad)
    with pytest.raises(ValueError, match="unknown low-bit recipe 'fp5'"):
        ReplanSchedule(ok, lr_decay="fp5")
    # were: the recipes alone listed as accepted (bf16, fp32, replan left out), and for the lr a bare
    # "TypeError: must be real number, not str" naming neither lr nor what it takes
    accepted = r"; a phase also takes 'replan', 'bf16' or 'fp32'"
    with pytest.raises(ValueError, match=r"lr_decay: unknown low-bit recipe 'fp16'.*nvfp4" + accepted):
        ReplanSchedule(ok, lr_decay="fp16")
    with pytest.raises(ValueError, match=r"phases\[5\]: unknown low-bit recipe 'fp16'.*nvfp4" + accepted):
        ReplanSchedule(ok, phases={5: "fp16"})
    with pytest.raises(
        ValueError, match=r"lr must be a number \(the step's learning rate\) or None, got 'a'"
    ):
        ReplanSchedule(ok, lr_decay="bf16").begin_step(make_model(), 0, lr="a")
    with pytest.raises(ValueError, match="every must be"):
        ReplanSchedule(ok, every=0)
    with pytest.raises(TypeError, match="make_plan must be callable"):
        ReplanSchedule("plan")
    schedule = ReplanSchedule(ok)
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        schedule.begin_step(make_model(), -1)
    with pytest.raises(ValueError, match="not a ReplanSchedule state_dict"):
        schedule.load_state_dict({"replan": {}})
    state = ReplanSchedule(ok).state_dict()
    with pytest.raises(ValueError, match="not a Replan state_dict"):
        schedule.load_state_dict({**state, "replan": {"plan": None}})
    with pytest.raises(ValueError, match="'peak_lr' must be a number"):
        schedule.load_state_dict({**state, "peak_lr": "high"})
    bad_history = {**state["replan"], "history": [["3", {"0": "bf16"}]]}
    with pytest.raises(ValueError, match="'history' must be a list of"):
        schedule.load_state_dict({**state, "replan": bad_history})
    with pytest.raises(ValueError, match="not a mixprec precision plan"):
        schedule.load_state_dict({**state, "replan": {**state["replan"], "plan": "{}"}})
    assert schedule.state_dict() == state  # every refusal left it as built


@pytest.mark.parametrize("bad", ["not a plan", "wrong layers"])
def test_a_bad_plan_during_training_leaves_model_and_schedule_unchanged(
    plan: PrecisionPlan, bad: str
) -> None:
    model, wrong = make_model(), dataclasses.replace(plan, formats={"0": "mxfp8", "9": "mxfp8"})
    results = iter([dataclasses.replace(plan, formats=dict.fromkeys(plan.formats, "mxfp8")), bad])
    schedule = ReplanSchedule(lambda m: wrong if (r := next(results)) == "wrong layers" else r, every=2)
    schedule.begin_step(model, 0, 1e-2)
    schedule.begin_step(model, 1, 1e-2)
    before_state, before_model = schedule.state_dict(), copy.deepcopy(model.state_dict())
    before_formats = formats_of(model)
    error = TypeError if bad == "not a plan" else ValueError
    with pytest.raises(error, match="PrecisionPlan, got str|not nn.Linear modules of the model: \\['9'\\]"):
        schedule.begin_step(model, 2, 1e-2)
    assert schedule.state_dict() == before_state and formats_of(model) == before_formats
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before_model[name]), name


def test_a_phase_given_for_the_step_the_lr_decays_at_wins(plan: PrecisionPlan) -> None:
    mx = dataclasses.replace(plan, formats=dict.fromkeys(plan.formats, "mxfp8"))
    schedule = ReplanSchedule(lambda m: mx, phases={2: "nvfp4"}, lr_decay="bf16")
    model = make_model()
    for step, lr in enumerate((1e-2, 1e-2, 5e-3, 4e-3)):
        schedule.begin_step(model, step, lr)
    assert schedule.decay_step == 2  # the decay began at step 2, where the user's phase applies
    assert [(s, set(f.values())) for s, f in schedule.replan.history] == [(0, {"mxfp8"}), (2, {"nvfp4"})]
    assert set(formats_of(model).values()) == {str(get_recipe("nvfp4"))}
