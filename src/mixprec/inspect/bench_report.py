"""`mixprec report` on the bench's files: pictures and a table from ``--json`` records or the ``--log``.

The drawing itself is :mod:`mixprec.bench.plots` (loss against fp32, step times with their spread).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mixprec.bench.plots import plot_loss_difference, plot_step_times, speedup_text
from mixprec.inspect.plots import group_runs, plot_scale_history


def plot_bench_records(records: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """``step_time.png`` from ``mixprec bench --json`` records: a box of per-round medians per mode."""
    samples: dict[str, dict[str, list[float]]] = {}
    for record in records:
        times = record.get("round_medians_ms") or [record["step_time_ms"]]
        samples.setdefault(record["workload"], {})[record["mode"]] = [t for t in times if t is not None]
    notes = {(r["workload"], r["mode"]): speedup_text(r) for r in records}
    return plot_step_times(samples, path, notes=notes, what="median step time of each round")


def _cell(value: Any, spec: str) -> str:
    return "-" if value is None else f"{value:{spec}}"


def _ms(value: float | None) -> str:
    """Milliseconds to a sensible precision: 5408, 25.5, 1.57."""
    if value is None:
        return "-"
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def bench_summary(records: Sequence[Mapping[str, Any]], name: str, images: Sequence[Path]) -> str:
    """Markdown: one row per run of ``mixprec bench --json``, the NOISY ones named, the images."""
    lines = [
        f"# mixprec bench report ({name})",
        "",
        "| workload | mode | step ms | IQR ms | speedup [90% CI] | peak MiB | loss | metric | skipped |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        iqr = f"{_ms(r.get('step_time_q25_ms'))}-{_ms(r.get('step_time_q75_ms'))}"
        cells = [
            r["workload"],
            r["mode"],
            _ms(r["step_time_ms"]),
            iqr,
            speedup_text(r) or "-",
            _cell(r.get("peak_memory_mb"), ".1f"),
            _cell(r.get("final_loss"), ".4f"),
            _cell(r.get("final_metric"), ".4g"),
            str(r.get("skipped_steps", "-")),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    noisy = [f"{r['workload']}/{r['mode']}" for r in records if r.get("noisy")]
    if noisy:
        lines += [
            "",
            f"NOISY (timings spread too widely to trust; rerun on a quieter machine): {', '.join(noisy)}.",
        ]
    lines += ["", *(f"![{image.stem}]({image.name})" for image in images)]
    return "\n".join(lines) + "\n"


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
