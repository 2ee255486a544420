"""benchmarks/replan_decay.py runs: its arms train in the formats they name, the switch lands where the LR
falls below the fraction of its peak, and the plain-bf16 evaluation leaves the trained layers in place."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

from torch import nn

from mixprec.lowbit import LowbitLinear

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "replan_decay.py"


def _script():
    spec = importlib.util.spec_from_file_location("replan_decay", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _lowbit(model: nn.Module) -> list[bool]:
    return [isinstance(m, LowbitLinear) for m in model.modules() if isinstance(m, nn.Linear)]


def test_the_arms_train_switch_at_the_lr_fraction_and_evaluate() -> None:
    script = _script()
    steps, fraction = 12, 0.2
    arms = {name: script.Arm(name, 0, steps, fraction) for name in script.ARMS}
    lrs = []
    for step in range(steps):
        lrs.append(arms["nvfp4>bf16"].work.optimizer.param_groups[0]["lr"])
        for arm in arms.values():
            arm.step(step)
        if step == 0:
            assert not any(_lowbit(arms["bf16"].work.model))
            assert all(_lowbit(arms["nvfp4"].work.model)) and all(_lowbit(arms["nvfp4>bf16"].work.model))
    expected = next(s for s in range(1, steps) if lrs[s] < fraction * max(lrs[:s]))
    assert arms["nvfp4>bf16"].switch == expected and arms["nvfp4"].switch is None
    assert not any(_lowbit(arms["nvfp4>bf16"].work.model))
    losses = arms["nvfp4"].evaluate()
    assert all(_lowbit(arms["nvfp4"].work.model))  # swapped back after the plain evaluation
    assert losses["as_trained"] != losses["plain_bf16"] and all(v > 0 for v in losses.values())
    result = script.run(0, argparse.Namespace(steps=4, lr_fraction=fraction))
    assert set(result) == {*script.ARMS, "recovered_as_trained", "recovered_plain_bf16"}
