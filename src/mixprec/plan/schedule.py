"""`Replan` and `ReplanSchedule`: a precision plan that changes over training.

NVIDIA's NVFP4 pretraining report ("Pretraining Large Language Models with NVFP4", 2025) recovers most
of its remaining loss gap by switching to bf16 for the last phase (the learning-rate decay); layers whose
numbers change during training may also need another format later. :class:`Replan` does both, from one
call per step::

    replan = Replan(lambda model: plan_precision(model, batches, loss_fn), every=500, phases={900: "bf16"})
    for step in range(1000):
        replan.step(model, step)          # before the step's forward
        loss = loss_fn(model, next(data)); loss.backward(); optimizer.step(); optimizer.zero_grad()

Layers are swapped in place and share their parameters, so the optimizer (and its state) carries on.

:class:`ReplanSchedule` is ``Replan`` as a trainer hook drives it, with no framework: the Lightning callback
(:class:`mixprec.integrations.lightning.MixprecReplan`) and the HF one
(:class:`mixprec.integrations.transformers.MixprecReplanCallback`) each call :meth:`ReplanSchedule.begin_step`
before an optimizer step's first forward; Fabric and plain loops call it themselves::

    schedule = ReplanSchedule(lambda m: plan_precision(m, batches, loss_fn), every=500, lr_decay="bf16")
    for step in range(steps):
        schedule.begin_step(model, step, lr=optimizer.param_groups[0]["lr"])
        ...  # forward, backward, optimizer.step(), scheduler.step()

What it adds to ``Replan``: one call per optimizer step (a second call for the same step, e.g. the next
micro-batch of an accumulation, does nothing); a phase at the start of the learning rate's decay; the plan's
share of low-precision GEMM FLOPs as a metric; and a checkpoint state in plain types.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from mixprec.lowbit import get_recipe
from mixprec.plan.measure import HIGH_PRECISION
from mixprec.plan.result import PrecisionPlan

__all__ = ["METRIC", "Replan", "ReplanSchedule"]

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
            check_phase(fmt, f"phases[{at}]")
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


def check_phase(fmt: Any, name: str) -> None:
    """Refuse a phase value that is not ``"replan"``, ``"bf16"``, ``"fp32"`` or a recipe name, saying all
    four kinds are accepted (``get_recipe``'s message lists the recipes only)."""
    if isinstance(fmt, str) and (fmt == REPLAN or fmt in HIGH_PRECISION):
        return
    try:
        get_recipe(fmt)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{name}: {exc}; a phase also takes 'replan', 'bf16' or 'fp32'") from None


def _linears(model: nn.Module) -> list[str]:
    return [fqn for fqn, m in model.named_modules() if isinstance(m, nn.Linear)]


#: The metric logged each step: the applied plan's share of GEMM FLOPs below bf16, in [0, 1].
METRIC = "low_precision_flop_share"


class ReplanSchedule:
    """Re-plan every ``every`` steps, at the ``phases`` steps and when the learning rate starts to decay.

    Args:
        make_plan: ``make_plan(model) -> PrecisionPlan`` (e.g. a :func:`~mixprec.plan.plan_precision`
            call on fresh batches); ``model`` is the module given to :meth:`begin_step`.
        every: re-plan every this many optimizer steps (int >= 1), or None.
        phases: optimizer step (0-based: the number of steps already taken) -> ``"replan"`` or one format
            for every planned layer (``"bf16"``, ``"fp32"``, a :mod:`mixprec.lowbit` recipe name).
        lr_decay: ``"replan"`` or a format to switch to at the first step whose learning rate is below
            ``lr_fraction`` times the highest one seen so far (a warm-up never triggers it); None: off.
        lr_fraction: in (0, 1]; 1.0 switches as soon as the learning rate falls from its peak.
        generator: the ``torch.Generator`` the converted layers' stochastic rounding draws from.

    Attributes:
        replan: the :class:`Replan` (``plan``, ``history``).
        peak_lr: the highest learning rate seen (None before one was given).
        decay_step: the step the learning-rate decay phase began at (None before).

    Raises:
        TypeError, ValueError: for a non-callable ``make_plan``, a bad ``every``, phase step or format
            (as ``Replan``), an unknown ``lr_decay`` format, or ``lr_fraction`` outside (0, 1].
    """

    def __init__(
        self,
        make_plan: Callable[[nn.Module], PrecisionPlan],
        *,
        every: int | None = None,
        phases: Mapping[int, str] | None = None,
        lr_decay: str | None = None,
        lr_fraction: float = 1.0,
        generator: torch.Generator | None = None,
    ) -> None:
        from mixprec.plan import Replan

        if isinstance(lr_fraction, bool) or not isinstance(lr_fraction, (int, float)):
            raise ValueError(f"lr_fraction must be a number in (0, 1], got {lr_fraction!r}")
        if not 0.0 < lr_fraction <= 1.0:
            raise ValueError(f"lr_fraction must be in (0, 1], got {lr_fraction!r}")
        replan = Replan(_fitting(make_plan), every=every, phases=phases, generator=generator)
        if lr_decay is not None:
            check_phase(lr_decay, "lr_decay")  # the same format check as the phases'
        self.replan, self.lr_decay, self.lr_fraction = replan, lr_decay, float(lr_fraction)
        self.peak_lr: float | None = None
        self.decay_step: int | None = None
        self._last_step: int | None = None
        self._restored = False  # a loaded plan not yet applied to the model
        self._saved: tuple[PrecisionPlan | None, int, dict[str, Any]] | None = (
            None  # (plan, history length, its state)
        )

    @property
    def plan(self) -> PrecisionPlan | None:
        """The plan applied last (None before the first step)."""
        return self.replan.plan

    def begin_step(self, model: nn.Module, step: int, lr: float | None = None) -> PrecisionPlan | None:
        """Apply what optimizer step ``step`` calls for, before its forward; ``lr`` is the learning rate
        that step uses (None: no decay detection). Returns the plan applied now, or None.

        A call that raises (``make_plan`` failing or returning a plan that does not fit ``model``) leaves
        ``model`` and this schedule as they were, except that a plan restored by :meth:`load_state_dict`
        is applied first, whatever follows.

        Raises:
            ValueError: for a step that is not an int >= 0, or a plan naming layers ``model`` lacks;
            TypeError: for a ``make_plan`` result that is not a ``PrecisionPlan``.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        if lr is not None:
            try:
                lr = float(lr)  # a one-element tensor too
            except (TypeError, ValueError):
                raise ValueError(
                    f"lr must be a number (the step's learning rate) or None, got {lr!r}"
                ) from None
        if self._restored and self.replan.plan is not None:
            self.replan.plan.apply(model, self.replan.generator)  # the checkpoint's formats
        self._restored = False
        if step == self._last_step:
            return None
        peak, starts = self.peak_lr, False
        if lr is not None and math.isfinite(lr):
            starts = self.decay_step is None and peak is not None and lr < self.lr_fraction * peak
            peak = lr if peak is None else max(peak, lr)
        starts = starts and self.lr_decay is not None
        insert = starts and step not in self.replan.phases  # a phase given for this step wins
        if insert:
            assert self.lr_decay is not None  # implied by starts
            self.replan.phases[step] = self.lr_decay
        try:  # make_plan's result is checked against the model before Replan changes anything
            plan = self.replan.step(model, step)
        except BaseException:
            if insert:
                del self.replan.phases[step]
            raise
        self.peak_lr, self._last_step = peak, step
        if starts:
            self.decay_step = step
        return plan

    def metrics(self) -> dict[str, float]:
        """``{"low_precision_flop_share": share}`` for the applied plan; empty before the first plan, and
        for a low-bit phase set before any plan measured the layers' FLOPs."""
        plan = self.replan.plan
        if plan is None:
            return {}
        if all(fmt in ("bf16", "fp32") for fmt in plan.formats.values()):
            return {METRIC: 0.0}
        if not all(fqn in plan.layers for fqn in plan.formats):
            return {}
        return {METRIC: plan.low_precision_share()}

    def state_dict(self) -> dict[str, Any]:
        """The schedule's state for a checkpoint, in plain types (``torch.load(weights_only=True)`` reads
        it): the Replan's (:meth:`Replan.state_dict`), the peak learning rate, the decay
        step and the last step handled."""
        plan, changes = self.replan.plan, len(self.replan.history)
        if self._saved is None or self._saved[0] is not plan or self._saved[1] != changes:
            self._saved = (plan, changes, self.replan.state_dict())  # the plan's JSON once per change
        return {
            "replan": copy.deepcopy(self._saved[2]),
            "peak_lr": self.peak_lr,
            "decay_step": self.decay_step,
            "last_step": self._last_step,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; the restored plan is applied to the model at the next
        :meth:`begin_step`, before anything else.

        Raises:
            ValueError: for a state that is not one of :meth:`state_dict` (nothing is changed then).
        """
        keys = {"replan", "peak_lr", "decay_step", "last_step"}
        if not isinstance(state, Mapping) or set(state) != keys:
            got = sorted(state) if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(f"not a ReplanSchedule state_dict (keys {sorted(keys)}), got {got}")
        decay = _optional(state["decay_step"], int, "decay_step")
        peak = _optional(state["peak_lr"], float, "peak_lr")
        last = _optional(state["last_step"], int, "last_step")
        self.replan.load_state_dict(state["replan"])  # validates, then sets
        if self.decay_step is not None and self.replan.phases.get(self.decay_step) == self.lr_decay:
            self.replan.phases.pop(self.decay_step)  # this run's own decay phase, replaced by the saved one
        if decay is not None and self.lr_decay is not None:
            self.replan.phases.setdefault(decay, self.lr_decay)
        self.peak_lr, self.decay_step, self._last_step = peak, decay, last
        self._restored = True


def _fitting(make_plan: Callable[[nn.Module], PrecisionPlan]) -> Callable[[nn.Module], PrecisionPlan]:
    """``make_plan``, with its result checked to be a plan of ``model``'s linear layers (TypeError /
    ValueError otherwise), so that ``Replan.step`` fails before it changes its state or the model."""
    if not callable(make_plan):
        return make_plan  # Replan refuses it, naming it

    def checked(model: nn.Module) -> PrecisionPlan:
        from mixprec.plan import PrecisionPlan

        plan = make_plan(model)
        if not isinstance(plan, PrecisionPlan):
            raise TypeError(f"make_plan must return a PrecisionPlan, got {type(plan).__name__}")
        modules = dict(model.named_modules())
        missing = [fqn for fqn in plan.formats if not isinstance(modules.get(fqn), nn.Linear)]
        if missing:
            raise ValueError(
                f"make_plan's plan names layers that are not nn.Linear modules of the model: {missing}"
            )
        return plan

    return checked


def _optional(value: Any, kind: type, name: str) -> Any:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"ReplanSchedule state_dict {name!r} must be a number or None, got {value!r}")
    return kind(value)
