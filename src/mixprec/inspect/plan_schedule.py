"""`Replan`: a precision plan that changes over training, driven from a plain training loop.

NVIDIA's NVFP4 pretraining report ("Pretraining Large Language Models with NVFP4", 2025) recovers most
of its remaining loss gap by switching to bf16 for the last phase (the learning-rate decay); layers whose
numbers change during training may also need another format later. :class:`Replan` does both, from one
call per step::

    replan = Replan(lambda model: plan_precision(model, batches, loss_fn), every=500, phases={900: "bf16"})
    for step in range(1000):
        replan.step(model, step)          # before the step's forward
        loss = loss_fn(model, next(data)); loss.backward(); optimizer.step(); optimizer.zero_grad()

Layers are swapped in place and share their parameters, so the optimizer (and its state) carries on.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from mixprec.inspect._plan_measure import HIGH_PRECISION
from mixprec.inspect.plan_value import PrecisionPlan
from mixprec.lowbit import get_recipe

__all__ = ["Replan"]

#: The phase value that re-runs the planner instead of setting one format everywhere.
REPLAN = "replan"


class Replan:
    """Plan at step 0, re-plan every ``every`` steps, and switch at the ``phases`` steps.

    Args:
        make_plan: ``make_plan(model) -> PrecisionPlan`` (e.g. a ``plan_precision`` call on fresh batches).
        every: re-plan every this many steps (an int >= 1), or None for only at step 0 and the phases.
        phases: step -> ``"replan"`` or one format for every planned layer (``"bf16"``, a recipe name);
            from a phase on, ``every`` re-plans no more if the phase set a fixed format.
        generator: the ``torch.Generator`` the converted layers' stochastic rounding draws from.

    Attributes:
        plan: the plan applied last (None before the first step).
        history: ``(step, formats)`` for each change applied.

    Raises:
        TypeError: for a non-callable ``make_plan``.
        ValueError: for a bad ``every``, a negative phase step or an unknown phase format.
    """

    def __init__(
        self,
        make_plan: Callable[[nn.Module], PrecisionPlan],
        *,
        every: int | None = None,
        phases: Mapping[int, str] | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        if not callable(make_plan):
            raise TypeError(
                f"make_plan must be callable make_plan(model) -> PrecisionPlan, got {make_plan!r}"
            )
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ValueError(f"every must be an int >= 1 or None, got {every!r}")
        phases = dict(phases or {})
        for at, fmt in phases.items():
            if isinstance(at, bool) or not isinstance(at, int) or at < 0:
                raise ValueError(f"phase steps must be ints >= 0, got {at!r}")
            if fmt != REPLAN and fmt not in HIGH_PRECISION:
                get_recipe(fmt)  # raises for an unknown format
        self.make_plan, self.every, self.phases, self.generator = make_plan, every, phases, generator
        self.plan: PrecisionPlan | None = None
        self.history: list[tuple[int, dict[str, str]]] = []
        self._fixed = False

    def step(self, model: nn.Module, step: int) -> PrecisionPlan | None:
        """Apply what step ``step`` calls for; returns the plan applied now, or None if nothing changed."""
        fmt = self.phases.get(step)
        if fmt is not None and fmt != REPLAN:
            names = list(self.plan.formats) if self.plan else _linears(model)
            plan, fixed = self._uniform(names, fmt, step), True
        elif (
            fmt == REPLAN
            or self.plan is None
            or (not self._fixed and self.every is not None and step % self.every == 0)
        ):
            plan = self.make_plan(model)
            if not isinstance(plan, PrecisionPlan):
                raise TypeError(f"make_plan must return a PrecisionPlan, got {type(plan).__name__}")
            fixed = False
        else:
            return None
        plan.apply(model, self.generator)  # validates before it converts: a refusal changes nothing
        self.plan, self._fixed = plan, fixed
        self.history.append((step, dict(plan.formats)))
        return plan

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs to carry on: the applied plan (its JSON, or None), the history and
        whether a fixed phase has stopped the ``every`` re-plans; plain types only (str, int, bool, dict,
        list), so ``torch.load(weights_only=True)`` reads it. The constructor's arguments are not in it."""
        return {
            "plan": None if self.plan is None else self.plan.to_json(),
            "history": [[step, dict(formats)] for step, formats in self.history],
            "fixed": self._fixed,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; the plan is not applied here (``replan.plan.apply(model)`` does).

        Raises:
            ValueError: for a state that is not one of :meth:`state_dict` (nothing is changed then).
        """
        if not isinstance(state, Mapping) or set(state) != {"plan", "history", "fixed"}:
            keys = sorted(state) if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(f"not a Replan state_dict (keys plan, history, fixed), got {keys}")
        text, history = state["plan"], state["history"]
        plan = None if text is None else PrecisionPlan.from_json(text)
        if not isinstance(history, list) or not all(
            isinstance(entry, (list, tuple))
            and len(entry) == 2
            and isinstance(entry[0], int)
            and not isinstance(entry[0], bool)
            and isinstance(entry[1], dict)
            for entry in history
        ):
            raise ValueError("Replan state_dict 'history' must be a list of [step, {layer: format}] pairs")
        self.plan, self._fixed = plan, bool(state["fixed"])
        self.history = [(step, dict(formats)) for step, formats in history]

    def _uniform(self, names: list[str], fmt: str, step: int) -> PrecisionPlan:
        old = self.plan
        layers = old.layers if old else {}
        reasons = dict.fromkeys(names, f"phase change at step {step}: every layer {fmt}")
        measured = old.measured if old else dict.fromkeys(("loss", "weight_grad"), float("nan"))
        return PrecisionPlan(dict.fromkeys(names, fmt), layers, reasons, old.budget if old else 0.0, measured)


def _linears(model: nn.Module) -> list[str]:
    return [fqn for fqn, m in model.named_modules() if isinstance(m, nn.Linear)]
