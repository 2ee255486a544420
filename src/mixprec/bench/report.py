"""Present bench results: the comparison table, JSON records, the per-step JSONL log and PNG plots."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from mixprec.bench.memory import DESCRIPTIONS
from mixprec.bench.workloads import WORKLOADS

RECORD_KEYS = (
    "workload",
    "mode",
    "device",
    "dtype",
    "steps",
    "step_time_ms",
    "speedup_vs_fp32",
    "peak_memory_mb",
    "final_loss",
    "final_metric",
    "skipped_steps",
    "final_scale",
)
LOG_KEYS = ("step", "workload", "mode", "loss", "scale", "skipped", "step_time_ms")
LOSS_MEANING = {
    "lm": "validation cross-entropy per character",
    "cnn": "test cross-entropy",
    "seed-loop": "validation MSE (standardised target)",
}
_COLUMNS = (
    ("workload", "<"),
    ("mode", "<"),
    ("step ms", ">"),
    ("speedup", ">"),
    ("peak MiB", ">"),
    ("loss", ">"),
    ("metric", ">"),
    ("skipped", ">"),
    ("scale", ">"),
)


def _finite(value: float | None) -> float | None:
    """JSON has no NaN/inf: non-finite numbers (a diverged run) become null."""
    return value if value is None or math.isfinite(value) else None


def make_records(results: Sequence[Any]) -> list[dict[str, Any]]:
    """One record per run with exactly ``RECORD_KEYS``; speedup is fp32 step time / this step time."""
    fp32 = {r.workload: r.step_time_ms for r in results if r.mode == "fp32"}
    records = []
    for r in results:
        base = fp32.get(r.workload)
        values = {
            "workload": r.workload,
            "mode": r.mode,
            "device": r.device,
            "dtype": r.dtype,
            "steps": r.steps,
            "step_time_ms": r.step_time_ms,
            "speedup_vs_fp32": None if base is None else base / r.step_time_ms,
            "peak_memory_mb": r.peak_memory_mb,
            "final_loss": _finite(r.final_loss),
            "final_metric": _finite(r.final_metric),
            "skipped_steps": r.skipped_steps,
            "final_scale": r.final_scale,
        }
        records.append({key: values[key] for key in RECORD_KEYS})
    return records


def _number(value: float | None, spec: str, suffix: str = "") -> str:
    if value is None:
        return "-"
    return "nan" if not math.isfinite(value) else f"{value:{spec}}{suffix}"


def _row(record: dict[str, Any]) -> list[str]:
    metric = WORKLOADS[record["workload"]].metric
    metric_spec = ".2%" if metric == "accuracy" else ".3f"
    return [
        record["workload"],
        record["mode"],
        _number(record["step_time_ms"], ".1f"),
        _number(record["speedup_vs_fp32"], ".2f", "x"),
        _number(record["peak_memory_mb"], ".1f"),
        _number(record["final_loss"], ".4f"),
        f"{metric} {_number(record['final_metric'], metric_spec)}",
        str(record["skipped_steps"]),
        _number(record["final_scale"], ".0f"),
    ]


def format_table(results: Sequence[Any], notes: Iterable[str] = (), header: str = "") -> str:
    """The comparison table with a footer saying what each column measures."""
    rows = [[name for name, _ in _COLUMNS]] + [_row(r) for r in make_records(results)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    lines = [header] if header else []
    for index, row in enumerate(rows):
        cells = [
            f"{cell:{align}{width}}" for cell, (_, align), width in zip(row, _COLUMNS, widths, strict=True)
        ]
        lines.append("  ".join(cells).rstrip())
        if index == 0:
            lines.append("  ".join("-" * width for width in widths))
    lines += ["", *footer(results), *(f"note: {note}" for note in notes)]
    return "\n".join(lines)


def footer(results: Sequence[Any]) -> list[str]:
    if not results:
        return []
    warmups = sorted({r.warmup for r in results})
    methods = sorted({r.memory_method for r in results})
    lines = [
        f"step ms: median wall time of a training step after {'/'.join(map(str, warmups))} warm-up step(s): "
        "batch fetch and transfer, forward, loss, backward, loss scaling, optimizer and scheduler step",
        "speedup: fp32 step time / this step time (same workload, same process setup)",
        "peak MiB: " + "; ".join(DESCRIPTIONS[m] for m in methods),
        "scale: final loss scale ('-': the mode does not scale the loss); "
        "skipped: optimizer steps skipped on inf/nan gradients",
    ]
    for name in dict.fromkeys(r.workload for r in results):
        spec = WORKLOADS[name]
        better = "higher" if spec.metric_higher_is_better else "lower"
        source = next(r.data_source for r in results if r.workload == name)
        lines.append(
            f"{name}: {source}; loss = {LOSS_MEANING[name]}; "
            f"{spec.metric} on held-out data ({better} is better)"
        )
    return lines


def write_json(results: Sequence[Any], path: str | Path) -> None:
    """A JSON list with one record per run (keys ``RECORD_KEYS``)."""
    Path(path).write_text(json.dumps(make_records(results), indent=2, allow_nan=False) + "\n")


def write_log(results: Sequence[Any], path: str | Path) -> None:
    """JSON Lines, one object per training step with keys ``LOG_KEYS`` (the input of ``mixprec report``)."""
    with Path(path).open("w") as handle:
        for r in results:
            for entry in r.history:
                record = {"workload": r.workload, "mode": r.mode, **entry}
                record["loss"] = _finite(record["loss"])
                handle.write(json.dumps({key: record[key] for key in LOG_KEYS}, allow_nan=False) + "\n")


def write_plots(results: Sequence[Any], directory: str | Path) -> list[Path]:
    """``loss_<workload>.png`` (training loss per step, one line per mode) and ``step_time.png``."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise RuntimeError("--plot needs matplotlib: pip install 'mixprec[plot]'") from exc
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    workloads = list(dict.fromkeys(r.workload for r in results))
    written = []
    for name in workloads:
        figure = Figure(figsize=(7, 4.5))
        axes = figure.add_subplot()
        for r in (r for r in results if r.workload == name):
            losses = torch.tensor([float("nan") if h["loss"] is None else h["loss"] for h in r.history])
            axes.plot(range(len(losses)), _smooth(losses), label=r.mode, linewidth=1.2)
        axes.set(title=f"{name}: training loss", xlabel="step", ylabel="loss (EMA 0.9)")
        axes.grid(alpha=0.3)
        axes.legend()
        written.append(_save(FigureCanvasAgg, figure, directory / f"loss_{name}.png"))

    figure = Figure(figsize=(4 * len(workloads), 4.5))
    for index, name in enumerate(workloads, 1):
        axes = figure.add_subplot(1, len(workloads), index)
        rows = [r for r in results if r.workload == name]
        axes.bar([r.mode for r in rows], [r.step_time_ms for r in rows], color="tab:blue")
        axes.set(title=name, ylabel="median step time (ms)")
        axes.tick_params(axis="x", labelrotation=45)
        axes.grid(axis="y", alpha=0.3)
    figure.tight_layout()
    written.append(_save(FigureCanvasAgg, figure, directory / "step_time.png"))
    return written


def _smooth(values: torch.Tensor, decay: float = 0.9) -> list[float]:
    out, running = [], None
    for value in values.tolist():
        if math.isfinite(value):
            running = value if running is None else decay * running + (1 - decay) * value
        out.append(float("nan") if running is None else running)
    return out


def _save(canvas_cls: Any, figure: Any, path: Path) -> Path:
    if not figure.get_tight_layout():
        figure.tight_layout()
    canvas_cls(figure).print_png(str(path))
    return path
