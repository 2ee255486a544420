"""`lowbit_report`: what each linear layer loses under a low-bit recipe, operand by operand.

For every ``nn.Linear`` of a model (converted :class:`~mixprec.lowbit.LowbitLinear` modules included), one
float32 forward and backward captures the layer's input, weight and output gradient; each of the six GEMM
operands of the recipe (:data:`mixprec.lowbit.OPERANDS`) is then quantized as that GEMM quantizes it (same
format, same axis, the Hadamard rotation of the wgrad operands if the recipe has it; nearest rounding, so
the figures are not random) and measured:

* ``error``: relative L2 error ``‖x - dequant(quant(x))‖ / ‖x‖``;
* ``flushed``: share of the non-zero values that become zero, overall and in the worst block;
* ``saturated``: share of the values the block scale puts more than half an ulp beyond the element's max
  (so they are clamped), overall and in the worst block (the OCP floor rule of the ``mxfp8`` format and
  the ``mxfp8_floor`` recipe does this to a block's largest values: ~12% of uniform weights; the
  ``mxfp8`` recipe rounds scales up and saturates none);
* ``outlier_blocks``: share of blocks whose scale an outlier set: the block's amax is more than
  ``outlier_ratio`` times the RMS of the block's other non-zero values, so those sit far below the scale and
  lose mantissa bits or flush (one outlier channel under a per-tensor scale is the one-block extreme).

Layers over a threshold are the ones the format hurts; :meth:`LowbitReport.module_filter_fn` is the filter
for :func:`mixprec.lowbit.convert_to_lowbit_training` that keeps them in high precision. The model is
restored exactly after the measurement (hooks removed; parameters, buffers, grads, modes, torch's RNG and
the converted modules' stochastic-rounding generators as before). :func:`mixprec.inspect.fp8_report` is
the per-tensor case, on the same capture (:func:`capture_linears`) and measurement.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from mixprec import formats
from mixprec.inspect._modules import LossFn, call_loss, check_model, model_loss
from mixprec.inspect._restore import preserved
from mixprec.lowbit import (
    HP,
    OPERANDS,
    Quantized,
    Recipe,
    get_recipe,
    load_sr_state_dict,
    quantize,
    sr_state_dict,
)
from mixprec.lowbit.gemm import gemm_operands

__all__ = ["LowbitOperandStats", "LowbitReport", "lowbit_report"]


@dataclass(frozen=True)
class LowbitOperandStats:
    """One GEMM operand of one layer as the recipe quantizes it (shares are fractions in [0, 1])."""

    format: str
    error: float
    flushed: float
    worst_block_flushed: float
    saturated: float
    worst_block_saturated: float
    outlier_blocks: float
    blocks: int

    @classmethod
    def measure(cls, matrix: torch.Tensor, fmt: str, outlier_ratio: float) -> LowbitOperandStats:
        """The figures of (M, K) ``matrix`` quantized to ``fmt`` along K (zero-padded to the block)."""
        x = matrix.detach().to(torch.float32)
        return cls.of_quantized(x, quantize(x, fmt, pad=True), outlier_ratio)

    @classmethod
    def of_quantized(cls, x: torch.Tensor, q: Quantized, outlier_ratio: float) -> LowbitOperandStats:
        """The figures of float32 (M, K) ``x`` against ``q``, its quantization along K at any scale."""
        back = q.dequantize().reshape(x.shape)
        (mp, kp), (mb, kb) = q.values().shape, q.scale.shape
        pad = (0, kp - x.shape[1], 0, mp - x.shape[0])  # zeros: neither flushed nor saturated
        blocks = torch.nn.functional.pad(x, pad).reshape(mb, mp // mb, kb, kp // kb)
        back_blocks = torch.nn.functional.pad(back, pad).reshape(blocks.shape)
        nonzero = blocks != 0
        flushed = nonzero & (back_blocks == 0)
        saturated = (blocks.abs() / q.block_descale()[:, None, :, None]) > saturation_point(q.fmt.elem)
        per_block = (1, 3)
        block_nonzero = nonzero.sum(per_block).clamp(min=1)
        amax = blocks.abs().amax(per_block).double()
        rest = (blocks.double().square().sum(per_block) - amax.square()).clamp(min=0)
        rest_rms = rest.div((block_nonzero - 1).clamp(min=1)).sqrt()
        tiny = torch.finfo(torch.float32).tiny
        values = [
            (back - x).norm() / x.norm().clamp(min=tiny),
            flushed.sum() / nonzero.sum().clamp(min=1),
            (flushed.sum(per_block) / block_nonzero).max(),
            saturated.float().sum() / x.numel(),
            (saturated.float().sum(per_block) / block_nonzero).max(),
            ((amax > outlier_ratio * rest_rms) & (block_nonzero > 1)).float().mean(),
        ]
        error, flushed_share, worst_flushed, saturated_share, worst_saturated, outliers = torch.stack(
            values
        ).tolist()
        return cls(
            q.fmt.name,
            error,
            flushed_share,
            worst_flushed,
            saturated_share,
            worst_saturated,
            outliers,
            mb * kb,
        )


@dataclass(frozen=True)
class LowbitReport:
    """Per layer and operand, what the recipe loses; the layers over a threshold.

    Attributes:
        recipe: the recipe string measured.
        layers: qualified name -> operand name -> :class:`~mixprec.inspect.lowbit.LowbitOperandStats`
            (hp operands and the gradient operands of a layer no gradient reached are absent).
        max_error, max_flushed, max_saturated: the thresholds a layer is judged against.
    """

    recipe: str
    layers: dict[str, dict[str, LowbitOperandStats]]
    max_error: float
    max_flushed: float
    max_saturated: float

    def reasons(self, name: str) -> list[str]:
        """Why layer ``name`` should stay in high precision (empty: the recipe is fine for it)."""
        out = []
        for operand, stats in self.layers[name].items():
            for key, limit in (("error", self.max_error), ("flushed", self.max_flushed)):
                if getattr(stats, key) > limit:
                    out.append(f"{operand} {key} {getattr(stats, key):.3g} > {limit:.3g}")
            if stats.saturated > self.max_saturated:
                out.append(f"{operand} saturated {stats.saturated:.3g} > {self.max_saturated:.3g}")
        return out

    def keep_high_precision(self) -> list[str]:
        """The layers over a threshold, in model order."""
        return [name for name in self.layers if self.reasons(name)]

    def module_filter_fn(self) -> Callable[[nn.Module, str], bool]:
        """``(module, fqn) -> bool`` for ``convert_to_lowbit_training``: False for the layers it hurts."""
        keep = frozenset(self.keep_high_precision())
        return lambda module, fqn: fqn not in keep

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-ready)."""
        layers = {n: {op: asdict(s) for op, s in ops.items()} for n, ops in self.layers.items()}
        thresholds = {"error": self.max_error, "flushed": self.max_flushed, "saturated": self.max_saturated}
        return {
            "recipe": self.recipe,
            "layers": layers,
            "thresholds": thresholds,
            "keep": self.keep_high_precision(),
        }

    def table(self) -> str:
        """A text table: one row per layer and operand, the suggestion at the end."""
        lines = [f"recipe: {self.recipe}"]
        head = f"{'layer':<22} {'operand':<9} {'format':<20} {'error':>7} {'flushed':>8} {'worst blk':>9} "
        lines.append(head + f"{'saturated':>9} {'outlier blks':>12}")
        for name, ops in self.layers.items():
            for op, s in ops.items():
                lines.append(
                    f"{name:<22} {op:<9} {s.format:<20} {s.error:>7.4f} {s.flushed:>8.2%} "
                    f"{s.worst_block_flushed:>9.2%} {s.saturated:>9.2%} {s.outlier_blocks:>12.2%}"
                )
        keep = self.keep_high_precision()
        lines.append(
            "keep in high precision: "
            + (", ".join(f"{n} ({'; '.join(self.reasons(n))})" for n in keep) or "none")
        )
        return "\n".join(lines)


def lowbit_report(
    model: nn.Module,
    inputs: Any,
    *,
    loss_fn: LossFn,
    recipe: Recipe | str,
    max_error: float = 0.2,
    max_flushed: float = 0.5,
    max_saturated: float = 0.05,
    outlier_ratio: float = 8.0,
) -> LowbitReport:
    """Measure every linear layer's losses under ``recipe`` on one forward and backward (see the module doc).

    Args:
        model: the model (plain or converted); it is handed back exactly as it was.
        inputs: a tensor, a tuple/list (positional) or a dict (keyword) of model inputs.
        loss_fn: ``loss_fn(model, batch) -> scalar tensor``, called once with ``inputs`` as the batch (as
            :func:`mixprec.plan.plan_precision` calls it).
        recipe: a :class:`~mixprec.lowbit.Recipe` or recipe string.
        max_error, max_flushed, max_saturated: thresholds in [0, 1] over which a layer is kept out. The
            defaults are for 4-bit formats too: e2m1 flushes every value below 1/24 of its block's amax,
            5-10% of a Gaussian block, so a flushed share matters when it is most of an operand.
        outlier_ratio: a block's amax over the RMS of its other values above which an outlier set the
            block's scale (> 1).

    Raises:
        TypeError: if ``model`` is not an ``nn.Module``, or ``loss_fn`` is not ``loss_fn(model, batch)``
            (refused before the model runs, or when it raises: the message names what was passed).
        ValueError: for a threshold out of range, an unknown recipe, a model without ``nn.Linear``, or a
            loss that is not a one-element tensor requiring grad.
    """
    check_model(model)
    loss_fn = model_loss(loss_fn, "lowbit_report")
    recipe = get_recipe(recipe)
    check_fractions(max_error=max_error, max_flushed=max_flushed, max_saturated=max_saturated)
    if (
        isinstance(outlier_ratio, bool)
        or not isinstance(outlier_ratio, (int, float))
        or not outlier_ratio > 1
    ):
        raise ValueError(f"outlier_ratio must be a number > 1, got {outlier_ratio!r}")
    seen = capture_linears(model, inputs, loss_fn)
    layers = {name: operand_stats(t, recipe, outlier_ratio) for name, t in seen.items()}
    return LowbitReport(str(recipe), layers, float(max_error), float(max_flushed), float(max_saturated))


def check_fractions(**thresholds: object) -> None:
    """Raise ValueError naming the first threshold that is not a number in [0, 1]."""
    for name, value in thresholds.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
            raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")


def saturation_point(elem: formats.Format) -> float:
    """``max`` plus half an ulp: beyond it a value's nearest representable number would exceed the max."""
    return elem.max + 2.0 ** (math.floor(math.log2(elem.max)) - elem.mantissa_bits - 1)


def capture_linears(
    model: nn.Module, inputs: Any, loss_fn: LossFn, api: str = "lowbit_report"
) -> dict[str, dict[str, Any]]:
    """One forward and backward of ``loss_fn(model, inputs)``; per ``nn.Linear`` reached, by qualified
    name, in model order: ``{"module", "x" (M, in) float32, "w" (out, in) float32, "go" (M, out) float32
    if a gradient came}``.

    A layer called twice is captured at its first call. The model is handed back as it was (hooks removed;
    parameters, buffers, grads, modes, torch's RNG and the stochastic-rounding generators of its
    :class:`~mixprec.lowbit.LowbitLinear` modules).

    Raises:
        ValueError: for a model without ``nn.Linear`` or a loss that is not a one-element tensor with grad.
    """
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ValueError("model has no nn.Linear layer to report on")
    seen: dict[str, dict[str, Any]] = {name: {} for name, _ in linears}
    sr_state = sr_state_dict(model)  # the converted layers' rounding draws, given or their own
    try:
        with preserved(model, inputs) as handles:
            for name, module in linears:
                handles.add(module.register_forward_hook(_capture(name, seen, handles)))
            with torch.enable_grad():
                call_loss(loss_fn, model, inputs, api).backward()
    finally:
        load_sr_state_dict(model, sr_state)
    return {name: t for name, t in seen.items() if "x" in t}


def _capture(name: str, seen: dict, handles: Any) -> Callable[..., None]:
    def hook(module: nn.Linear, args: tuple, output: torch.Tensor) -> None:
        if "x" in seen[name]:  # a layer called twice is reported at its first call
            return
        seen[name]["module"] = module
        seen[name]["x"] = args[0].detach().reshape(-1, args[0].shape[-1]).to(torch.float32)
        seen[name]["w"] = module.weight.detach().to(torch.float32)
        if output.requires_grad:

            def grad_hook(g: torch.Tensor) -> None:  # returns None: the gradient flows on unchanged
                seen[name].setdefault("go", g.detach().reshape(-1, g.shape[-1]).float())

            handles.add(output.register_hook(grad_hook))

    return hook


def operand_stats(
    t: dict[str, torch.Tensor], recipe: Recipe, outlier_ratio: float
) -> dict[str, LowbitOperandStats]:
    """Per GEMM operand that ``recipe`` quantizes, its statistics, from one layer's captured ``{"x", "w",
    "go"}`` (float32, 2-D; without ``"go"`` only the forward operands): what the planner rules formats on."""
    go = t.get("go", torch.zeros(t["x"].shape[0], t["w"].shape[0]))
    ops = gemm_operands(t["x"], t["w"], go, recipe)
    wanted = [op for op in OPERANDS if ops[op][1] != HP and ("go" in t or op.startswith("fprop"))]
    return {op: LowbitOperandStats.measure(ops[op][0], ops[op][1], outlier_ratio) for op in wanted}
