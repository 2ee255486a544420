"""Present bench results: the comparison table, JSON records and the per-step JSONL log (plots: plots.py)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from mixprec.bench.memory import DESCRIPTIONS
from mixprec.bench.stats import NOISY_ADVICE, NOISY_IQR, NOISY_WIDTH, round_medians, timings
from mixprec.bench.workloads import WORKLOADS

RECORD_KEYS = (
    "workload",
    "mode",
    "device",
    "threads",
    "dtype",
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
    "final_loss",
    "final_metric",
    "skipped_steps",
    "final_scale",
    "round_medians_ms",
)
LOG_KEYS = ("step", "round", "workload", "mode", "loss", "scale", "skipped", "step_time_ms")
LOSS_MEANING = {
    "lm": "validation cross-entropy per character",
    "cnn": "test cross-entropy",
    "tabular-regression": "validation MSE (standardised target)",
}
_COLUMNS = (
    ("workload", "<"),
    ("mode", "<"),
    ("step ms", ">"),
    ("IQR ms", ">"),
    ("speedup [90% CI]", ">"),
    ("peak MiB", ">"),
    ("loss", ">"),
    ("metric", ">"),
    ("skipped", ">"),
    ("scale", ">"),
    ("", "<"),
)


def _finite(value: float | None) -> float | None:
    """JSON has no NaN/inf: non-finite numbers (a diverged run) become null."""
    return value if value is None or math.isfinite(value) else None


def make_records(results: Sequence[Any]) -> list[dict[str, Any]]:
    """One record per run with exactly ``RECORD_KEYS`` (times in ms; see :mod:`mixprec.bench.stats`)."""
    records = []
    for r, t in zip(results, timings(results), strict=True):
        rounds = round_medians(r.history, r.warmup)
        values = {
            "workload": r.workload,
            "mode": r.mode,
            "device": r.device,
            "threads": r.threads,
            "dtype": r.dtype,
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
            "final_loss": _finite(r.final_loss),
            "final_metric": _finite(r.final_metric),
            "skipped_steps": r.skipped_steps,
            "final_scale": r.final_scale,
            "round_medians_ms": [round(rounds[k], 4) for k in sorted(rounds)],
        }
        records.append({key: values[key] for key in RECORD_KEYS})
    return records


def _number(value: float | None, spec: str, suffix: str = "") -> str:
    if value is None:
        return "-"
    return "nan" if not math.isfinite(value) else f"{value:{spec}}{suffix}"


def _speedup(record: dict[str, Any]) -> str:
    speedup = _number(record["speedup_vs_fp32"], ".2f", "x")
    if record["speedup_low"] is None:
        return speedup
    return f"{speedup} [{record['speedup_low']:.2f}-{record['speedup_high']:.2f}]"


def _row(record: dict[str, Any]) -> list[str]:
    metric = WORKLOADS[record["workload"]].metric
    metric_spec = ".2%" if metric == "accuracy" else ".3f"
    spec = ".2f" if (record["step_time_ms"] or 0) < 10 else ".1f"
    return [
        record["workload"],
        record["mode"],
        _number(record["step_time_ms"], spec),
        f"{_number(record['step_time_q25_ms'], spec)}-{_number(record['step_time_q75_ms'], spec)}",
        _speedup(record),
        _number(record["peak_memory_mb"], ".1f"),
        _number(record["final_loss"], ".4f"),
        f"{metric} {_number(record['final_metric'], metric_spec)}",
        str(record["skipped_steps"]),
        _number(record["final_scale"], ".0f"),
        "NOISY" if record["noisy"] else "",
    ]


def format_table(results: Sequence[Any], notes: Iterable[str] = (), header: str = "") -> str:
    """The comparison table, a NOISY mark on rows whose timing spread is wide, and what each column means."""
    records = make_records(results)
    rows = [[name for name, _ in _COLUMNS]] + [_row(r) for r in records]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    lines = [header] if header else []
    for index, row in enumerate(rows):
        cells = [
            f"{cell:{align}{width}}" for cell, (_, align), width in zip(row, _COLUMNS, widths, strict=True)
        ]
        lines.append("  ".join(cells).rstrip())
        if index == 0:
            lines.append("  ".join("-" * width for width in widths).rstrip())
    noisy = [f"{r['workload']}/{r['mode']}" for r in records if r["noisy"]]
    lines += ["", *footer(results)]
    if noisy:
        lines.append(f"NOISY ({', '.join(noisy)}): {NOISY_ADVICE}")
    lines += [f"note: {note}" for note in notes]
    return "\n".join(lines)


def footer(results: Sequence[Any]) -> list[str]:
    """What each column measures, and each workload's data, loss and metric."""
    if not results:
        return []
    warmups = "/".join(map(str, sorted({r.warmup for r in results})))
    methods = sorted({r.memory_method for r in results})
    lines = [
        f"step ms: median wall time of a training step after {warmups} warm-up step(s): batch fetch and "
        "transfer, forward, loss, backward, loss scaling, optimizer and scheduler step; IQR: 25th-75th "
        "percentile",
        "speedup: median over rounds of fp32's step time / this mode's in the same round (modes run "
        "interleaved, a few steps each per round); [90% CI] of that median; NOISY: CI wider than "
        f"{NOISY_WIDTH:.0%} of the speedup (fp32: IQR over {NOISY_IQR:.0%} of the median)",
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


def write_json(results: Sequence[Any], path: str | Path) -> Path:
    """A JSON list with one record per run (keys ``RECORD_KEYS``); ``mixprec report`` reads it."""
    path = Path(path)
    text = json.dumps(make_records(results), indent=1, allow_nan=False) + "\n"
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    partial.replace(path)  # never leave a half-written file where a complete one was
    return path


def write_log(results: Sequence[Any], path: str | Path) -> Path:
    """JSON Lines, one object per training step with keys ``LOG_KEYS`` (the input of ``mixprec report``)."""
    path = Path(path)
    with path.open("w") as handle:
        for r in results:
            for entry in r.history:
                record = {"workload": r.workload, "mode": r.mode, **entry}
                record["loss"] = _finite(record["loss"])
                handle.write(json.dumps({key: record.get(key) for key in LOG_KEYS}, allow_nan=False) + "\n")
    return path
