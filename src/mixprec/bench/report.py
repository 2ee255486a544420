"""Present bench results: the comparison table, JSON records, the per-step JSONL log, and the Markdown
table ``mixprec report`` writes from the records (plots: plots.py). Every time prints by one rule, ``_ms``."""

from __future__ import annotations

import json
import math
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from mixprec._files import jsonl_text, write_atomic
from mixprec.bench.advice import recommend
from mixprec.bench.memory import COMPONENTS, DESCRIPTIONS
from mixprec.bench.stats import AA_LABEL, NOISY_ADVICE, NOISY_IQR, NOISY_WIDTH, round_medians, timings
from mixprec.bench.workloads import WORKLOADS

#: The keys of every result record :func:`make_records` builds, in order.
RECORD_KEYS = (
    "workload",
    "mode",
    "device",
    "threads",
    "dtype",
    "compiled",
    "steps",
    "rounds",
    "step_time_ms",
    "step_time_q25_ms",
    "step_time_q75_ms",
    "speedup_vs_fp32",
    "speedup_low",
    "speedup_high",
    "noisy",
    "peak_memory_mb",
    "weights_bytes",
    "gradients_bytes",
    "optimizer_state_bytes",
    "activations_bytes",
    "final_loss",
    "final_metric",
    "skipped_steps",
    "final_scale",
    "round_medians_ms",
    "runs_planned",
)
LOG_KEYS = ("step", "round", "workload", "mode", "loss", "scale", "skipped", "step_time_ms")
WIDTH = 100  # the table, its footnotes and notes fit a terminal this wide
_COLUMNS = (
    ("mode", "<"),
    ("step ms", ">"),
    ("IQR ms", ">"),
    ("speedup [90% CI]", ">"),
    ("MiB", ">"),
    ("loss", ">"),
    ("metric", ">"),
    ("skip", ">"),
    ("scale", ">"),
    ("noisy", "<"),
)


def _finite(value: float | None) -> float | None:
    """JSON has no NaN/inf: non-finite numbers (a diverged run) become null."""
    return value if value is None or math.isfinite(value) else None


def make_records(results: Sequence[Any], runs_planned: int | None = None) -> list[dict[str, Any]]:
    """One record per run with exactly ``RECORD_KEYS`` (times in ms; see ``mixprec.bench.stats``).

    ``runs_planned`` (default: ``len(results)``) is how many runs the bench set out to do, so that a
    reader of an interrupted run's file can say that it is incomplete.
    """
    records = []
    planned = len(results) if runs_planned is None else runs_planned
    for r, t in zip(results, timings(results), strict=True):
        rounds = round_medians(r.history, r.warmup)
        values = {
            "workload": r.workload,
            "mode": r.mode,
            "device": r.device,
            "threads": r.threads,
            "dtype": r.dtype,
            "compiled": bool(getattr(r, "compiled", False)),  # results from before --compile have none
            "steps": r.steps,
            "rounds": t.rounds,
            "step_time_ms": _finite(t.median_ms),
            "step_time_q25_ms": _finite(t.q25_ms),
            "step_time_q75_ms": _finite(t.q75_ms),
            "speedup_vs_fp32": t.speedup,
            "speedup_low": t.speedup_low,
            "speedup_high": t.speedup_high,
            "noisy": t.noisy,
            "peak_memory_mb": r.peak_memory_mb,
            # results made before the components were measured (or stand-ins for them) have none
            **{f"{c}_bytes": (getattr(r, "memory_bytes", None) or {}).get(c) for c in COMPONENTS},
            "final_loss": _finite(r.final_loss),
            "final_metric": _finite(r.final_metric),
            "skipped_steps": r.skipped_steps,
            "final_scale": r.final_scale,
            "round_medians_ms": [round(rounds[k], 4) for k in sorted(rounds)],
            "runs_planned": planned,
        }
        records.append({key: values[key] for key in RECORD_KEYS})
    return records


def _number(value: float | None, spec: str, suffix: str = "") -> str:
    if value is None:
        return "-"
    return "nan" if not math.isfinite(value) else f"{value:{spec}}{suffix}"


def _ms(value: float | None) -> str:
    """Milliseconds to about four digits: 5408, 311.5, 15.0, 1.03."""
    if value is None or not math.isfinite(value):
        return "-" if value is None else "nan"
    return f"{value:.0f}" if value >= 1000 else f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def _speedup(record: dict[str, Any]) -> str:
    speedup = _number(record["speedup_vs_fp32"], ".2f", "x")
    if record["speedup_low"] is None:
        return speedup
    return f"{speedup} [{record['speedup_low']:.2f}-{record['speedup_high']:.2f}]"


def _row(record: dict[str, Any]) -> list[str]:
    metric = WORKLOADS[record["workload"]].metric
    metric_spec = ".2%" if metric == "accuracy" else ".3f"
    return [
        record["mode"],
        _ms(record["step_time_ms"]),
        f"{_ms(record['step_time_q25_ms'])}-{_ms(record['step_time_q75_ms'])}",
        _speedup(record),
        _number(record["peak_memory_mb"], ".1f"),
        _number(record["final_loss"], ".4f"),
        _number(record["final_metric"], metric_spec),
        "-" if record["skipped_steps"] is None else str(record["skipped_steps"]),
        _number(record["final_scale"], ".0f"),
        "NOISY" if record["noisy"] else "",
    ]


def _layout(rows: list[list[str]]) -> list[str]:
    """Aligned lines, two spaces between columns (one where two would pass ``WIDTH``)."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    gap = "  " if sum(widths) + 2 * (len(widths) - 1) <= WIDTH else " "
    lines = []
    for index, row in enumerate(rows):
        cells = [f"{cell:{a}{w}}" for cell, (_, a), w in zip(row, _COLUMNS, widths, strict=True)]
        lines.append(gap.join(cells).rstrip())
        if index == 0:
            lines.append(gap.join("-" * width for width in widths).rstrip())
    return lines


_MEMORY_HEAD = ("mode", "weights", "grads", "opt state", "saved acts", "total")


def memory_table(records: Sequence[dict[str, Any]]) -> list[str]:
    """Each mode's bytes per component after one step, in KiB ([] when no record has them)."""
    rows = [r for r in records if r.get("weights_bytes") is not None]
    if not rows:
        return []
    cells = [list(_MEMORY_HEAD)]
    for r in rows:
        values = [r[f"{c}_bytes"] for c in COMPONENTS]
        cells.append([r["mode"], *(f"{v / 1024:.1f}" for v in values), f"{sum(values) / 1024:.1f}"])
    widths = [max(len(row[i]) for row in cells) for i in range(len(_MEMORY_HEAD))]
    lines = ["", "memory per component (KiB, one step, read off the tensors)"]
    for index, row in enumerate(cells):
        lines.append(
            "  ".join(
                f"{c:{'<' if i == 0 else '>'}{w}}" for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
        if index == 0:
            lines.append("  ".join("-" * w for w in widths))
    return lines


def _wrap(text: str) -> list[str]:
    return textwrap.wrap(text, WIDTH, subsequent_indent="  ", break_on_hyphens=False) or [""]


def format_table(results: Sequence[Any], notes: Iterable[str] = (), header: str = "") -> str:
    """The comparison table, one section per workload, NOISY rows flagged, every line <= ``WIDTH``."""
    records = make_records(results)
    lines = [*_wrap(header)] if header else []
    for workload in dict.fromkeys(r["workload"] for r in records):
        spec = WORKLOADS[workload]
        better = "higher" if spec.metric_higher_is_better else "lower"
        rows = [[name for name, _ in _COLUMNS]] + [_row(r) for r in records if r["workload"] == workload]
        lines += ["", f"{workload} (metric: {spec.metric}, {better} is better)", *_layout(rows)]
        lines += memory_table([r for r in records if r["workload"] == workload])
        advice = recommend(records, workload)
        if advice is not None:
            lines += ["", *_wrap(advice)]
    lines.append("")
    for line in footer(results):
        lines += _wrap(line)
    for line in noisy_lines(records):
        lines += textwrap.wrap(line, WIDTH, subsequent_indent="    ", break_on_hyphens=False)
    for note in notes:
        lines += _wrap(f"note: {note}")
    return "\n".join(lines)


def noisy_lines(records: Sequence[Mapping[str, Any]]) -> list[str]:
    """The NOISY footnote (unwrapped lines): how many runs, the advice, then one line per workload
    naming its NOISY rows; [] when none is NOISY."""
    by_workload: dict[str, list[str]] = {}
    for r in records:
        if r.get("noisy"):
            by_workload.setdefault(r["workload"], []).append(r["mode"])
    if not by_workload:
        return []
    count = sum(map(len, by_workload.values()))
    head = f"NOISY: {count} of {len(records)} runs: {NOISY_ADVICE}"
    return [head, *(f"  {workload}: {', '.join(modes)}" for workload, modes in by_workload.items())]


def footer(results: Sequence[Any]) -> list[str]:
    """What each column measures, and each workload's data and loss (unwrapped lines)."""
    if not results:
        return []
    warmups = "/".join(map(str, sorted({r.warmup for r in results})))
    methods = sorted({r.memory_method for r in results})
    lines = [
        f"step ms: median wall time of a training step after {warmups} warm-up step(s): batch fetch and "
        "transfer, forward, loss, backward, loss scaling, optimizer and scheduler step; IQR: 25th-75th "
        "percentile",
        "speedup: median over rounds of fp32's step time / this mode's in the same round (modes run "
        "interleaved, a few steps each per round); [90% CI] of that median, widened by the variation "
        f"between processes that the '{AA_LABEL}' run (a second fp32 process) shows; NOISY: CI wider "
        f"than {NOISY_WIDTH:.0%} of the speedup (fp32: IQR over {NOISY_IQR:.0%} of the median)",
        "MiB: peak memory, " + "; ".join(DESCRIPTIONS[m] for m in methods),
        "memory per component: after the last warm-up step, the storages of the parameters (and fp32 "
        "masters), their .grad, the optimizer's state (and Kahan buffers), and the distinct tensors autograd "
        "saved for backward in that step (saved_tensors_hooks; parameters left out)",
        "scale: final loss scale ('-': the mode does not scale the loss); "
        "skip: optimizer steps skipped on inf/nan gradients",
    ]
    for name in dict.fromkeys(r.workload for r in results):
        source = next(r.data_source for r in results if r.workload == name)
        meaning = WORKLOADS[name].loss_meaning
        loss = f"; loss = {meaning}" if meaning else ""
        lines.append(f"{name}: {source}{loss}; metric on held-out data")
    return lines


def write_json(results: Sequence[Any], path: str | Path, runs_planned: int | None = None) -> Path:
    """A JSON list with one record per run (keys ``RECORD_KEYS``), written complete or not at all."""
    text = json.dumps(make_records(results, runs_planned), indent=1, allow_nan=False) + "\n"
    return write_atomic(path, text)


def write_log(
    results: Sequence[Any],
    path: str | Path,
    runs_planned: int | None = None,
    running: Sequence[Any] = (),
    notes: Sequence[str] = (),
) -> Path:
    """JSON Lines, one object per training step with keys ``LOG_KEYS``, then the end-of-log trailer.

    ``running``: runs still training (``workload``, ``mode``, ``history`` as a RunResult has them; see
    ``schedule.Running``), whose steps so far follow the finished runs' (the bench rewrites the log
    after every round). The whole file is replaced atomically (see ``mixprec._files``); its trailer
    ``{"end_of_log": {"records": N, "runs": R, "runs_planned": P}}`` tells ``mixprec report`` whether
    the bench had finished (``R == P``); ``"running": U`` is added when ``U`` runs were still training,
    ``"notes": [...]`` when ``notes`` (the table's notes) are given, for the report to repeat.
    """
    lines: list[Mapping[str, Any]] = []
    for r in [*results, *running]:
        for entry in r.history:
            record = {"workload": r.workload, "mode": r.mode, **entry}
            record["loss"] = _finite(record["loss"])
            lines.append({key: record.get(key) for key in LOG_KEYS})
    planned = len(results) if runs_planned is None else runs_planned
    trailer: dict[str, Any] = {"runs": len(results), "runs_planned": planned}
    if running:
        trailer["running"] = len(running)
    if notes:
        trailer["notes"] = list(notes)
    return write_atomic(path, jsonl_text(lines, **trailer))


def bench_summary(
    records: Sequence[Mapping[str, Any]], name: str, images: Sequence[Path], notes: Sequence[str] = ()
) -> str:
    """Markdown: one row per run of ``mixprec bench --json`` (cells formatted as the printed table's),
    the NOISY ones named, each workload's "what to use" line, the bench's ``notes``, the images."""
    head = ["workload", *(label or "noisy" for label, _ in _COLUMNS)]
    lines = [
        f"# mixprec bench report ({name})",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for r in records:
        full = {key: r.get(key) for key in RECORD_KEYS}
        full["speedup_low"] = full["speedup_low"] if r.get("speedup_high") is not None else None
        lines.append("| " + " | ".join([r["workload"], *_row(full)]) + " |")
    noisy = [f"{r['workload']}/{r['mode']}" for r in records if r.get("noisy")]
    if noisy:
        lines += [
            "",
            f"NOISY (timings spread too widely to trust; rerun on a quieter machine): {', '.join(noisy)}.",
        ]
    advice = [recommend(records, w) for w in dict.fromkeys(r["workload"] for r in records)]
    if any(advice):
        lines += ["", "## What to use", "", *(f"- {a}" for a in advice if a)]
    if notes:
        lines += ["", "## Notes", "", *(f"- {note}" for note in notes)]
    lines += ["", *(f"![{image.stem}]({image.name})" for image in images)]
    return "\n".join(lines) + "\n"
