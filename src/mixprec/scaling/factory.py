"""Build the rule a GradScaler runs from torch's constructor arguments (or take a ready one)."""

from __future__ import annotations

import difflib
from typing import Any

from mixprec.scaling.dynamic import DynamicScale
from mixprec.scaling.headroom import HeadroomScale
from mixprec.scaling.rules import ScaleRule

__all__ = ["RULE_DEFAULTS", "build_rule"]

_GROWTH_RULES: dict[str, type[DynamicScale]] = {"interval": DynamicScale, "headroom": HeadroomScale}
RULE_DEFAULTS: dict[str, Any] = {
    "init_scale": 2.0**16,
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "growth_interval": 2000,
    "growth": "interval",
    "hysteresis": 1,
    "min_scale": None,
    "max_scale": None,
}


def build_rule(rule: ScaleRule | None, **arguments: Any) -> ScaleRule:
    """The rule a GradScaler runs: ``rule`` itself, or a Dynamic/HeadroomScale made from the arguments.

    Raises:
        ValueError: for an unknown ``growth``, or for rule arguments given alongside ``rule``.
        TypeError: for a ``rule`` that is not a ScaleRule instance.
    """
    if rule is not None:
        changed = sorted(name for name, value in arguments.items() if value != RULE_DEFAULTS[name])
        if changed:
            raise ValueError(f"pass {changed} to the rule object, not to GradScaler, when rule= is given")
        if not isinstance(rule, ScaleRule):
            raise TypeError(
                "rule must be a ScaleRule instance (DynamicScale(), HeadroomScale(), StaticScale(s), "
                "NoScale()), "
                f"got {type(rule).__name__}: {rule!r:.80}"
            )
        return rule
    growth = arguments.pop("growth")
    if growth not in _GROWTH_RULES:
        close = difflib.get_close_matches(str(growth), _GROWTH_RULES, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"growth must be one of {sorted(_GROWTH_RULES)}, got {growth!r}{hint}")
    init_scale = arguments.pop("init_scale")
    return _GROWTH_RULES[growth](init_scale, **arguments)
