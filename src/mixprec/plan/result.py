"""`PrecisionPlan`: which linear layer runs in which format, with the measurements that decided it."""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mixprec._files import write_atomic
from mixprec.lowbit import LowbitLinear, get_recipe, save_activations
from mixprec.lowbit.sr import check_layer_generator
from mixprec.lowbit.swap import converted_as, is_converted, refuse_reconversion
from mixprec.plan.measure import HIGH_PRECISION

__all__ = ["PrecisionPlan"]

_VERSION = 6
#: version 2 documents have no ``measure`` field (they were measured exactly); versions 2-3 have no
#: ``tokens_per_step`` or ``not_run`` (priced at the calibration rows; every linear that ran is listed);
#: versions 2-4 have no ``state_format``, ``activation_format`` or ``memory`` (no memory was planned)
#: versions 2-5 have no ``quantize`` (a roofline target's quantization path was not recorded)
_READS = (2, 3, 4, 5, 6)
_QUANTIZE_WORDS = {"fused": "compiled, fused", "triton": "eager Triton", "unfused": "eager pure-torch"}


@dataclass(frozen=True)
class PrecisionPlan:
    """A per-layer format assignment (see :func:`mixprec.plan.plan_precision`).

    Attributes:
        formats: qualified name -> format (a :mod:`mixprec.lowbit` recipe name, ``"bf16"`` or ``"fp32"``).
        layers: qualified name -> ``{"shape": [M, N, K], "priced_rows": int, "flops": int,
            "cost": {format: float},
            "divergence": {format: {"loss", "weight_grad", "input_grad", "error", "flushed",
            "saturated", "outlier_blocks", "fprop_flushed"}}}``: ``M`` rows of input (tokens) over the
            planning batches' first batch, ``N`` outputs, ``K`` inputs; ``priced_rows`` the rows the
            cost was computed at (``tokens_per_step``, else ``M``); ``flops`` of the three training
            GEMMs at those rows (``6 priced_rows N K``); cost in the cost model's unit; the divergences
            are relative (0.01 = 1 %),
            quantization shares in [0, 1] (``fprop_flushed``: of the forward input and weight only).
        reasons: qualified name -> why its format was chosen, in words.
        budget: the bound on the measured relative loss change of the whole plan (None for a plan made
            with ``max_cost``).
        measured: the whole plan's measured divergences (``loss``, ``weight_grad``; with check batches
            also ``check_loss``, ``check_weight_grad``; ``loss`` and ``weight_grad`` are the larger of
            the two sets), relative.
        rounds: one entry per solve: the budget the solver was given and the plan's measured loss change.
        target: the cost model's name; grad_budget: the bound on ``measured["weight_grad"]`` (None: none);
            seconds: planning CPU time (process time, s); step_seconds: the CPU time of one reference
            forward/backward of one batch (s); passes: forward/backward passes over a set of batches the
            planning ran (the reference, one per layer and format measured, one per whole-plan check).
        measure: how single layers were measured, ``"exact"`` (a pass each) or ``"local"`` (one-pass
            estimates; their divergence records also hold ``loss_first_order`` and ``loss_second_order``),
            or ``"local+exact"``: estimates until a whole plan measured over ``grad_budget``, then exact
            (that round is marked ``switched_to_exact`` in ``rounds``).
        max_cost, min_low_share: the cost bound (relative to all planned layers in bf16) and least share
            of GEMM FLOPs below bf16 of a plan made as the most accurate within a cost (else None).
        tokens_per_step: the rows M every GEMM was priced at (None: each layer's calibration rows).
        not_run: the ``nn.Linear`` layers ``loss_fn`` never called: not planned, kept as they are.
        state_format, activation_format: the optimizer's ``state_format=`` and the
            :func:`~mixprec.lowbit.save_activations` format planned for the whole model (None: fp32
            moments / activations saved as they are); see :meth:`optimizer_kwargs` and
            :meth:`save_activations`.
        memory: ``{"max_memory": bytes or None, "weight_update": str, "components": {"weights",
            "gradients", "optimizer_state", "activations", "total"} (bytes, predicted by
            :mod:`mixprec.plan.memory` for the planned formats), "options": [{"state_format",
            "activation_format", "total"}, ...] (every candidate pair)}``; None in a plan read from a
            version before 5.
        quantize: the quantization path a roofline ``target`` priced each operand's quantization on
            (``"fused"``: compiled, ``"triton"``: CUDA eager, ``"unfused"``: pure torch;
            :func:`mixprec.lowbit.cost.quantize_path`); None for a measured or user cost, a ``"-peak"``
            target (compute only: no path enters its cost), and in a plan read from a version before 6.
    """

    formats: dict[str, str]
    layers: dict[str, dict[str, Any]]
    reasons: dict[str, str]
    budget: float | None
    measured: dict[str, float]
    rounds: list[dict[str, float]] = field(default_factory=list)
    target: str = "b200"
    grad_budget: float | None = None
    seconds: float = 0.0
    step_seconds: float = 0.0
    passes: int = 0
    max_cost: float | None = None
    min_low_share: float | None = None
    measure: str = "exact"
    tokens_per_step: int | None = None
    not_run: list[str] = field(default_factory=list)
    state_format: str | None = None
    activation_format: str | None = None
    memory: dict[str, Any] | None = None
    quantize: str | None = None

    # ------------------------------------------------------------------ reading
    def flop_share(self, fqn: str) -> float:
        """Layer ``fqn``'s share of the planned layers' GEMM FLOPs."""
        total = sum(info["flops"] for info in self.layers.values())
        return self.layers[fqn]["flops"] / total if total else 0.0

    def low_precision_share(self) -> float:
        """Share of the GEMM FLOPs planned below bf16 (in a low-bit recipe); 0.0 or 1.0 for a plan with one
        format everywhere, even one made without measurements (a ``Replan`` phase before any plan)."""
        low = {fmt not in HIGH_PRECISION for fmt in self.formats.values()}
        if len(low) < 2:
            return float(low == {True})
        return sum(self.flop_share(f) for f, fmt in self.formats.items() if fmt not in HIGH_PRECISION)

    def relative_cost(self) -> float:
        """The plan's GEMM cost over the all-bf16 cost, in the cost model (``< 1`` is faster); NaN when a
        layer's format was never priced (a :class:`~mixprec.plan.Replan` phase plan)."""
        costs = [self.layers.get(f, {}).get("cost", {}).get(fmt) for f, fmt in self.formats.items()]
        if any(c is None for c in costs):
            return float("nan")
        planned = sum(costs)
        bf16 = sum(info["cost"].get("bf16", float("nan")) for info in self.layers.values())
        return planned / bf16

    def module_filter_fn(self, fmt: str) -> Callable[[nn.Module, str], bool]:
        """``(module, fqn) -> bool`` for ``convert_to_lowbit_training``: True for the layers in ``fmt``.

        Raises:
            ValueError: for a name that is neither a :mod:`mixprec.lowbit` recipe nor ``"bf16"``/``"fp32"``
                (a filter that matched nothing would leave every layer unconverted without a word).
        """
        if fmt not in HIGH_PRECISION:
            get_recipe(fmt)  # an unknown name raises, naming the recipes
        chosen = frozenset(f for f, planned in self.formats.items() if planned == fmt)
        return lambda module, fqn: fqn in chosen

    # ------------------------------------------------------------------ acting
    def optimizer_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for :class:`mixprec.CompensatedOptimizer` or
        :class:`mixprec.MixedPrecisionOptimizer` that give the planned optimizer state:
        ``{"state_format": ...}``, one for all parameter groups (the optimizers take one per optimizer).
        For fp32 moments (None) under Kahan or stochastic updates it adds ``state_dtype=torch.float32``,
        which the memory model counted (the compensated optimizer's own default keeps the first moment
        in bf16 where it can)."""
        out: dict[str, Any] = {"state_format": self.state_format}
        update = (self.memory or {}).get("weight_update")
        if self.state_format is None and update in ("kahan", "stochastic"):
            out["state_dtype"] = torch.float32
        return out

    def save_activations(self, module: nn.Module | None = None) -> contextlib.AbstractContextManager:
        """The planned saved-activation format as a context manager to enter around the forward:
        :class:`mixprec.lowbit.save_activations` (``module``: the model, whose parameters and buffers are
        then kept as they are), or a no-op when the plan keeps activations as they are."""
        if self.activation_format is None:
            return contextlib.nullcontext()
        return save_activations(self.activation_format, module=module)

    def apply(self, model: nn.Module, generator: torch.Generator | None = None) -> nn.Module:
        """Put each planned layer of ``model`` in its format, in place, and return ``model``.

        A low-bit layer becomes a :class:`~mixprec.lowbit.LowbitLinear` of its recipe; a ``"bf16"`` or
        ``"fp32"`` layer is a plain ``nn.Linear`` (it then runs in the precision of the surrounding region,
        e.g. ``mixprec.autocast``). Layers already converted (by an earlier plan) are re-set, so re-planning
        during training is ``new_plan.apply(model)``. Parameters are shared, never copied: an optimizer
        built before keeps working.

        Raises:
            ValueError: if a planned name is not an ``nn.Linear`` of ``model``, is a layer converted by
                another API (``convert_to_float8_training``), a format is unknown, or ``generator`` is on
                another device than a layer whose format draws (nothing is changed then).
        """
        modules = dict(model.named_modules())
        missing = [f for f in self.formats if not isinstance(modules.get(f), nn.Linear)]
        if missing:
            raise ValueError(f"plan names layers that are not nn.Linear modules of this model: {missing}")
        refuse_reconversion(  # a plan re-sets its own LowbitLinear layers, never another swap's
            [
                (f, converted_as(modules[f]))
                for f in self.formats
                if is_converted(modules[f]) and not isinstance(modules[f], LowbitLinear)
            ],
            "Plan.apply",
            "this plan's formats",
        )
        for fmt in set(self.formats.values()) - set(HIGH_PRECISION):
            get_recipe(fmt)  # an unknown format raises here, before any layer is swapped
        for fqn, fmt in self.formats.items():  # so does a generator a drawing layer cannot use
            if fmt not in HIGH_PRECISION and generator is not None:
                weight = modules[fqn].weight
                check_layer_generator(get_recipe(fmt), generator, weight.device, f"the weight of {fqn!r}")
        for fqn, fmt in self.formats.items():
            module = modules[fqn]
            if fmt in HIGH_PRECISION:
                new = _plain(module)
            elif isinstance(module, LowbitLinear) and module.recipe == get_recipe(fmt):
                new = module
            else:
                new = LowbitLinear.from_linear(module, fmt, generator)
            if new is not module:
                parent, _, child = fqn.rpartition(".")
                setattr(model.get_submodule(parent), child, new)
        return model

    # ------------------------------------------------------------------ showing
    def table(self) -> str:
        """One row per layer: shape, share of GEMM FLOPs, chosen format, its divergences, the reason."""
        head = f"{'layer':<24} {'M x N x K':>18} {'flops':>6} {'format':<15} {'loss div':>9} {'wgrad div':>9}"
        lines = [head + "  reason"]
        for fqn, fmt in self.formats.items():
            info = self.layers.get(fqn)  # None, or no divergence in fmt: a Replan phase, not measured
            shape = "-" if info is None else "x".join(map(str, info["shape"]))
            share = None if info is None else self.flop_share(fqn)
            d = {} if info is None else info["divergence"].get(fmt, {})
            lines.append(
                f"{fqn:<24} {shape:>18} {_cell(share, 6, '.1%')} {fmt:<15} {_cell(d.get('loss'), 9, '.2e')} "
                f"{_cell(d.get('weight_grad'), 9, '.2e')}  {self.reasons[fqn]}"
            )
        lines += [
            f"{fqn:<24} {'':>18} {'':>6} {'-':<15} {'':>9} {'':>9}  not run, kept as is"
            for fqn in self.not_run
        ]
        unmeasured = [
            f for f, fmt in self.formats.items() if fmt not in self.layers.get(f, {}).get("divergence", {})
        ]
        if unmeasured:  # a Replan phase: the formats were set, not planned, so no cost or divergence is known
            lines.append(
                f"plan: {self.low_precision_share():.1%} of GEMM FLOPs below bf16; {len(unmeasured)} "
                "layer(s) set without a measurement in their format (a Replan phase): no cost or divergence"
            )
            return "\n".join(lines)
        m = self.measured
        lines.append(self._priced())
        lines += self.memory_lines()
        lines.append(
            f"plan: {self.low_precision_share():.1%} of GEMM FLOPs below bf16, "
            f"cost {self.relative_cost():.3f}x bf16 on {self._target()}; "
            f"measured loss divergence {m['loss']:.2e} ({self._bound()}), "
            f"weight-gradient divergence {m['weight_grad']:.2e} after {len(self.rounds)} solve(s); "
            f"planning {self.seconds:.2f} s "
            f"= {self.seconds / max(self.step_seconds, 1e-9):.0f} reference steps, {self.passes} passes"
        )
        return "\n".join(lines)

    def memory_lines(self) -> list[str]:
        """The planned memory per component and formats, in MiB ([] for a plan without a memory record)."""
        if self.memory is None:
            return []
        c, bound = self.memory["components"], self.memory["max_memory"]
        parts = ", ".join(f"{k.replace('_', ' ')} {c[k] / 2**20:.2f}" for k in c if k != "total")
        limit = "no bound" if bound is None else f"max_memory {bound / 2**20:.2f} MiB"
        return [
            f"memory ({self.memory['weight_update']} updates): state_format={self.state_format!r}, "
            f"save_activations={self.activation_format!r}; {parts}; total {c['total'] / 2**20:.2f} MiB "
            f"({limit})"
        ]

    def _priced(self) -> str:
        """The line saying which rows M the cost model priced the GEMMs at (M x N x K above is measured)."""
        if self.tokens_per_step is not None:
            return (
                f"priced at M={self.tokens_per_step} rows per GEMM (tokens_per_step); errors measured at "
                "M x N x K above"
            )
        rows = sorted({info["shape"][0] for info in self.layers.values()})
        shown = ", ".join(map(str, rows)) if len(rows) < 4 else f"{rows[0]}-{rows[-1]}"
        return f"priced at the calibration batch's M={shown} rows (no tokens_per_step: not the run's shape)"

    def _target(self) -> str:
        """The target, with the quantization path a roofline priced (a measured cost timed its own)."""
        if self.quantize is None:
            return self.target
        return f"{self.target} ({_QUANTIZE_WORDS.get(self.quantize, self.quantize)} quantization)"

    def _bound(self) -> str:
        if self.budget is not None:
            return f"budget {self.budget:.2e}"
        share = "" if self.min_low_share is None else f", >= {self.min_low_share:.0%} below bf16"
        return f"most accurate within {self.max_cost:g}x bf16's cost{share}"

    def plot(self, path: str | Path | None = None, ax: Any = None) -> Any:
        """Loss divergence per layer (x) and format (one line each, log scale), the chosen one circled.

        Returns the matplotlib ``Figure``; written to ``path`` when given.
        """
        import matplotlib

        if ax is None and path is not None:
            matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(max(6, len(self.layers) * 0.5), 4)) if ax is None else (ax.figure, ax)
        names = list(self.layers)
        fmts = list(dict.fromkeys(f for info in self.layers.values() for f in info["divergence"]))
        floor = 1e-9
        for fmt in fmts:
            ys = [_shown(self.layers[n]["divergence"].get(fmt, {}).get("loss"), floor) for n in names]
            ax.plot(range(len(names)), ys, marker=".", label=fmt)
        chosen = [
            _shown(self.layers[n]["divergence"].get(self.formats.get(n), {}).get("loss"), floor)
            for n in names
        ]
        ax.scatter(range(len(names)), chosen, s=120, facecolors="none", edgecolors="black", label="chosen")
        if self.budget is not None:
            ax.axhline(self.budget, color="grey", linestyle="--", label="budget")
        ax.set_yscale("log")
        ax.set_xticks(range(len(names)), names, rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("relative loss change, layer alone")
        ax.set_title(f"precision plan ({self.target}, {self._bound()})")
        ax.legend(fontsize=7)
        fig.tight_layout()
        if path is not None:
            buffer = io.BytesIO()
            fig.savefig(buffer, format=Path(path).suffix.lstrip(".") or "png")
            write_atomic(path, buffer.getvalue())  # complete or absent, see mixprec._files
        return fig

    # ------------------------------------------------------------------ data
    def to_json(self) -> str:
        """The plan as a JSON string (:meth:`from_json` reads it back to an equal plan)."""
        return json.dumps({"version": _VERSION, **asdict(self)}, indent=1, allow_nan=True)

    @classmethod
    def from_json(cls, text: str) -> PrecisionPlan:
        """The plan a :meth:`to_json` string holds.

        Raises:
            ValueError: for text that is not a plan of this version (or not JSON: a file's path, say), or
                formats that name layers without a reason (a layer may lack measurements: a Replan phase
                before any plan has none).
        """
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:  # e.g. a file's path: the message says what to pass
            raise ValueError(
                f"not a mixprec precision plan JSON document ({exc}): from_json takes the JSON text, e.g. "
                f"PrecisionPlan.from_json(Path('plan.json').read_text()); got {text[:60]!r}"
            ) from None
        if not isinstance(data, dict) or data.pop("version", None) not in _READS:
            raise ValueError(f"not a mixprec precision plan (version {_VERSION}) JSON document")
        try:
            plan = cls(**data)
        except TypeError as exc:
            raise ValueError(f"not a mixprec precision plan: {exc}") from None
        # a layer may lack measurements: a Replan phase before any plan sets formats only
        unknown = [f for f in plan.formats if f not in plan.reasons]
        if unknown:
            raise ValueError(f"plan formats name layers without a reason: {unknown}")
        return plan


def _cell(value: float | None, width: int, spec: str) -> str:
    """A table cell: ``value`` in ``spec``, or ``-`` where it was not measured; right-aligned."""
    return f"{'-' if value is None else format(value, spec):>{width}}"


def _shown(value: float | None, floor: float) -> float:
    """A divergence on a log axis: not measured (None) is a gap, zero sits at ``floor``."""
    return float("nan") if value is None else max(value, floor)


def _plain(module: nn.Linear) -> nn.Linear:
    """``module`` as an exact ``nn.Linear`` (sharing its parameters)."""
    if type(module) is nn.Linear:
        return module
    with torch.device("meta"):
        new = nn.Linear(module.in_features, module.out_features, bias=False)
    new.weight, new.bias = module.weight, module.bias
    new.train(module.training)
    return new
