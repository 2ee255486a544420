"""The bench's pictures (PNG, matplotlib's object API, no pyplot): loss against fp32, step time with spread.

* :func:`plot_loss_difference`: per workload, the smoothed training loss of every mode (top) and its
  difference from the fp32 run's (bottom), where modes that lie on top of each other in the top panel
  separate;
* :func:`plot_step_times`: per workload, a box per mode of its step times (median, 25th-75th percentile,
  5th-95th whiskers) with the speedup over fp32 written beside it.

Both read plain data (per-step records, lists of times), so ``mixprec report`` draws the same pictures
from ``mixprec bench --log`` and ``--json`` files (:func:`plot_bench_log`, :func:`plot_bench_records`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mixprec._plots import new_figure, save_png
from mixprec.inspect.plots import group_runs, plot_scale_history

__all__ = [
    "plot_bench_log",
    "plot_bench_records",
    "plot_loss_difference",
    "plot_step_times",
    "smooth",
    "write_plots",
]


def smooth(values: Sequence[float | None], window: int) -> list[float]:
    """Exponential moving average with decay ``1 - 1/window``; None/NaN/inf entries are skipped (carried)."""
    decay = 1.0 - 1.0 / max(1, window)
    out: list[float] = []
    running: float | None = None
    for value in values:
        if value is not None and math.isfinite(value):
            running = value if running is None else decay * running + (1 - decay) * value
        out.append(math.nan if running is None else running)
    return out


def plot_loss_difference(
    runs: Mapping[str, Sequence[float | None]],
    path: str | Path,
    *,
    reference: str = "fp32",
    title: str = "training loss",
    labels: Mapping[str, str] | None = None,
) -> Path:
    """Two panels: each run's smoothed per-step loss, and its difference from ``reference``'s.

    Args:
        runs: ``{mode: per-step training loss}`` of one workload (None: a non-finite loss).
        path: the PNG to write.
        reference: the run the bottom panel subtracts; without it, only the top panel is drawn.
        title: the figure title.
        labels: legend text per mode (default: the mode).

    Returns:
        The path written.
    """
    labels = labels or {}
    steps = max((len(v) for v in runs.values()), default=0)
    window = max(3, steps // 25)
    smoothed = {mode: smooth(values, window) for mode, values in runs.items()}
    has_reference = reference in smoothed
    figure = new_figure(figsize=(8, 6.5 if has_reference else 4.2))
    top = figure.add_subplot(2 if has_reference else 1, 1, 1)
    colors = {mode: f"C{index % 10}" for index, mode in enumerate(smoothed)}
    for mode, values in smoothed.items():
        top.plot(range(len(values)), values, label=labels.get(mode, mode), color=colors[mode], linewidth=1.3)
    top.set(title=title, ylabel=f"loss (moving average, {window} steps)")
    top.grid(alpha=0.3)
    top.legend(fontsize=8)
    if has_reference:
        base = smoothed[reference]
        bottom = figure.add_subplot(2, 1, 2, sharex=top)
        for mode, values in smoothed.items():
            diff = [a - b for a, b in zip(values, base, strict=False)]
            width = 0.8 if mode == reference else 1.3
            bottom.plot(range(len(diff)), diff, label=mode, color=colors[mode], linewidth=width)
        bottom.set(
            title=f"difference from {reference} (above 0: higher loss than {reference})",
            ylabel=f"loss - {reference} loss",
        )
        bottom.grid(alpha=0.3)
        bottom.legend(fontsize=8, ncol=2)
    figure.axes[-1].set_xlabel("training step")
    return save_png(figure, path)


def plot_step_times(
    samples: Mapping[str, Mapping[str, Sequence[float]]],
    path: str | Path,
    *,
    notes: Mapping[tuple[str, str], str] | None = None,
    what: str = "step times after warm-up",
) -> Path:
    """One panel per workload, one horizontal box per mode (median, IQR box, 5th-95th whiskers), in ms.

    Args:
        samples: ``{workload: {mode: step times in ms}}``.
        path: the PNG to write.
        notes: text drawn right of a box, e.g. ``{("lm", "O2-bf16"): "2.04x [1.98-2.10]"}``.
        what: what the samples are, for the axis label.

    Returns:
        The path written.
    """
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    notes = notes or {}
    names = list(samples)
    rows = max((len(m) for m in samples.values()), default=1)
    figure = new_figure(figsize=(5.2 * len(names), 0.45 * rows + 2.4))
    for index, workload in enumerate(names, 1):
        axes = figure.add_subplot(1, len(names), index)
        modes = [mode for mode, times in samples[workload].items() if times]
        data = [samples[workload][mode] for mode in modes]
        _boxes(axes, data)
        axes.set_yticks(range(1, len(modes) + 1), modes, fontsize=8)
        axes.invert_yaxis()
        right = max(_percentile95(times) for times in data) if data else 1.0  # the whiskers' reach
        for row, mode in enumerate(modes, 1):
            text = notes.get((workload, mode))
            if text:
                axes.annotate(text, (1.01, row), xycoords=("axes fraction", "data"), va="center", fontsize=8)
        axes.set_xlim(left=0, right=right * 1.05)
        axes.set(title=f"{workload}: step time", xlabel=f"ms ({what})")
        axes.grid(axis="x", alpha=0.3)
    legend = [
        Line2D([], [], color="tab:orange", label="median"),
        Patch(facecolor="white", edgecolor="black", label="25th-75th percentile"),
        Line2D([], [], color="black", label="whiskers: 5th-95th"),
    ]
    figure.legend(handles=legend, loc="lower center", ncol=3, fontsize=8)
    shown = any(notes.values())
    figure.suptitle(
        "step time per mode" + (" (right: speedup over fp32 [90% CI])" if shown else ""), fontsize=10
    )
    return save_png(figure, path, rect=(0, 0.07, 0.93, 0.97))


def _percentile95(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)] if ordered else 1.0


def _boxes(axes: Any, data: list[Sequence[float]]) -> None:
    try:  # matplotlib >= 3.10
        axes.boxplot(data, orientation="horizontal", whis=(5, 95), showfliers=False, widths=0.6)
    except TypeError:
        axes.boxplot(data, vert=False, whis=(5, 95), showfliers=False, widths=0.6)


def speedup_text(record: Mapping[str, Any]) -> str:
    """``"2.04x [1.98-2.10]"`` from a bench JSON record, ``""`` without a speedup."""
    speedup = record.get("speedup_vs_fp32")
    if speedup is None:
        return ""
    text = f"{speedup:.2f}x"
    if record.get("speedup_low") is not None:
        text += f" [{record['speedup_low']:.2f}-{record['speedup_high']:.2f}]"
    return text + (" NOISY" if record.get("noisy") else "")


def write_plots(
    results: Sequence[Any], records: Sequence[Mapping[str, Any]], directory: str | Path
) -> list[Path]:
    """``loss_<workload>.png`` per workload and ``step_time.png`` from bench results and their records."""
    directory = Path(directory)
    written = []
    workloads = list(dict.fromkeys(r.workload for r in results))
    for name in workloads:
        runs = {r.mode: [h["loss"] for h in r.history] for r in results if r.workload == name}
        labels = {
            r.mode: f"{r.mode} (held-out loss {r.final_loss:.4f})" for r in results if r.workload == name
        }
        written.append(
            plot_loss_difference(
                runs, directory / f"loss_{name}.png", title=f"{name}: training loss per mode", labels=labels
            )
        )
    samples = {
        name: {
            r.mode: [h["step_time_ms"] for h in r.history[r.warmup :]] for r in results if r.workload == name
        }
        for name in workloads
    }
    notes = {(rec["workload"], rec["mode"]): speedup_text(rec) for rec in records}
    written.append(plot_step_times(samples, directory / "step_time.png", notes=notes))
    return written


def plot_bench_records(records: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """``step_time.png`` from ``mixprec bench --json`` records: a box of per-round medians per mode."""
    samples: dict[str, dict[str, list[float]]] = {}
    for record in records:
        times = record.get("round_medians_ms") or [record["step_time_ms"]]
        samples.setdefault(record["workload"], {})[record["mode"]] = [t for t in times if t is not None]
    notes = {(r["workload"], r["mode"]): speedup_text(r) for r in records}
    return plot_step_times(samples, path, notes=notes, what="median step time of each round")


def plot_bench_log(records: Sequence[Mapping[str, Any]], out_dir: Path, name: str) -> list[Path]:
    """From a ``mixprec bench --log``: ``loss_<workload>.png`` against fp32, ``step_time.png`` (steps after
    the first round, which holds the warm-up) and ``scale_history.png`` of the runs that scale the loss."""
    by_workload: dict[str, dict[str, list[Mapping[str, Any]]]] = {}
    for label, run in group_runs(records).items():
        workload, _, mode = label.partition(" / ")
        by_workload.setdefault(workload, {})[mode or workload] = run
    images = []
    for workload, runs in by_workload.items():
        losses = {mode: [r.get("loss") for r in run] for mode, run in runs.items()}
        path = out_dir / f"loss_{workload}.png"
        images.append(plot_loss_difference(losses, path, title=f"{name}: {workload} training loss per mode"))
    samples = {
        workload: {
            mode: [
                r["step_time_ms"] for r in run if r.get("round", 1) != 0 and r.get("step_time_ms") is not None
            ]
            for mode, run in runs.items()
        }
        for workload, runs in by_workload.items()
    }
    images.append(plot_step_times(samples, out_dir / "step_time.png", what="steps after the first round"))
    scaled = [r for r in records if r.get("scale") is not None]
    if scaled:
        title = f"{name}: loss scale of the runs that scale the loss"
        images.append(
            plot_scale_history(scaled, out_dir / "scale_history.png", title=title, panels=("scale",))
        )
    return images
