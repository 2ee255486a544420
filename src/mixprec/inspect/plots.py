"""Pictures of where precision is lost (PNG, matplotlib's Agg backend; ``pip install 'mixprec[plot]'``).

* :func:`plot_gradient_histogram`: log2|gradient| with the fp16 / bf16 / fp8 ranges at the current scale;
* :func:`plot_scale_history`: the loss scale over steps with skipped steps marked (and loss, grad amax);
* :func:`plot_underflow`: per-module bars of flushed / subnormal / already-zero gradients.

matplotlib is imported when a plot is drawn, never at import time (:mod:`mixprec._plots`, shared with the
bench's pictures).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePath
from typing import Any

from mixprec import formats
from mixprec._plots import new_figure, save_png
from mixprec.inspect._modules import display_name
from mixprec.inspect.summaries import Log2Histogram
from mixprec.inspect.underflow_report import UnderflowReport, format_scale

__all__ = ["plot_gradient_histogram", "plot_scale_history", "plot_underflow"]

DEFAULT_FORMATS = ("fp16", "bf16", "fp8_e5m2", "fp8_e4m3fn")
_COLORS = {"fp16": "tab:blue", "bf16": "tab:green", "fp8_e5m2": "tab:purple", "fp8_e4m3fn": "tab:red"}


def _histograms(source: Any) -> dict[str, Log2Histogram]:
    if isinstance(source, UnderflowReport):
        return {
            "activation gradients": source.activation_histogram,
            "parameter gradients": source.parameter_histogram,
        }
    if isinstance(source, Log2Histogram):
        return {"gradients": source}
    if isinstance(source, Mapping) and all(isinstance(h, Log2Histogram) for h in source.values()):
        return dict(source)
    raise TypeError(
        f"source must be an UnderflowReport, a Log2Histogram or a dict of them, got {type(source).__name__}"
    )


def plot_gradient_histogram(
    source: UnderflowReport | Log2Histogram | Mapping[str, Log2Histogram],
    path: str | Path,
    *,
    scale: float | None = None,
    formats_shown: Sequence[str] = DEFAULT_FORMATS,
    title: str | None = None,
) -> Path:
    """Histogram of log2|g| (unscaled) under the ranges each format holds for ``g * scale``.

    Args:
        source: an :class:`UnderflowReport` (its activation and parameter gradients), a
            :class:`Log2Histogram`, or ``{label: Log2Histogram}``.
        path: the PNG to write.
        scale: the loss scale; default: the report's, else 1.
        formats_shown: format names to draw ranges for.
        title: the figure title.

    Returns:
        The path written.
    """
    histograms = _histograms(source)
    scale = scale if scale is not None else (source.scale if isinstance(source, UnderflowReport) else 1.0)
    shift = math.log2(scale)
    shown = [formats.get(name) for name in formats_shown]
    figure = new_figure(figsize=(9, 5.5))
    grid = figure.add_gridspec(2, 1, height_ratios=(3, 0.35 * len(shown) + 0.4))
    axes, ruler = figure.add_subplot(grid[0]), figure.add_subplot(grid[1])
    low, high = 0.0, 1.0
    for label, histogram in histograms.items():
        exponents, counts = histogram.bins()
        if not exponents:
            continue
        total = histogram.total
        axes.stairs(
            [c / total for c in counts], [*exponents, exponents[-1] + 1], fill=True, alpha=0.45, label=label
        )
        low, high = min(low, exponents[0]), max(high, exponents[-1] + 1)
        zeros = histogram.zeros / total if total else 0.0
        axes.plot([], [], " ", label=f"  exactly 0 in fp32: {zeros:.1%}")
    fp16 = formats.FP16
    flush = math.log2(fp16.smallest_subnormal / 2) - shift
    axes.axvline(flush, color="black", linestyle="--", linewidth=1, label="fp16 flushes to 0 left of this")
    axes.set(
        ylabel="fraction of values",
        title=title or f"log2|gradient| against format ranges at loss scale {format_scale(scale)}",
    )
    axes.legend(fontsize=8, loc="best")
    axes.grid(alpha=0.3)
    _draw_ruler(ruler, shown, shift)
    left = min(low, math.log2(fp16.smallest_subnormal) - shift) - 2
    right = max(high, math.log2(fp16.max) - shift) + 2
    for ax in (axes, ruler):
        ax.set_xlim(left, right)
    return save_png(figure, path)


def _draw_ruler(axes: Any, shown: Sequence[formats.Format], shift: float) -> None:
    """One row per format: its subnormal (pale) and normal range, in unscaled log2|g| at this scale."""
    for row, fmt in enumerate(shown):
        sub, normal, top = (
            math.log2(v) - shift for v in (fmt.smallest_subnormal, fmt.smallest_normal, fmt.max)
        )
        color = _COLORS.get(fmt.name, "tab:gray")
        axes.broken_barh([(sub, normal - sub)], (row - 0.35, 0.7), color=color, alpha=0.35)
        axes.broken_barh([(normal, top - normal)], (row - 0.35, 0.7), color=color, alpha=0.85)
    axes.set_yticks(range(len(shown)), [f.name for f in shown])
    axes.set_xlabel(f"log2|g| (unscaled); ranges shifted left by log2(scale) = {shift:g}; pale: subnormal")


def plot_scale_history(
    records: Sequence[Mapping[str, Any]],
    path: str | Path,
    *,
    title: str | None = None,
    panels: Sequence[str] = ("scale", "loss", "grad_amax"),
) -> Path:
    """The loss scale over steps (log2 axis) with skipped steps marked; loss and grad amax when logged.

    Args:
        records: per-step records as :class:`ScalerLog` or ``mixprec bench --log`` write them; records
            with ``workload``/``mode`` keys are drawn as one line per run.
        path: the PNG to write.
        title: the figure title.
        panels: which of ``scale``, ``loss``, ``grad_amax`` to draw (the latter two when logged).

    Returns:
        The path written.
    """
    if isinstance(records, (str, PurePath)):  # a log's path: say how to read it
        raise TypeError(
            f"records must be a sequence of per-step dicts, got the path {str(records)!r}: read a log with "
            "mixprec.inspect.load_log(path) first"
        )
    if isinstance(records, (bytes, Mapping)) or not isinstance(records, Sequence):
        raise TypeError(f"records must be a sequence of per-step dicts, got {type(records).__name__}")
    for i, record in enumerate(records):
        if not isinstance(record, Mapping) or "step" not in record or "scale" not in record:
            raise ValueError(f"records[{i}] must be a dict with 'step' and 'scale' keys, got {record!r}")
    runs = group_runs(records)
    panels = ["scale"] + [key for key in ("loss", "grad_amax") if key in panels and _any_value(runs, key)]
    figure = new_figure(figsize=(9, 2.4 * len(panels) + 0.6))
    first = None
    for index, key in enumerate(panels, 1):
        axes = figure.add_subplot(len(panels), 1, index, sharex=first)
        first = first or axes
        if key == "scale":
            _draw_scale(axes, runs)
        else:
            for label, run in runs.items():
                axes.plot(*_series(run, key), label=label, linewidth=1.2)
            axes.set_ylabel(key)
            if key == "grad_amax":
                axes.set_yscale("log", base=2)
            axes.legend(fontsize=8, ncol=1 + len(runs) // 6)
        axes.grid(alpha=0.3)
    assert first is not None  # the loop above ran at least once
    first.set_title(title or "loss scale over training steps")
    figure.axes[-1].set_xlabel("step")
    return save_png(figure, path)


def group_runs(records: Sequence[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    """Records by run: ``"workload / mode"`` for bench logs, ``"run"`` otherwise (each sorted by step)."""
    runs: dict[str, list[Mapping[str, Any]]] = {}
    for record in records:
        parts = [str(record[k]) for k in ("workload", "mode") if record.get(k) is not None]
        runs.setdefault(" / ".join(parts) or "run", []).append(record)
    return {label: sorted(run, key=lambda r: r["step"]) for label, run in runs.items()}


def _any_value(runs: Mapping[str, list[Mapping[str, Any]]], key: str) -> bool:
    return any(r.get(key) is not None for run in runs.values() for r in run)


def _series(run: Sequence[Mapping[str, Any]], key: str) -> tuple[list[float], list[float]]:
    values = [math.nan if r.get(key) is None else float(r[key]) for r in run]
    return [r["step"] for r in run], values


def _draw_scale(axes: Any, runs: Mapping[str, list[Mapping[str, Any]]]) -> None:
    if not _any_value(runs, "scale"):
        axes.text(
            0.5, 0.5, "no loss scale in this log (unscaled runs)", ha="center", transform=axes.transAxes
        )
        axes.set_ylabel("loss scale")
        return
    marked = False
    for label, run in runs.items():
        steps, scales = _series(run, "scale")
        if all(math.isnan(s) for s in scales):
            continue
        axes.step(steps, scales, where="post", label=label, linewidth=1.3)
        skipped = [(s, v) for s, v, r in zip(steps, scales, run, strict=True) if r.get("skipped")]
        if skipped:
            xs, ys = zip(*skipped, strict=True)
            axes.scatter(xs, ys, marker="x", color="red", zorder=3, label=None if marked else "skipped step")
            marked = True
    axes.set_yscale("log", base=2)
    axes.set_ylabel("loss scale")
    axes.legend(fontsize=8, ncol=1 + len(runs) // 6)


def plot_underflow(reports: UnderflowReport | Sequence[UnderflowReport], path: str | Path) -> Path:
    """Per-module bars: fraction of gradients flushed to zero, subnormal, and already zero in fp32.

    Args:
        reports: one :class:`UnderflowReport`, or several (e.g. at scale 1 and 2^16) drawn side by side.
        path: the PNG to write.

    Returns:
        The path written.
    """
    reports = [reports] if isinstance(reports, UnderflowReport) else list(reports)
    if not reports or not all(isinstance(r, UnderflowReport) for r in reports):
        raise TypeError(
            "reports must be one UnderflowReport or a non-empty sequence of them, "
            f"got {type(reports).__name__}"
        )
    rows = max(len(r.activations) + len(r.parameters) for r in reports) + 4
    figure = new_figure(figsize=(5.5 * len(reports), 0.22 * rows + 2.5))
    for column, report in enumerate(reports):
        for row, (kind, stats) in enumerate(
            (("activation", report.activations), ("parameter", report.parameters))
        ):
            axes = figure.add_subplot(2, len(reports), row * len(reports) + column + 1)
            overall = report.overall_activations if kind == "activation" else report.overall_parameters
            _draw_bars(axes, {**{display_name(n): s for n, s in stats.items()}, "overall": overall})
            axes.set_title(
                f"{kind} gradients, {report.format.name} at scale {format_scale(report.scale)}: "
                f"{overall.underflow:.1%} underflow",
                fontsize=9,
            )
    handles, labels = figure.axes[0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="upper center", ncol=len(labels), fontsize=9)
    return save_png(figure, path, rect=(0, 0, 1, 1 - 0.45 / figure.get_figheight()))


def _draw_bars(axes: Any, stats: Mapping[str, Any]) -> None:
    names = list(stats)
    positions = list(range(len(names)))
    left = [0.0] * len(names)
    segments = (
        ("flushed to 0", "flushed_fraction", "tab:red"),
        ("subnormal", "subnormal_fraction", "tab:orange"),
        ("already 0 in fp32", "already_zero_fraction", "lightgray"),
    )
    for label, attribute, color in segments:
        widths = [getattr(s, attribute) for s in stats.values()]
        axes.barh(positions, widths, left=left, color=color, label=label)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    axes.set_yticks(positions, names, fontsize=8)
    axes.invert_yaxis()
    axes.set_xlim(0, 1)
    axes.set_xlabel("fraction of values")
    axes.grid(axis="x", alpha=0.3)
