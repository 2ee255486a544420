"""MixprecReplan in Lightning's real Trainer: the tiny module re-planned during fit, checkpointed, resumed."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

L = pytest.importorskip("lightning")

from mixprec.integrations.lightning import MixprecPrecision, MixprecReplan  # noqa: E402
from mixprec.lowbit import LowbitLinear, get_recipe  # noqa: E402
from mixprec.plan import PrecisionPlan, plan_precision  # noqa: E402
from tests.integrations import _tiny_lightning as tiny  # noqa: E402

LINEARS = ("body.0", "body.3", "head")


class Scheduled(tiny.Tiny):
    """The tiny module with a per-step schedule: 2 warm-up steps, constant to step 5, then decaying."""

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        shape = lambda i: (i + 1) / 2 if i < 2 else 1.0 if i < 6 else 0.5  # noqa: E731
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, shape)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def scheduled() -> Scheduled:
    torch.manual_seed(0)
    return Scheduled()


class Planner:
    """plan_precision on two fixed batches; formats alternate between calls so that a re-plan changes them."""

    CHOICES = (("mxfp8", "bf16"), ("nvfp4", "bf16"))

    def __init__(self) -> None:
        self.batches = [batch for _, batch in zip(range(2), tiny.loader(), strict=False)]
        self.plans: list[PrecisionPlan] = []

    def __call__(self, model: nn.Module) -> PrecisionPlan:
        formats = self.CHOICES[len(self.plans) % 2]
        plan = plan_precision(model, self.batches[:1], _loss, formats=formats, budget=0.5, cost="b200-peak")
        self.plans.append(plan)
        return plan


def _loss(model: nn.Module, batch: Any) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def formats_of(model: nn.Module) -> dict[str, str]:
    return {n: str(m.recipe) if isinstance(m, LowbitLinear) else "plain" for n, m in _linears(model)}


def _linears(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def expected(formats: dict[str, str]) -> dict[str, str]:
    return {f: "plain" if fmt in ("bf16", "fp32") else str(get_recipe(fmt)) for f, fmt in formats.items()}


class Probe(L.Callback):
    """After MixprecReplan (listed later), what each step's forward runs in, its LR, and the parameters."""

    def __init__(self) -> None:
        self.formats: dict[int, dict[str, str]] = {}
        self.lrs: dict[int, float] = {}
        self.first_state: dict[str, torch.Tensor] | None = None
        self.params: list[nn.Parameter] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # type: ignore[no-untyped-def]
        step = trainer.global_step
        if self.first_state is None:
            self.first_state = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
            self.params = list(pl_module.parameters())
        self.formats[step] = formats_of(pl_module)
        self.lrs[step] = trainer.optimizers[0].param_groups[0]["lr"]


def fit(model: nn.Module, callback: MixprecReplan, steps: int, tmp: Path, **kw: Any) -> Probe:
    probe = Probe()
    logger = L.pytorch.loggers.CSVLogger(tmp, name="run")
    tiny.trainer(max_steps=steps, callbacks=[callback, probe], logger=logger, log_every_n_steps=1).fit(
        model, tiny.loader(), **kw
    )
    return probe


def logged_shares(tmp: Path) -> dict[int, float]:
    (path,) = tmp.rglob("metrics.csv")
    with open(path) as handle:
        rows = [row for row in csv.DictReader(handle) if row.get("low_precision_flop_share")]
    return {int(row["step"]): float(row["low_precision_flop_share"]) for row in rows}


def test_replans_in_fit_formats_follow_the_plan_checkpoint_restores_and_training_continues(
    tmp_path: Path,
) -> None:
    planner = Planner()
    callback = MixprecReplan(planner, phases={3: "replan"}, lr_decay="bf16")
    model = scheduled()
    probe = fit(model, callback, 5, tmp_path / "a")
    history = callback.schedule.replan.history
    assert [s for s, _ in history] == [0, 3] and len(planner.plans) == 2
    assert [fmts for _, fmts in history] == [plan.formats for plan in planner.plans]
    assert planner.plans[0].formats != planner.plans[1].formats  # the re-plan at step 3 changed formats
    for step in range(5):
        in_force = [fmts for at, fmts in history if at <= step][-1]
        assert probe.formats[step] == expected(in_force), step
    assert all(a is b for a, b in zip(model.parameters(), probe.params, strict=True))
    opt = model.trainer.optimizers[0]
    assert all(opt.state[p]["step"] == 5 for p in probe.params)  # the state stayed with the parameters
    assert len(model.losses) == 5 and all(math.isfinite(float(x)) for x in model.losses)
    shares = logged_shares(tmp_path / "a")
    first, second = (plan.low_precision_share() for plan in planner.plans)
    assert shares == pytest.approx({0: first, 1: first, 2: first, 3: second, 4: second})

    ckpt = tmp_path / "after_replan.ckpt"
    model.trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=True)  # plain types: Lightning may load it weights_only
    resumed_model, resumed = scheduled(), MixprecReplan(planner, phases={3: "replan"}, lr_decay="bf16")
    resumed_model.body[0].weight.data.add_(1.0)  # a different start: the checkpoint must win
    probe = fit(resumed_model, resumed, 9, tmp_path / "b", ckpt_path=str(ckpt))
    assert len(planner.plans) == 2  # resuming re-applies the saved plan, it does not re-plan
    assert probe.formats[5] == expected(planner.plans[1].formats)
    for name, tensor in saved["state_dict"].items():
        assert torch.equal(probe.first_state[name], tensor), name
    steps = sorted(probe.lrs)  # 5..8, from this run's own learning rates
    decay = next(s for i, s in enumerate(steps) if i and probe.lrs[s] < max(probe.lrs[t] for t in steps[:i]))
    assert decay == 6 and resumed.schedule.decay_step == decay
    assert resumed.schedule.peak_lr == 1e-2  # run A's peak, restored from the checkpoint
    assert [s for s, _ in resumed.schedule.replan.history] == [0, 3, 6]
    assert probe.formats[6] == probe.formats[8] == dict.fromkeys(LINEARS, "plain")
    assert logged_shares(tmp_path / "b")[8] == 0.0
    assert len(resumed_model.losses) == 4 and all(math.isfinite(float(x)) for x in resumed_model.losses)


def test_with_mixprecs_precision_plugin_the_low_bit_layers_run_under_its_region(tmp_path: Path) -> None:
    callback = MixprecReplan(Planner(), every=2)
    model = tiny.make_model()
    tiny.trainer(max_steps=3, callbacks=[callback], plugins=[MixprecPrecision("bf16-mixed")]).fit(
        model, tiny.loader()
    )
    assert [s for s, _ in callback.schedule.replan.history] == [0, 2]
    assert formats_of(model) == expected(callback.schedule.plan.formats)
    assert len(model.losses) == 3 and all(math.isfinite(float(x)) for x in model.losses)


@pytest.mark.parametrize("bad", ["raises", "wrong layers"])
def test_a_failing_plan_stops_fit_with_the_module_unchanged(bad: str) -> None:
    def make_plan(model: nn.Module) -> Any:
        if bad == "raises":
            raise RuntimeError("planning batches exhausted")
        plan = Planner()(model)
        return PrecisionPlan.from_json(plan.to_json().replace('"body.3"', '"body.7"'))

    model = tiny.make_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    callback = MixprecReplan(make_plan)
    error = RuntimeError if bad == "raises" else ValueError
    with pytest.raises(error, match="planning batches exhausted|not nn.Linear modules of the model"):
        tiny.trainer(max_steps=2, callbacks=[callback]).fit(model, tiny.loader())
    assert set(formats_of(model).values()) == {"plain"} and model.losses == []
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), name
    assert callback.schedule.plan is None and callback.schedule.replan.history == []


def test_bad_arguments_are_refused_before_any_trainer_exists() -> None:
    with pytest.raises(ValueError, match="lr_fraction must be in"):
        MixprecReplan(Planner(), lr_fraction=2.0)
    with pytest.raises(ValueError, match="unknown low-bit recipe 'fp5'"):
        MixprecReplan(Planner(), phases={4: "fp5"})
    with pytest.raises(TypeError, match="unexpected keyword argument 'evry'"):
        MixprecReplan(Planner(), evry=3)


def test_fabric_loop_calls_the_schedule_itself() -> None:
    from mixprec.integrations.fabric import MixprecPrecision as FabricPrecision
    from mixprec.plan import ReplanSchedule
    from tests.integrations import _tiny_fabric

    fabric = _tiny_fabric.fabric(plugins=[FabricPrecision("bf16-mixed")])
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(tiny.FEATURES, 32), nn.GELU(), nn.Linear(32, tiny.CLASSES))
    planner = Planner()
    schedule = ReplanSchedule(planner, every=2, phases={3: "bf16"})
    model, optimizer = fabric.setup(module, torch.optim.AdamW(module.parameters(), lr=1e-2))
    params, seen, losses = list(module.parameters()), [], []
    for step, batch in zip(range(4), tiny.loader(), strict=False):
        schedule.begin_step(module, step, optimizer.param_groups[0]["lr"])  # the module Fabric wraps
        seen.append(formats_of(model.module))
        loss = _loss(model, batch)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    assert [s for s, _ in schedule.replan.history] == [0, 2, 3] and len(planner.plans) == 2
    assert seen[0] == seen[1] == expected(planner.plans[0].formats)
    assert seen[2] == expected(planner.plans[1].formats) and set(seen[3].values()) == {"plain"}
    assert all(a is b for a, b in zip(module.parameters(), params, strict=True))
    assert all(math.isfinite(x) for x in losses)
