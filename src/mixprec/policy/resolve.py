"""`ResolvedPolicy`: a policy made concrete for one device family and compute dtype."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import torch

from mixprec.policy import ops as _ops
from mixprec.policy.names import (
    _FAMILY_OPS,
    BANNED,
    DEFAULT_DTYPES,
    PASSTHROUGH,
    OpKey,
    _check_supported,
    has_catalogue,
)

if TYPE_CHECKING:
    from mixprec.policy.policy import Policy


@dataclass(frozen=True)
class Deviations:
    """What a resolved policy does differently from torch.autocast's own lists on its device.

    ``by_name`` maps op names to the category the policy gives them where that differs from torch's
    (``"none"`` where the policy takes an op torch casts off every list); ``by_callable`` holds the
    ops given as Python callables. Empty for the default policy: torch's kernels then do everything.
    """

    by_name: Mapping[str, str]
    by_callable: Mapping[Callable, str]

    def __bool__(self) -> bool:
        return bool(self.by_name) or bool(self.by_callable)


@dataclass(frozen=True, eq=False)
class ResolvedPolicy:
    """A policy made concrete for one device family and compute dtype: what the engine reads."""

    policy: Policy
    device_type: str
    compute_dtype: torch.dtype
    by_name: Mapping[str, str]
    by_callable: Mapping[Callable, str]

    def category(self, op: OpKey) -> str:
        if isinstance(op, str):
            return self.by_name.get(op, PASSTHROUGH)
        return self.by_callable.get(op, PASSTHROUGH)

    @cached_property
    def deviations(self) -> Deviations:
        """The ops whose category differs from torch.autocast's on ``device_type``.

        See :class:`~mixprec.policy.resolve.Deviations`."""
        native = _base_table(self.device_type)
        by_name = {op: cat for op, cat in self.by_name.items() if native.get(op, PASSTHROUGH) != cat}
        by_name.update({op: PASSTHROUGH for op in native if op not in self.by_name})
        # An op the policy names is run by mixprec even where torch's list agrees: mixprec's promote
        # takes any mix of floating dtypes (torch's raises on bf16 + fp32 in an fp16 region).
        by_name.update({op: cat for op, cat in self.policy.op_overrides if isinstance(op, str)})
        return Deviations(by_name, dict(self.by_callable))

    @cached_property
    def lists(self) -> dict[str, frozenset[OpKey]]:
        out: dict[str, set[OpKey]] = {c: set() for c in _ops.CATEGORIES}
        for table in (self.by_name, self.by_callable):
            for op, category in table.items():
                if category in out:
                    out[category].add(op)
        return {c: frozenset(v) for c, v in out.items()}


_BASE: dict[str, dict[str, str]] = {}


def _base_table(family: str) -> dict[str, str]:
    """torch.autocast's own categories on ``family``, by op name (lists, composites, banned ops)."""
    hit = _BASE.get(family)
    if hit is None:
        by_name: dict[str, str] = {}
        for category, names in _FAMILY_OPS.get(family, {}).items():  # none without a catalogue
            for name in names:
                by_name[name] = category
        by_name.update(_ops.COMPOSITES.get(family, {}))
        by_name.update(dict.fromkeys(_ops.BANNED_OPS.get(family, ()), BANNED))
        hit = _BASE[family] = by_name
    return hit


_RESOLVED: dict[tuple[Policy, str, torch.dtype | None], ResolvedPolicy] = {}


def _resolve(policy: Policy, family: str, dtype: torch.dtype | None) -> ResolvedPolicy:
    key = (policy, family, dtype)
    hit = _RESOLVED.get(key)
    if hit is not None:
        return hit
    if not has_catalogue(family):
        return _torch_lists_only(policy, family, dtype)
    compute = dtype or policy.compute_dtype or DEFAULT_DTYPES[family]
    _check_supported(family, compute)
    base = policy.device_type or family
    by_name = dict(_base_table(base))
    by_callable: dict[Callable, str] = {}
    for op, category in policy.op_overrides:
        if isinstance(op, str):
            by_name[op] = category
        else:
            by_callable[op] = category
    resolved = ResolvedPolicy(policy, family, compute, by_name, by_callable)
    if len(_RESOLVED) < 256:  # a memo of immutable values; bounded so odd callers cannot grow it forever
        _RESOLVED[key] = resolved
    return resolved


def _torch_lists_only(policy: Policy, family: str, dtype: torch.dtype | None) -> ResolvedPolicy:
    """Rules on a device type torch.autocast takes but mixprec has no op catalogue for ("mps", "xpu",
    "hpu", "xla", ...): torch's own kernels and dtype rules do everything, so only an unedited policy runs.

    The default dtype is torch's (``torch.get_autocast_dtype``, as ``torch.autocast`` reads it), so the
    result is not memoised. Raises ValueError for op edits, module pins or another family's op lists.
    """
    edits = [
        name
        for name, present in (
            ("op edits (with_ops)", policy.op_overrides),
            ("module pins (with_modules)", policy.module_overrides),
            (f"the {policy.device_type!r} op lists (device_type={policy.device_type!r})", policy.device_type),
        )
        if present
    ]
    if edits:
        raise ValueError(
            f"a policy with {' and '.join(edits)} cannot run on {family!r}: mixprec has op catalogues for "
            f"{sorted(_FAMILY_OPS)} only, and a region on {family!r} is torch.autocast's own state; "
            f"use the default policy there (policy=None, a dtype, or the 'bf16-mixed'/'16-mixed' presets)"
        )
    compute = dtype or policy.compute_dtype or torch.get_autocast_dtype(family)
    return ResolvedPolicy(policy, family, compute, {}, {})
