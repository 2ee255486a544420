"""`ResolvedPolicy`: a policy made concrete for one device family and compute dtype."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import torch

from mixprec.policy import ops as _ops
from mixprec.policy.conditions import CONDITIONS, Condition
from mixprec.policy.names import (
    _FAMILY_OPS,
    BANNED,
    DEFAULT_DTYPES,
    PASSTHROUGH,
    OpKey,
    _check_supported,
)

if TYPE_CHECKING:
    from mixprec.policy.policy import Policy


@dataclass(frozen=True, eq=False)
class ResolvedPolicy:
    """A policy made concrete for one device family and compute dtype: what the engine reads."""

    policy: Policy
    device_type: str
    compute_dtype: torch.dtype
    by_name: Mapping[str, str]
    by_callable: Mapping[Callable, str]
    conditions: Mapping[str, Condition]

    def category(self, op: OpKey) -> str:
        if isinstance(op, str):
            return self.by_name.get(op, PASSTHROUGH)
        return self.by_callable.get(op, PASSTHROUGH)

    @cached_property
    def lists(self) -> dict[str, frozenset[OpKey]]:
        out: dict[str, set[OpKey]] = {c: set() for c in _ops.CATEGORIES}
        for table in (self.by_name, self.by_callable):
            for op, category in table.items():
                if category in out:
                    out[category].add(op)
        return {c: frozenset(v) for c, v in out.items()}


_RESOLVED: dict[tuple[Policy, str, torch.dtype | None], ResolvedPolicy] = {}


def _resolve(policy: Policy, family: str, dtype: torch.dtype | None) -> ResolvedPolicy:
    key = (policy, family, dtype)
    hit = _RESOLVED.get(key)
    if hit is not None:
        return hit
    compute = dtype or policy.compute_dtype or DEFAULT_DTYPES[family]
    _check_supported(family, compute)
    base = policy.device_type or family
    by_name: dict[str, str] = {}
    for category, names in _FAMILY_OPS[base].items():
        for name in names:
            by_name[name] = category
    by_name.update(_ops.COMPOSITES.get(base, {}))
    by_name.update(dict.fromkeys(_ops.BANNED.get(base, ()), BANNED))
    by_callable: dict[Callable, str] = {}
    for op, category in policy.op_overrides:
        (by_name if isinstance(op, str) else by_callable)[op] = category
    edited = {op for op, _ in policy.op_overrides}
    conditions = {name: rule for name, rule in CONDITIONS.get(base, {}).items() if name not in edited}
    resolved = ResolvedPolicy(policy, family, compute, by_name, by_callable, conditions)
    if len(_RESOLVED) < 256:  # a memo of immutable values; bounded so odd callers cannot grow it forever
        _RESOLVED[key] = resolved
    return resolved
