"""Loss-scale update rules: small objects that own the scale and decide how it moves; the checks on what
users pass to a scaler, and the error its misuse raises.

A rule keeps the scale (and whatever counters its algorithm needs) as 0-dim tensors, created on the device of
the first tensor scaled, and changes them with tensor ops only, so that :meth:`ScaleRule.update` never waits
for the device. :class:`~mixprec.scaling.GradScaler` drives a rule; the rules know nothing about optimizers.

- :class:`~mixprec.scaling.dynamic.DynamicScale`: torch's rule (back off on overflow, grow after
  ``growth_interval`` good steps), plus hysteresis, a floor and a cap.
- :class:`~mixprec.scaling.headroom.HeadroomScale`: DynamicScale that also grows as soon as the gradients
  show room for it.
- :class:`StaticScale`: a fixed scale (apex ``loss_scale=128``).
- :class:`NoScale`: scale 1; the scaler still checks gradients and skips non-finite steps.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

__all__ = [
    "DEFAULTS",
    "FLOAT32_MAX",
    "FLOAT32_TINY",
    "GradScalerError",
    "NoScale",
    "RuleArguments",
    "ScaleRule",
    "StaticScale",
    "build_rule",
    "check_count",
    "check_flag",
    "check_new_scale",
    "check_positive",
    "check_scale",
    "refuse_closure",
    "required",
]

FLOAT32_TINY = torch.finfo(torch.float32).tiny  # smallest normal float32: 1 / it is still finite
FLOAT32_MAX = torch.finfo(torch.float32).max


@dataclass(frozen=True)
class RuleArguments:
    """The rule arguments of a GradScaler (torch's and mixprec's additions); their defaults, written once.

    ``GradScaler``, ``DynamicScale`` and ``HeadroomScale`` take their signatures' defaults from
    :data:`DEFAULTS`, and ``GradScaler(rule=...)`` refuses any rule argument that differs from them.
    """

    init_scale: float = 2.0**16  # torch's: high enough for most fp16 runs, backed off on the first overflows
    growth_factor: float = 2.0  # powers of two keep the scale's products exact
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    growth: str = "interval"  # torch's rule; "headroom" grows as soon as the gradients allow
    hysteresis: int = 1  # every overflow backs off, as torch
    min_scale: float | None = None  # None: the smallest normal float32
    max_scale: float | None = None  # None: no cap below float32 max


DEFAULTS = RuleArguments()


class GradScalerError(RuntimeError, AssertionError):
    """Misuse of the ``scale`` / ``unscale_`` / ``step`` / ``update`` sequence.

    A RuntimeError, and also an AssertionError because torch raises AssertionError for some of these
    (no scale() before step, no inf checks before update), so code written against torch still catches them.
    """


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_positive(name: str, value: Any) -> float:
    """``float(value)`` if it is a finite number > 0; otherwise a ValueError naming it."""
    if not _is_number(value) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def check_scale(name: str, value: Any) -> float:
    """``float(value)`` if it is a loss scale float32 can hold both ways: in [FLOAT32_TINY, FLOAT32_MAX].

    The scale lives in a float32 tensor and the gradients are multiplied by its reciprocal, so both the
    scale and ``1 / scale`` must be finite float32 numbers.

    Raises:
        ValueError: naming ``name``, for anything else (1e39 would be inf in float32, 1e-50 would be 0).
    """
    number = check_positive(name, value)
    if not FLOAT32_TINY <= number <= FLOAT32_MAX:
        raise ValueError(
            f"{name} must be in [{FLOAT32_TINY:.6g}, {FLOAT32_MAX:.6g}] (a float32 number whose "
            f"reciprocal is also finite), got {value!r}"
        )
    return number


def check_new_scale(new_scale: Any) -> float | torch.Tensor:
    """``new_scale`` if it is a number (checked as :func:`check_scale`) or a 1-element tensor without grad.

    Raises:
        ValueError: for anything else, naming its type or shape.
    """
    if isinstance(new_scale, torch.Tensor):
        if new_scale.numel() != 1 or new_scale.requires_grad:
            raise ValueError(
                "new_scale should be a float or a 1-element tensor with requires_grad=False, got a tensor of "
                f"shape {tuple(new_scale.shape)} with requires_grad={new_scale.requires_grad}"
            )
        return new_scale
    if isinstance(new_scale, bool) or not isinstance(new_scale, (int, float)):
        kind = type(new_scale).__name__
        raise ValueError(f"new_scale should be a float, int or 1-element tensor, got {kind}: {new_scale!r}")
    return check_scale("new_scale", new_scale)


def refuse_closure(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raise GradScalerError for a closure, by keyword (as torch) or positional (torch lets it through)."""
    if "closure" in kwargs:
        raise GradScalerError("Closure use is not currently supported if GradScaler is enabled.")
    if args and callable(args[0]):
        raise GradScalerError(
            f"step() got a callable as its first positional argument ({args[0]!r:.60}), which "
            "optimizer.step() would take as a closure. Closures are not supported while GradScaler is "
            "enabled: the closure's backward() would leave scaled gradients that are never unscaled (torch "
            "passes it through silently). Call scaler.scale(loss).backward() yourself, then "
            "scaler.step(optimizer)."
        )


def check_count(name: str, value: Any, minimum: int = 1) -> int:
    """``value`` if it is an int >= minimum; otherwise a ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def check_flag(name: str, value: Any) -> bool:
    """``bool(value)`` for a bool or the ints 0 and 1; otherwise a TypeError naming it ("no" is truthy)."""
    if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    raise TypeError(f"{name} must be True or False, got {type(value).__name__}: {value!r}")


def required(state_dict: dict[str, Any], key: str, check: Any, *args: Any) -> Any:
    """``check(f"state_dict[{key!r}]", state_dict[key], *args)``, naming ``key`` when it is missing."""
    if key not in state_dict:
        raise ValueError(f"state_dict lacks {key!r}; it has {sorted(map(str, state_dict))}")
    return check(f"state_dict[{key!r}]", state_dict[key], *args)


def optional(state_dict: dict[str, Any], key: str, default: Any, check: Any, *args: Any) -> Any:
    """Like :func:`required`, but ``default`` (unchecked) when ``key`` is missing (torch's dicts lack it)."""
    if key not in state_dict:
        return default
    return check(f"state_dict[{key!r}]", state_dict[key], *args)


_BY_GROWTH: dict[str, type[ScaleRule]] = {}  # filled by the subclasses that name a growth


class ScaleRule:
    """Base rule: a scale that ``update()`` leaves alone.

    Args:
        init_scale: the scale before the first update; a finite number > 0.

    Attributes:
        amax_use: what :meth:`update` does with ``amax``, the largest ``|unscaled gradient|``: ``"none"``
            (never reads it), ``"when_free"`` (reads it where the scaler measures it without an extra sync:
            fused optimizers' check pass, a step whose scale is below 1; None elsewhere) or ``"every_step"``
            (the scaler measures it in every gradient pass, with its own public-op kernel).
        amax_due: for ``"when_free"``, whether a fused optimizer's step measures amax in this iteration
            (its check has no sync to ride on, so measuring is an extra cost a rule may spread out).
        is_identity: whether the scale is always exactly 1, so unscaling can skip the multiply.
    """

    amax_use: str = "none"
    amax_due: bool = True
    is_identity: ClassVar[bool] = False
    growth: ClassVar[str | None] = None  # the name GradScaler(growth=...) builds this rule by, if any

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("growth") is not None:
            _BY_GROWTH[cls.__dict__["growth"]] = cls

    def __init__(self, init_scale: float) -> None:
        self.init_scale = check_scale("init_scale", init_scale)
        self._scale: torch.Tensor | None = None

    @property
    def name(self) -> str:
        """The rule's class name, saved in state_dict() to refuse loading into a different rule."""
        return type(self).__name__

    @property
    def scale(self) -> torch.Tensor | None:
        """The scale as a float32 0-dim tensor, or None before the first :meth:`ensure_state`."""
        return self._scale

    def ensure_state(self, device: torch.device) -> torch.Tensor:
        """Create the state tensors on ``device`` if they do not exist yet; return the scale tensor."""
        if self._scale is None:
            self._create_state(device)
        assert self._scale is not None
        return self._scale

    def _create_state(self, device: torch.device) -> None:
        self._scale = torch.full((), self.init_scale, dtype=torch.float32, device=device)

    def get_scale(self) -> float:
        """The scale as a Python float (a host sync once the tensor exists)."""
        return self.init_scale if self._scale is None else float(self._scale.item())

    def set_scale(self, new_scale: float | torch.Tensor) -> None:
        """Overwrite the scale: a finite float > 0, or a 1-element tensor (copied, not checked: no sync)."""
        if isinstance(new_scale, torch.Tensor):
            self.ensure_state(new_scale.device).copy_(new_scale.reshape(()))
            return
        value = check_scale("new_scale", new_scale)
        if self._scale is None:
            self.init_scale = value
        else:
            self._scale.fill_(value)

    def update(self, found_inf: torch.Tensor, amax: torch.Tensor | None = None) -> None:
        """Move the scale after an iteration.

        Args:
            found_inf: float32 0-dim tensor on the scale's device, > 0 if any gradient was non-finite.
            amax: float32 0-dim tensor, the largest ``|gradient|`` after unscaling (non-finite when
                ``found_inf``), or None where the scaler did not measure it; only rules whose ``amax_use``
                is not ``"none"`` read it.
        """

    def skip_reads(self) -> list[torch.Tensor]:
        """0-dim tensors :meth:`after_skip` reads on the host (none here): the scaler fetches them in its
        step's one sync, with found_inf, so a skipped step costs no sync of its own."""
        return []

    def after_skip(self, values: Sequence[float] | None = None) -> None:
        """Hook the scaler calls when it already knows, on the host, that a step was skipped.

        Args:
            values: the values of :meth:`skip_reads`' tensors, read in the scaler's sync; None reads them
                here (a host sync).
        """

    def state_dict(self) -> dict[str, Any]:
        """The rule's configuration and state as plain Python values."""
        return {"rule": self.name, "scale": self.get_scale()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict` (or from torch's GradScaler keys, for DynamicScale).

        Everything is checked before anything changes: a dict that raises leaves the rule as it was.

        Raises:
            TypeError: when ``state_dict`` is not a dict.
            ValueError: for a missing or bad key (named), or a dict saved from a different kind of rule.
        """
        self._apply_state(self.read_state(state_dict))

    def read_state(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """What :meth:`~mixprec.scaling.ScaleRule.load_state_dict` would restore, checked; changes nothing.

        Raises:
            TypeError, ValueError: as :meth:`~mixprec.scaling.ScaleRule.load_state_dict`.
        """
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}: {state_dict!r:.80}")
        saved = state_dict.get("rule", self.name)  # torch's GradScaler saves no rule name
        if saved not in {cls.__name__ for cls in type(self).__mro__}:
            raise ValueError(
                f"state_dict['rule'] says it was saved from a {saved} rule; this scaler uses {self.name}"
            )
        return {"scale": required(state_dict, "scale", check_scale)}

    def _apply_state(self, values: dict[str, Any]) -> None:
        """Restore values from :meth:`read_state` (already checked: this cannot fail halfway)."""
        self.set_scale(values["scale"])


class StaticScale(ScaleRule):
    """A fixed loss scale, as apex's ``loss_scale=128``. Non-finite steps are still skipped.

    Args:
        scale: the scale; a finite number > 0 (powers of two keep unscaling exact).
    """

    def __init__(self, scale: float) -> None:
        super().__init__(scale)


class NoScale(StaticScale):
    """No loss scaling (a loss scale of 1). The scaler still detects non-finite gradients and skips those
    steps."""

    is_identity: ClassVar[bool] = True

    def __init__(self) -> None:
        super().__init__(1.0)

    def set_scale(self, new_scale: float | torch.Tensor) -> None:
        if isinstance(new_scale, torch.Tensor) or new_scale != 1:
            raise ValueError(f"NoScale keeps the scale at 1, got new_scale={new_scale!r}; use StaticScale")

    def read_state(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        values = super().read_state(state_dict)
        if values["scale"] != 1:
            raise ValueError(f"NoScale keeps the scale at 1, got state_dict['scale']={values['scale']!r}")
        return values


def build_rule(rule: ScaleRule | None, arguments: RuleArguments) -> ScaleRule:
    """The rule a GradScaler runs: ``rule`` itself, or the rule whose ``growth`` the arguments name
    (``"interval"``: DynamicScale, ``"headroom"``: HeadroomScale), built from the others.

    Raises:
        ValueError: for an unknown ``growth``, or for rule arguments that differ from :data:`DEFAULTS`
            alongside ``rule``.
        TypeError: for a ``rule`` that is not a ScaleRule instance.
    """
    values = dataclasses.asdict(arguments)
    if rule is not None:
        changed = sorted(name for name, value in values.items() if value != getattr(DEFAULTS, name))
        if changed:
            raise ValueError(f"pass {changed} to the rule object, not to GradScaler, when rule= is given")
        if not isinstance(rule, ScaleRule):
            raise TypeError(
                "rule must be a ScaleRule instance (DynamicScale(), HeadroomScale(), StaticScale(s), "
                f"NoScale()), got {type(rule).__name__}: {rule!r:.80}"
            )
        return rule
    growth = values.pop("growth")
    if growth not in _BY_GROWTH:
        close = difflib.get_close_matches(str(growth), _BY_GROWTH, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"growth must be one of {sorted(_BY_GROWTH)}, got {growth!r}{hint}")
    return _BY_GROWTH[growth](values.pop("init_scale"), **values)
