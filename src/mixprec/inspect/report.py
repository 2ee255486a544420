"""`write_report`: turn a run log or a bench result into PNGs and a short Markdown summary.

Reads three kinds of file:

* the JSON Lines :class:`ScalerLog` writes (``step, scale, skipped, grad_amax, loss`` ...): the loss scale
  over steps (and loss, grad amax), the gradient histogram when logged;
* the JSON Lines of ``mixprec bench --log`` (``step, round, workload, mode, loss, scale, skipped,
  step_time_ms``): one run per ``(workload, mode)``; the loss of each workload's modes against fp32, the
  step times, and the loss scale of the runs that scale;
* the JSON list of ``mixprec bench --json`` (one record per run): the step-time picture (per-round
  medians) and a table of speedups with their intervals.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mixprec._files import TruncatedFile, read_jsonl, write_atomic
from mixprec.inspect.plots import group_runs, plot_gradient_histogram, plot_scale_history
from mixprec.inspect.summaries import Log2Histogram
from mixprec.inspect.underflow_report import format_scale

__all__ = ["incomplete", "load_log", "summarize", "write_report"]


ACCEPTED = (
    "`mixprec report` reads a JSON Lines step log (ScalerLog, `mixprec bench --log FILE`) or the JSON "
    "list `mixprec bench --json FILE` writes"
)
BENCH_KEYS = ("workload", "mode", "step_time_ms")
BENCH_FILE, BENCH_LOG = "bench.json", "steps.jsonl"  # in a `mixprec bench` results folder
UNFINISHED = "the bench was interrupted or some runs failed; the rest of this report covers what it holds"


def load_bench_json(path: str | Path) -> list[dict[str, Any]] | None:
    """The records of a ``mixprec bench --json`` file, or None when ``path`` holds something else.

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        ValueError: the JSON list is cut off (``TruncatedFile``, a ValueError), or a JSON list whose items
            are not bench records (naming the keys they lack).
    """
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    if not text.lstrip().startswith("["):
        return None
    try:
        records = json.loads(text)
    except json.JSONDecodeError as exc:
        if exc.pos >= len(text.rstrip()) or not text.rstrip().endswith("]"):
            raise TruncatedFile(
                f"{path}: truncated: the JSON list is cut off after {len(text)} characters (the program "
                "writing it was stopped mid-write, or the file was copied incompletely)"
            ) from exc
        raise ValueError(f"{path}: not valid JSON ({exc.msg}, line {exc.lineno}); {ACCEPTED}") from exc
    for index, record in enumerate(records):
        missing = [k for k in BENCH_KEYS if not isinstance(record, dict) or k not in record]
        if missing:
            raise ValueError(
                f"{path}: item {index} of the JSON list lacks {', '.join(missing)}, so it is not "
                f"`mixprec bench --json` output; {ACCEPTED}"
            )
    if not records:
        raise ValueError(f"{path}: the JSON list is empty; {ACCEPTED}")
    return records


def load_log(path: str | Path) -> list[dict[str, Any]]:
    """The records of a JSON Lines run log (blank lines and the end-of-log trailer skipped).

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        ValueError: the log is cut off (``TruncatedFile``, a ValueError, from ``mixprec._files.read_jsonl``);
            naming the line that is not a JSON object with an integer ``step``, or for an empty log.
    """
    try:
        records, _ = read_jsonl(path)
    except TruncatedFile:
        raise
    except ValueError as exc:
        raise ValueError(f"{exc}; {ACCEPTED}") from exc
    for number, record in enumerate(records, 1):
        if not isinstance(record.get("step"), int):
            raise ValueError(
                f"{path}:{number}: expected a JSON object with an integer 'step', "
                f"got {json.dumps(record)[:80]!r}"
            )
    if not records:
        raise ValueError(f"{path}: the log holds no records")
    return records


def incomplete(path: str | Path) -> str | None:
    """Why ``path`` (a bench JSON, a JSON Lines log, or a results folder) holds an unfinished run, or None.

    A bench JSON holds fewer records than its ``runs_planned``; a log has no end-of-log trailer (its
    writer was stopped, or is still writing), or its trailer counts fewer runs than were planned.
    """
    path = Path(path)
    if path.is_dir():
        reasons = [incomplete(f) for f in (path / BENCH_FILE, path / BENCH_LOG) if f.exists()]
        return "; ".join(r for r in reasons if r) or None
    bench = load_bench_json(path)
    if bench is not None:
        planned = bench[0].get("runs_planned")
        if isinstance(planned, int) and len(bench) < planned:
            return f"{path}: incomplete: {len(bench)} of {planned} planned runs ({UNFINISHED})"
        return None
    records, trailer = read_jsonl(path)
    if trailer is None:
        return (
            f"{path}: incomplete: no end-of-log record after {len(records)} records (the program writing "
            "it was stopped before closing the log, or is still running)"
        )
    runs, planned = trailer.get("runs"), trailer.get("runs_planned")
    if isinstance(runs, int) and isinstance(planned, int) and runs < planned:
        return f"{path}: incomplete: {runs} of {planned} planned runs ({UNFINISHED})"
    return None


def _run_row(label: str, run: Sequence[Mapping[str, Any]]) -> str:
    losses = [r["loss"] for r in run if r.get("loss") is not None]
    scales = [r["scale"] for r in run if r.get("scale") is not None]
    amaxes = [r["grad_amax"] for r in run if r.get("grad_amax") is not None]
    times = [r["step_time_ms"] for r in run if r.get("step_time_ms") is not None]
    skipped = [r["step"] for r in run if r.get("skipped")]
    shown = ", ".join(str(s) for s in skipped[:8]) + (" ..." if len(skipped) > 8 else "")
    cells = [
        label,
        str(len(run)),
        f"{losses[0]:.4g} → {losses[-1]:.4g}" if losses else "-",
        f"{len(skipped)}" + (f" ({shown})" if skipped else ""),
        f"{format_scale(scales[0])} / {format_scale(min(scales))} / {format_scale(scales[-1])}"
        if scales
        else "-",
        f"{max(amaxes):.3g}" if amaxes else "-",
        f"{statistics.median(times):.2f}" if times else "-",
    ]
    return "| " + " | ".join(cells) + " |"


def summarize(records: Sequence[Mapping[str, Any]], images: Sequence[Path] = ()) -> str:
    """A short Markdown summary: one table row per run, the parameters named in skipped steps, the images."""
    runs = group_runs(records)
    lines = [
        "# mixprec run report",
        "",
        "| run | steps | loss first → last | skipped steps | scale first / min / last | max grad amax | "
        "median step ms |",
        "|---|---|---|---|---|---|---|",
        *(_run_row(label, run) for label, run in runs.items()),
    ]
    culprits = Counter(name for r in records for name in r.get("nonfinite_params") or ())
    if culprits:
        named = ", ".join(f"`{name}` ({n})" for name, n in culprits.most_common(8))
        lines += ["", f"Parameters with non-finite gradients in skipped steps (times seen): {named}."]
    total_skipped = sum(1 for r in records if r.get("skipped"))
    if total_skipped and not culprits:
        lines += [
            "",
            "Steps were skipped; log with `ScalerLog(..., optimizer=..., model=...)` to name the parameters.",
        ]
    if images:
        lines += ["", *(f"![{image.stem}]({image.name})" for image in images)]
    return "\n".join(lines) + "\n"


def write_report(log: str | Path, out_dir: str | Path) -> list[Path]:
    """Write the pictures and ``summary.md`` for a run log, a ``mixprec bench --json`` file, or a
    ``mixprec bench`` results folder (its ``bench.json`` and, when present, ``steps.jsonl``).

    An unfinished run (see ``incomplete``) is reported on what it holds, and its summary says so
    first.

    Args:
        log: a JSON Lines run log, the JSON list of ``mixprec bench --json``, or a results folder.
        out_dir: the directory to write into (created if missing).

    Returns:
        The files written, the Markdown summary last.

    Raises:
        FileNotFoundError: ``log`` does not exist (for a folder: it has no ``bench.json``).
        ValueError: a file is cut off (``TruncatedFile``, a ValueError), or it is none of the accepted
            kinds (the message says which file is wanted).
        ImportError: matplotlib is missing.
    """
    log = Path(log)
    if log.is_dir():
        return _write_folder_report(log, Path(out_dir))
    bench = load_bench_json(log)
    records = None if bench is not None else load_log(log)
    note = incomplete(log)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if bench is not None:
        from mixprec.bench.plots import plot_bench_records
        from mixprec.bench.report import bench_summary

        images = [plot_bench_records(bench, out_dir / "step_time.png")]
        return [*images, _write_summary(out_dir, bench_summary(bench, log.name, images), note)]
    images = _log_images(records, out_dir, log.name)  # type: ignore[arg-type]
    return [*images, _write_summary(out_dir, summarize(records, images), note)]  # type: ignore[arg-type]


def _write_summary(out_dir: Path, text: str, note: str | None) -> Path:
    if note:
        title, _, rest = text.partition("\n")
        text = f"{title}\n\n**{note}.**\n{rest}"
    return write_atomic(out_dir / "summary.md", text)


def _write_folder_report(folder: Path, out_dir: Path) -> list[Path]:
    """A results folder: the bench records' table and step times, plus the log's loss pictures."""
    from mixprec.bench.plots import plot_bench_records
    from mixprec.bench.report import bench_summary

    if not (folder / BENCH_FILE).exists():
        raise FileNotFoundError(
            f"{folder} is a directory without {BENCH_FILE}, so not a `mixprec bench` results folder; "
            f"{ACCEPTED}, or such a folder"
        )
    bench = load_bench_json(folder / BENCH_FILE)
    if bench is None:
        raise ValueError(f"{folder / BENCH_FILE}: not a JSON list; {ACCEPTED}")
    records = load_log(folder / BENCH_LOG) if (folder / BENCH_LOG).exists() else []
    note = incomplete(folder)
    out_dir.mkdir(parents=True, exist_ok=True)
    images = [p for p in _log_images(records, out_dir, BENCH_LOG) if p.name != "step_time.png"]
    images.insert(0, plot_bench_records(bench, out_dir / "step_time.png"))
    return [*images, _write_summary(out_dir, bench_summary(bench, folder.name, images), note)]


def _log_images(records: list[dict[str, Any]], out_dir: Path, name: str) -> list[Path]:
    if not records:
        return []
    is_bench_log = any(r.get("workload") is not None and r.get("mode") is not None for r in records)
    if is_bench_log:
        from mixprec.bench.plots import plot_bench_log

        images = plot_bench_log(records, out_dir, name)
    else:
        images = [plot_scale_history(records, out_dir / "scale_history.png", title=f"{name}: loss scale")]
    with_histogram = [r for r in records if r.get("grad_log2_hist")]
    if with_histogram:
        last = with_histogram[-1]
        images.append(
            plot_gradient_histogram(
                {"parameter gradients": Log2Histogram.from_dict(last["grad_log2_hist"])},
                out_dir / "grad_histogram.png",
                scale=last.get("scale") or 1.0,
                title=f"parameter gradients at step {last['step']} against format ranges",
            )
        )
    return images
