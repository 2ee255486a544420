"""MixprecReplanCallback in HF's real Trainer: a tiny Llama (random init, nothing downloaded) re-planned
during training, checkpointed after the change, and resumed to the same weights as the straight run."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from mixprec.integrations.transformers import MixprecReplanCallback, MixprecTrainer  # noqa: E402
from mixprec.lowbit import LowbitLinear, get_recipe  # noqa: E402
from mixprec.plan import PrecisionPlan, plan_precision  # noqa: E402
from tests.integrations import _tiny_hf as tiny  # noqa: E402

STEPS = 6


def make_model() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=tiny.VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    return transformers.LlamaForCausalLM(config)


def _loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss


class Planner:
    """plan_precision on one fixed batch; formats alternate between calls so that a re-plan changes them."""

    CHOICES = (("mxfp8", "bf16"), ("nvfp4", "bf16"))

    def __init__(self) -> None:
        ids = tiny.TokenData().ids[: tiny.BATCH]
        self.batch = {"input_ids": ids, "labels": ids}
        self.plans: list[PrecisionPlan] = []

    def __call__(self, model: nn.Module) -> PrecisionPlan:
        formats = self.CHOICES[len(self.plans) % 2]
        plan = plan_precision(model, [self.batch], _loss, formats=formats, budget=0.5, cost="b200-peak")
        self.plans.append(plan)
        return plan


def formats_of(model: nn.Module) -> dict[str, str]:
    return {
        n: str(m.recipe) if isinstance(m, LowbitLinear) else "plain"
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear)
    }


def expected(formats: dict[str, str]) -> dict[str, str]:
    return {f: "plain" if fmt in ("bf16", "fp32") else str(get_recipe(fmt)) for f, fmt in formats.items()}


class Probe(transformers.TrainerCallback):
    """After the replan callback (listed later): each step's formats and LR, the parameters at the start."""

    def __init__(self) -> None:
        self.formats: dict[int, dict[str, str]] = {}
        self.lrs: dict[int, float] = {}
        self.first: dict[str, torch.Tensor] | None = None
        self.params: list[nn.Parameter] = []

    def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):  # type: ignore[no-untyped-def]
        if self.first is None:
            self.first = {k: v.detach().clone() for k, v in model.state_dict().items()}
            self.params = list(model.parameters())
        self.formats[state.global_step] = formats_of(model)
        self.lrs[state.global_step] = optimizer.param_groups[0]["lr"]


def run(out: Path, trainer_cls: type, planner: Planner, resume: str | None = None, **args: Any) -> tuple:
    model = make_model()
    callback = MixprecReplanCallback(planner, phases={3: "replan"}, lr_decay="bf16", lr_fraction=0.5)
    probe = Probe()
    settings = dict(max_steps=STEPS, warmup_steps=2, lr_scheduler_type="linear", save_strategy="no")
    trainer = trainer_cls(
        model=model,
        args=tiny.training_args(str(out), **{**settings, **args}),
        train_dataset=tiny.TokenData(),
        callbacks=[callback, probe],
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer, model, callback, probe


def decay_step(lrs: dict[int, float], fraction: float) -> int:
    steps = sorted(lrs)
    return next(s for i, s in enumerate(steps) if i and lrs[s] < fraction * max(lrs[t] for t in steps[:i]))


@pytest.mark.parametrize(
    "trainer_cls", [transformers.Trainer, MixprecTrainer], ids=["Trainer", "MixprecTrainer"]
)
def test_replans_formats_follow_the_plan_and_a_checkpoint_after_the_change_resumes_bitwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, trainer_cls: type
) -> None:
    if not hasattr(transformers.Trainer, "_save_scaler"):  # 4.x: see test_transformers.py
        monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    planner = Planner()
    trainer, model, callback, probe = run(tmp_path, trainer_cls, planner, save_strategy="steps", save_steps=4)
    decay = decay_step(probe.lrs, 0.5)
    history = callback.schedule.replan.history
    assert [s for s, _ in history] == [0, 3, decay] and decay == 5 and len(planner.plans) == 2
    assert [f for _, f in history[:2]] == [p.formats for p in planner.plans]
    assert planner.plans[0].formats != planner.plans[1].formats  # the re-plan at step 3 changed formats
    assert set(history[2][1].values()) == {"bf16"}
    for step in range(STEPS):
        in_force = [f for at, f in history if at <= step][-1]
        assert probe.formats[step] == expected(in_force), step
    assert all(a is b for a, b in zip(model.parameters(), probe.params, strict=True))
    inner = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    assert all(inner.state[p]["step"] == STEPS for p in probe.params)
    logged = [e for e in trainer.state.log_history if "loss" in e]
    assert len(logged) == STEPS and all(math.isfinite(e["loss"]) for e in logged)
    shares = [e["low_precision_flop_share"] for e in logged]
    first, second = (p.low_precision_share() for p in planner.plans)
    assert shares == pytest.approx([first, first, first, second, second, 0.0])

    folder = tmp_path / "checkpoint-4"
    saved = json.loads((folder / "trainer_state.json").read_text())["stateful_callbacks"]["mixprec_replan"]
    assert PrecisionPlan.from_json(saved["replan"]["plan"]) == planner.plans[1]
    _, resumed, resumed_callback, resumed_probe = run(
        tmp_path / "resumed", trainer_cls, planner, resume=str(folder)
    )
    assert len(planner.plans) == 2  # the saved plan is re-applied, not re-made
    assert sorted(resumed_probe.formats) == [4, 5]
    assert resumed_probe.formats[4] == expected(planner.plans[1].formats)
    assert resumed_probe.formats[5] == probe.formats[5]
    assert resumed_callback.schedule.replan.history == history
    for (name, a), b in zip(model.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), name  # the resumed run ends where the straight one did


def test_a_failing_plan_stops_training_with_the_model_unchanged(tmp_path: Path) -> None:
    def make_plan(model: nn.Module) -> Any:
        return "plan"

    model = make_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    callback = MixprecReplanCallback(make_plan)
    trainer = transformers.Trainer(
        model=model,
        args=tiny.training_args(str(tmp_path), max_steps=2),
        train_dataset=tiny.TokenData(),
        callbacks=[callback],
    )
    with pytest.raises(TypeError, match="make_plan must return a PrecisionPlan, got str"):
        trainer.train()
    assert set(formats_of(model).values()) == {"plain"}
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), name
    assert trainer.state.global_step == 0 and callback.schedule.plan is None


def test_bad_arguments_are_refused_before_a_trainer_sees_them() -> None:
    with pytest.raises(ValueError, match="lr_fraction must be in"):
        MixprecReplanCallback(Planner(), lr_fraction=0)
    with pytest.raises(ValueError, match="unknown low-bit recipe 'int3'"):
        MixprecReplanCallback(Planner(), lr_decay="int3")
    with pytest.raises(ValueError, match="phase steps must be ints >= 0"):
        MixprecReplanCallback(Planner(), phases={-1: "bf16"})


def test_the_readme_snippet_runs_as_written(tmp_path: Path) -> None:
    import re

    lightning = pytest.importorskip("lightning")
    text = (Path(__file__).resolve().parents[2] / "docs" / "guide" / "planner.md").read_text()
    section = text.split("## Re-planning during training", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```python\n(.*?)```", section, re.S)
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(3)]
    namespace = {
        "L": lightning,
        "Trainer": transformers.Trainer,
        "model": module,
        "args": tiny.training_args(str(tmp_path), max_steps=1),
        "data": tiny.TokenData(),
        "planning_batches": batches[:1],
        "loss_fn": lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]),
        "loader": batches,
        "module": module,
        "optimizer": torch.optim.AdamW(module.parameters(), lr=1e-3),
    }
    exec(compile(block, "docs/guide/planner.md#re-planning-during-training", "exec"), namespace)
    schedule = namespace["schedule"]
    assert [s for s, _ in schedule.replan.history] == [0]  # the loop ran; its first step planned
    assert formats_of(module) == expected(schedule.plan.formats)
