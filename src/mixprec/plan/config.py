"""`PlanConfig`: every setting of :func:`mixprec.plan.plan_precision`, checked once, as one value."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from mixprec.lowbit import RECIPES, get_recipe
from mixprec.lowbit.cost import TARGETS, CostFn, check_tokens_per_step, quantize_path
from mixprec.plan.measure import HIGH_PRECISION
from mixprec.plan.memory import OPTIMIZERS, check_formats, parse_bytes

__all__ = ["MEASURES", "PlanConfig"]

#: How single layers are measured: a pass each, or estimated from the reference pass.
MEASURES = ("exact", "local")


@dataclass(frozen=True)
class PlanConfig:
    """The settings of :func:`~mixprec.plan.plan_precision` (its keyword arguments build one).

    Every field is checked when the config is made; sequences are stored as tuples without repeats
    (first occurrence kept), numbers as floats where the planner compares them.

    Attributes:
        formats: candidate formats: :mod:`mixprec.lowbit` recipe names, ``"bf16"``, ``"fp32"``.
        budget: the bound (> 0) on the whole plan's measured relative loss change (0.01 = 1 %); None
            together with ``max_cost``.
        cost: a target name of :data:`mixprec.plan.TARGETS`, ``"measured"`` (timed on the model's
            device) or ``cost(format, m, n, k) -> float``; None: ``"measured"`` on a CUDA model, else
            ``"b200"``.
        compiled: price each format on the path a ``torch.compile``-d model runs (``"measured"`` times
            the layer under ``torch.compile``; a roofline target prices the quantization fused, the
            ``"fused"`` path) instead of eager. A callable has one figure per format, the same for both
            paths (``plan_precision`` warns that it prices a compiled run at it).
        quantize: the quantization path a roofline target prices (``"fused"``, ``"triton"`` or
            ``"unfused"``, :data:`mixprec.lowbit.cost.QUANTIZE_PATHS`); None: the path the run takes,
            :func:`mixprec.lowbit.cost.quantize_path`'s rule (``"fused"`` if ``compiled``, else
            ``"unfused"`` when ``MIXPREC_FUSED_QUANTIZE=0``, else ``"triton"``). An explicit value wins
            over ``compiled``; ``"measured"`` and a callable ignore it.
        tokens_per_step: the rows M every linear's GEMMs are priced at (None: the calibration rows).
        grad_budget: an optional bound (> 0) on the whole plan's relative weight-gradient change.
        max_flushed: the largest share in (0, 1] of a layer's forward input or weight a format may flush.
        max_cost: a bound (> 0) on the plan's GEMM cost relative to bf16 (needs ``budget=None``).
        min_low_share: with ``max_cost``, the least share in [0, 1] of GEMM FLOPs below bf16.
        exhaustive: measure every layer in every format up front.
        max_rounds: solves at most (an int >= 1).
        seed: seeds dropout and stochastic rounding (``torch.Generator.manual_seed``'s argument).
        measure: ``"exact"`` or ``"local"``.
        max_memory: a bound on the step's memory, bytes as an int or a size string (``"2GiB"``); None.
        state_formats, activation_formats: candidate optimizer-state and saved-activation formats,
            preferred first (None: fp32 moments / saved as they are).
        weight_update: ``"kahan"``, ``"stochastic"`` or ``"masters"`` (for the memory model).

    Raises:
        ValueError: naming the bad value and what is accepted, for any field out of its range, an unknown
            format, cost target, quantize path, measure, state or activation format or weight update, or
            ``budget`` and
            ``max_cost`` both given (or neither).
        TypeError: for a ``cost`` that is neither a name, a callable nor None.
    """

    formats: Sequence[str] = ("nvfp4", "mxfp8", "bf16")
    budget: float | None = 0.01
    cost: str | CostFn | None = None
    compiled: bool = False
    quantize: str | None = None
    tokens_per_step: int | None = None
    grad_budget: float | None = None
    max_flushed: float = 0.15
    max_cost: float | None = None
    min_low_share: float | None = None
    exhaustive: bool = False
    max_rounds: int = 6
    seed: int = 0
    measure: str = "exact"
    max_memory: int | str | None = None
    state_formats: Sequence[str | None] = (None, "bf16", "int8", "fp8")
    activation_formats: Sequence[str | None] = (None, "fp8", "mxfp8")
    weight_update: str = "kahan"

    def __post_init__(self) -> None:
        _check_dual(self.budget, self.grad_budget, self.max_cost, self.min_low_share)
        if self.budget is not None:
            _check_bound("budget", self.budget)
        if self.grad_budget is not None:
            _check_bound("grad_budget", self.grad_budget)
        formats = _check_formats(self.formats)
        _check_share("max_flushed", self.max_flushed)
        if isinstance(self.max_rounds, bool) or not isinstance(self.max_rounds, int) or self.max_rounds < 1:
            raise ValueError(f"max_rounds must be an int >= 1, got {self.max_rounds!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int (a torch.Generator seed), got {self.seed!r}")
        if not isinstance(self.exhaustive, bool):
            raise ValueError(f"exhaustive must be True or False, got {self.exhaustive!r}")
        if self.measure not in MEASURES:
            raise ValueError(f"measure must be 'exact' or 'local', got {self.measure!r}")
        if self.max_memory is not None:
            parse_bytes(self.max_memory)
        states, acts = check_formats(self.state_formats, self.activation_formats)
        if self.weight_update not in OPTIMIZERS:
            raise ValueError(f"weight_update must be one of {OPTIMIZERS}, got {self.weight_update!r}")
        if self.tokens_per_step is not None:
            check_tokens_per_step(self.tokens_per_step)
        if not isinstance(self.compiled, bool):
            raise ValueError(f"compiled must be True or False, got {self.compiled!r}")
        if self.quantize is not None:
            quantize_path(self.quantize)  # an unknown path raises, naming the accepted ones
        _check_cost(self.cost)
        for name, value in (
            ("formats", tuple(formats)),
            ("state_formats", tuple(states)),
            ("activation_formats", tuple(acts)),
            ("budget", None if self.budget is None else float(self.budget)),
            ("grad_budget", None if self.grad_budget is None else float(self.grad_budget)),
            ("max_cost", None if self.max_cost is None else float(self.max_cost)),
            ("max_flushed", float(self.max_flushed)),
        ):
            object.__setattr__(self, name, value)

    @property
    def max_memory_bytes(self) -> int | None:
        """``max_memory`` in bytes (None: no bound)."""
        return None if self.max_memory is None else parse_bytes(self.max_memory)

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> PlanConfig:
        """A config from keyword options; an unknown name is a TypeError naming it and the known ones."""
        known = [f.name for f in fields(cls)]
        unknown = [name for name in options if name not in known]
        if unknown:
            raise TypeError(
                f"plan_precision() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}; "
                f"accepted: {', '.join(known)}, check_batches, config"
            )
        return cls(**options)


def _check_formats(formats: Any) -> list[str]:
    if isinstance(formats, str) or not isinstance(formats, Sequence) or not formats:
        raise ValueError(f"formats must be a non-empty sequence of format names, got {formats!r}")
    known = [*RECIPES, *HIGH_PRECISION]
    for fmt in formats:
        if fmt not in HIGH_PRECISION:
            if not isinstance(fmt, str):
                raise ValueError(f"unknown format {fmt!r}; known: {', '.join(known)}")
            try:
                get_recipe(fmt)
            except (ValueError, TypeError):
                raise ValueError(f"unknown format {fmt!r}; known: {', '.join(known)}") from None
    return list(dict.fromkeys(formats))


def _check_cost(cost: Any) -> None:
    if cost is None or callable(cost):
        return
    if isinstance(cost, str):
        if cost != "measured" and cost not in TARGETS:
            known = ", ".join([*TARGETS, "measured"])
            raise ValueError(f"unknown cost target {cost!r}; known: {known} (or a callable)")
        return
    raise TypeError(f"cost must be a target name, a callable cost(format, m, n, k) or None, got {cost!r}")


def _check_dual(
    budget: float | None, grad_budget: float | None, max_cost: float | None, min_low_share: float | None
) -> None:
    """Exactly one of ``budget`` (the cheapest plan within a loss bound) and ``max_cost`` (the most
    accurate plan within a cost bound); ``min_low_share`` only with ``max_cost``."""
    if max_cost is None:
        if budget is None:
            raise ValueError("budget=None needs max_cost: give a loss budget or a cost bound")
        if min_low_share is not None:
            raise ValueError(f"min_low_share={min_low_share!r} applies with max_cost only (budget=None)")
        return
    if budget is not None:
        raise ValueError(
            f"give budget (the cheapest plan within a loss bound) or max_cost (the most accurate plan "
            f"within a cost bound), not both: pass budget=None with max_cost={max_cost!r}"
        )
    if grad_budget is not None:
        raise ValueError(f"grad_budget={grad_budget!r} applies with a loss budget, not with max_cost")
    _check_bound("max_cost", max_cost)
    if min_low_share is not None and (
        isinstance(min_low_share, bool)
        or not isinstance(min_low_share, (int, float))
        or not 0 <= min_low_share <= 1
    ):
        raise ValueError(f"min_low_share must be a share in [0, 1] or None, got {min_low_share!r}")


def _check_bound(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number > 0 (a relative change), got {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be > 0 (a relative change, e.g. 0.01), got {value!r}")


def _check_share(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"{name} must be a share in (0, 1], got {value!r}")
