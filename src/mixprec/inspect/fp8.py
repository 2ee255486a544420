"""`fp8_report`: what each linear layer loses in fp8, and which layers to keep out of it.

The per-tensor case of :func:`mixprec.inspect.lowbit_report` (recipe ``fp8_tensorwise``: one scale per
tensor, e4m3 input and weight, e5m2 output gradient), with the scale float8 training would use: the
dynamic scale ``format.max / amax / 2**margin`` for a plain ``nn.Linear`` or a dynamic
:class:`~mixprec.float8.Float8Linear`, the scale from the module's amax history for a delayed one (so a
history that lags the data shows as saturation). The capture (one float32 forward and backward, the model
restored exactly after it) and the figures are the lowbit report's: per tensor, amax, scale, the share of
non-zero values flushed to zero (``underflow``), the share of values more than half an ulp beyond
``format.max`` (``saturate``, clamped) and the relative error ``‖x - dequant(fp8(x))‖ / ‖x‖``. With one
block per tensor its worst-block figures are these. For block-scaled recipes (rowwise, MX, NVFP4), per
GEMM operand and block, use :func:`~mixprec.inspect.lowbit_report`.

Layers over any threshold are suggested to stay in bf16; :meth:`Fp8Report.module_filter_fn` is the
ready filter for :func:`mixprec.float8.convert_to_float8_training`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mixprec import formats
from mixprec._plots import new_figure, save_png
from mixprec.float8.convert import ModuleFilter, skip_fqns
from mixprec.float8.linear import Float8Linear
from mixprec.inspect._modules import LossFn, check_model, model_loss
from mixprec.inspect.lowbit import LowbitOperandStats, capture_linears, check_fractions
from mixprec.lowbit import FORMATS, Quantized
from mixprec.lowbit.history import amax_of, amax_to_scale, delayed_scale, to_float8

__all__ = ["Fp8LayerStats", "Fp8Report", "Fp8TensorStats", "fp8_report", "plot_fp8_report"]

_FORMATS = {"input": formats.FP8_E4M3FN, "weight": formats.FP8_E4M3FN, "grad_output": formats.FP8_E5M2}
_ROW = {"input": 0, "weight": 1, "grad_output": 2}


@dataclass(frozen=True)
class Fp8TensorStats:
    """One tensor of one layer as fp8 training would cast it.

    Attributes:
        format: "fp8_e4m3fn" or "fp8_e5m2".
        amax: ``max|x|`` (unscaled units of the tensor).
        scale: the multiplier into the fp8 range (dimensionless).
        underflow: fraction of the non-zero values that become zero.
        saturate: fraction of the values clamped to ``±format.max`` (beyond it by more than half an ulp).
        error: relative L2 error of the fp8 round trip (0 for an all-zero tensor).
    """

    format: str
    amax: float
    scale: float
    underflow: float
    saturate: float
    error: float

    @classmethod
    def measure(cls, x: torch.Tensor, fmt: formats.Format, scale: torch.Tensor) -> Fp8TensorStats:
        """The figures of ``x`` (any shape) cast to ``fmt`` (e4m3fn or e5m2) at 0-dim float32 ``scale``."""
        x = x.detach().to(torch.float32).reshape(-1, x.shape[-1] if x.dim() else 1)
        lowbit_fmt = FORMATS["fp8_tensorwise_e5m2" if fmt.name == "fp8_e5m2" else "fp8_tensorwise"]
        q = Quantized(to_float8(x, scale, fmt), scale.reshape(1, 1), None, lowbit_fmt, x.shape, x.dtype, -1)
        stats = LowbitOperandStats.of_quantized(x, q, outlier_ratio=8.0)
        return cls(fmt.name, amax_of(x).item(), scale.item(), stats.flushed, stats.saturated, stats.error)


@dataclass(frozen=True)
class Fp8LayerStats:
    """The three fp8 tensors of one linear layer (``grad_output`` None if no gradient reached it)."""

    input: Fp8TensorStats
    weight: Fp8TensorStats
    grad_output: Fp8TensorStats | None


@dataclass(frozen=True)
class Fp8Report:
    """Per-layer fp8 losses and the layers suggested to stay in bf16.

    Attributes:
        layers: qualified module name -> :class:`~mixprec.inspect.fp8.Fp8LayerStats`, in
            ``named_modules`` order.
        max_flushed, max_saturated, max_error: the thresholds a layer is judged against (the names
            :class:`~mixprec.inspect.LowbitReport` uses).
    """

    layers: dict[str, Fp8LayerStats]
    max_flushed: float
    max_saturated: float
    max_error: float

    def reasons(self, name: str) -> list[str]:
        """Why layer ``name`` should stay in bf16 (empty: fp8 is fine for it)."""
        out = []
        for role, stats in asdict(self.layers[name]).items():
            if stats is None:
                continue
            for key, limit in (("underflow", self.max_flushed), ("saturate", self.max_saturated)):
                if stats[key] > limit:
                    out.append(f"{role} {key} {stats[key]:.2%} > {limit:.2%}")
            if stats["error"] > self.max_error:
                out.append(f"{role} error {stats['error']:.3f} > {self.max_error:.3f}")
        return out

    def keep_in_bf16(self) -> list[str]:
        """The layers over a threshold, in model order."""
        return [name for name in self.layers if self.reasons(name)]

    def module_filter_fn(self) -> ModuleFilter:
        """``(module, fqn) -> bool`` for ``convert_to_float8_training``: False for :meth:`keep_in_bf16`."""
        return skip_fqns(self.keep_in_bf16())

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-ready): per-layer stats, thresholds and the suggestion."""
        return {
            "layers": {name: asdict(stats) for name, stats in self.layers.items()},
            "thresholds": {"underflow": self.max_flushed, "saturate": self.max_saturated},
            "max_error": self.max_error,
            "keep_in_bf16": self.keep_in_bf16(),
        }

    def table(self) -> str:
        """A text table: one row per layer and tensor, the suggestion at the end."""
        head = f"{'layer':<24} {'tensor':<12} {'format':<10} {'amax':>10} {'scale':>10} "
        lines = [head + f"{'underflow':>10} {'saturate':>9} {'error':>7}"]
        for name, layer in self.layers.items():
            for role, stats in (
                ("input", layer.input),
                ("weight", layer.weight),
                ("grad_output", layer.grad_output),
            ):
                if stats is None:
                    continue
                lines.append(
                    f"{name:<24} {role:<12} {stats.format[4:]:<10} {stats.amax:>10.3g} {stats.scale:>10.3g} "
                    f"{stats.underflow:>10.2%} {stats.saturate:>9.2%} {stats.error:>7.3f}"
                )
        keep = self.keep_in_bf16()
        lines.append(
            "keep in bf16: " + (", ".join(f"{n} ({'; '.join(self.reasons(n))})" for n in keep) or "none")
        )
        return "\n".join(lines)


def _scale(module: nn.Linear, role: str, x: torch.Tensor) -> torch.Tensor:
    """The scale fp8 training gives ``x`` in this module right now (see the module doc)."""
    fmt = _FORMATS[role]
    amax = amax_of(x)
    if isinstance(module, Float8Linear) and module.amax_history is not None:
        config = module.config
        return delayed_scale(
            module.amax_history[_ROW[role]], amax, fmt, config.margin, config.amax_compute_algo
        )
    margin = module.config.margin if isinstance(module, Float8Linear) else 0
    return amax_to_scale(amax, fmt, margin)


def fp8_report(
    model: nn.Module,
    inputs: Any,
    *,
    loss_fn: LossFn,
    max_flushed: float = 0.01,
    max_saturated: float = 0.001,
    max_error: float = 0.1,
) -> Fp8Report:
    """Measure every linear layer's fp8 losses on one forward and backward (see the module doc).

    Args:
        model: the model (plain or converted); it is handed back exactly as it was.
        inputs: a tensor, a tuple/list (positional) or a dict (keyword) of model inputs.
        loss_fn: ``loss_fn(model, batch) -> scalar tensor``, called once with ``inputs`` as the batch.
        max_flushed: a layer whose tensors flush more than this fraction of non-zero values is kept in bf16.
        max_saturated: ... or saturate more than this fraction of values.
        max_error: ... or lose more than this relative L2 error in the round trip.

    Returns:
        An :class:`Fp8Report`; ``print(report.table())``, ``report.module_filter_fn()``.

    Raises:
        TypeError: if ``model`` is not an ``nn.Module``, or ``loss_fn`` is not ``loss_fn(model, batch)``
            (refused before the model runs, or when it raises: the message names what was passed).
        ValueError: for a threshold outside [0, 1] (name in the message), a model without ``nn.Linear``,
            or a loss that is not a one-element tensor requiring grad.
    """
    check_model(model)
    loss_fn = model_loss(loss_fn, "fp8_report")
    check_fractions(max_flushed=max_flushed, max_saturated=max_saturated, max_error=max_error)
    layers = {}
    for name, seen in capture_linears(model, inputs, loss_fn, "fp8_report").items():
        module = seen["module"]
        stats = {
            role: Fp8TensorStats.measure(seen[key], _FORMATS[role], _scale(module, role, seen[key]))
            for role, key in (("input", "x"), ("weight", "w"), ("grad_output", "go"))
            if key in seen
        }
        layers[name] = Fp8LayerStats(stats["input"], stats["weight"], stats.get("grad_output"))
    return Fp8Report(layers, float(max_flushed), float(max_saturated), float(max_error))


def plot_fp8_report(report: Fp8Report, path: str | Path) -> Path:
    """PNG of an :class:`Fp8Report`: per layer and tensor, the round-trip error and the fraction lost
    (underflow + saturation); layers suggested for bf16 are labelled in red. Needs matplotlib.

    Raises:
        TypeError: if ``report`` is not an :class:`Fp8Report`.
        ImportError: without matplotlib (``pip install 'mixprec[plot]'``).
    """
    if not isinstance(report, Fp8Report):
        raise TypeError(f"report must be an Fp8Report, got {type(report).__name__}")
    names = list(report.layers)
    keep = set(report.keep_in_bf16())
    figure = new_figure(figsize=(10, 1.2 + 0.45 * len(names)))
    panels = (("round-trip error (relative L2)", "error"), ("fraction lost (underflow + saturate)", None))
    for index, (title, key) in enumerate(panels):
        axes = figure.add_subplot(1, 2, index + 1)
        for offset, role in enumerate(_FORMATS):
            values = []
            for name in names:
                stats = getattr(report.layers[name], role)
                values.append(
                    0.0 if stats is None else stats.error if key else stats.underflow + stats.saturate
                )
            positions = [i + (offset - 1) * 0.27 for i in range(len(names))]
            axes.barh(positions, values, height=0.27, label=f"{role} ({_FORMATS[role].name[4:]})")
        axes.set_yticks(range(len(names)), names if index == 0 else [""] * len(names))
        axes.invert_yaxis()
        axes.set_title(title, fontsize=10)
        if index == 0:
            for label in axes.get_yticklabels():
                label.set_color("tab:red" if label.get_text() in keep else "black")
            axes.legend(fontsize=8, loc="lower right")
    figure.suptitle(f"fp8 per layer; keep in bf16 (red): {', '.join(sorted(keep)) or 'none'}", fontsize=11)
    return save_png(figure, path, rect=(0, 0, 1, 0.93))
