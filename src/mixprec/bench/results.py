"""Read bench's files back and report on them: ``--json`` lists, ``--log`` logs and results folders.

The files are the JSON list of ``mixprec bench --json``, the JSON Lines of ``mixprec bench --log`` and a
``mixprec bench`` results folder (``bench.json`` and, when present, ``steps.jsonl``).

* :func:`load_bench_json`: the records of a ``--json`` file;
* :func:`incomplete`: why a bench file (or a run log) holds an unfinished run;
* :func:`write_report`: the pictures and ``summary.md`` of ``mixprec report``: for a ``--json`` list the
  step-time picture (per-round medians) and a table of speedups with their intervals; for a ``--log`` one
  run per ``(workload, mode)``: the loss of each workload's modes against fp32, the step times and the loss
  scale of the runs that scale; for a folder both. A :class:`~mixprec.inspect.ScalerLog` run log goes to
  :func:`mixprec.inspect.write_report`, which bench builds on (inspect never imports bench).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mixprec._files import TruncatedFile, read_jsonl
from mixprec.bench.plots import plot_bench_log, plot_bench_records
from mixprec.bench.report import bench_summary
from mixprec.bench.workloads import WORKLOADS
from mixprec.inspect import report as log_report
from mixprec.inspect.report import ACCEPTED, histogram_images, load_log, log_images, summarize, write_summary

__all__ = ["BENCH_FILE", "BENCH_LOG", "incomplete", "is_bench_log", "load_bench_json", "write_report"]

BENCH_KEYS = ("workload", "mode", "step_time_ms")  # what makes a JSON list item a bench record
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
    check_workloads(path, records)
    return records


def check_workloads(path: str | Path, records: Sequence[Mapping[str, Any]]) -> None:
    """A ValueError naming the workloads of bench records that this mixprec does not know (a file written
    by a version with other workloads), before any report reads their metrics."""
    unknown = sorted({str(r["workload"]) for r in records if r.get("workload") is not None} - set(WORKLOADS))
    if unknown:
        raise ValueError(
            f"{path}: records of workload(s) {', '.join(unknown)}, which this mixprec does not have (known: "
            f"{', '.join(WORKLOADS)}); written by a mixprec with other workloads: report it there"
        )


def is_bench_log(records: Sequence[Mapping[str, Any]]) -> bool:
    """Whether JSON Lines records are ``mixprec bench --log``'s (they name a workload and a mode)."""
    return any(r.get("workload") is not None and r.get("mode") is not None for r in records)


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
    _, trailer = read_jsonl(path)
    if trailer is None:
        return log_report.incomplete(path)  # a log never closed, whoever wrote it: inspect's sentence
    runs, planned = trailer.get("runs"), trailer.get("runs_planned")
    if isinstance(runs, int) and isinstance(planned, int) and runs < planned:
        return f"{path}: incomplete: {runs} of {planned} planned runs ({UNFINISHED})"
    return None


def write_report(path: str | Path, out_dir: str | Path) -> list[Path]:
    """Write the pictures and ``summary.md`` for a ``mixprec bench --json`` file, a ``mixprec bench --log``
    file, a ``mixprec bench`` results folder (its ``bench.json`` and, when present, ``steps.jsonl``) or a
    ScalerLog run log (handed to :func:`mixprec.inspect.write_report`): what ``mixprec report`` writes.

    An unfinished run (see :func:`incomplete`) is reported on what it holds, and its summary says so
    first.

    Args:
        path: the JSON list of ``mixprec bench --json``, a JSON Lines log, or a results folder.
        out_dir: the directory to write into (created if missing).

    Returns:
        The files written, the Markdown summary last.

    Raises:
        FileNotFoundError: ``path`` does not exist (for a folder: it has no ``bench.json``).
        ValueError: a file is cut off (``TruncatedFile``, a ValueError), or it is none of the accepted
            kinds (the message says which file is wanted).
        ImportError: matplotlib is missing.
    """
    path, out_dir = Path(path), Path(out_dir)
    if path.is_dir():
        return _write_folder_report(path, out_dir)
    bench = load_bench_json(path)
    records = load_log(path) if bench is None else []
    if bench is None and not is_bench_log(records):
        return log_report.write_report(path, out_dir)
    check_workloads(path, records)
    note = incomplete(path)
    out_dir.mkdir(parents=True, exist_ok=True)
    if bench is not None:
        images = [plot_bench_records(bench, out_dir / "step_time.png")]
        return [*images, write_summary(out_dir, bench_summary(bench, path.name, images), note)]
    images = _log_images(records, out_dir, path.name)
    return [*images, write_summary(out_dir, summarize(records, images), note)]


def _write_folder_report(folder: Path, out_dir: Path) -> list[Path]:
    """A results folder: the bench records' table and step times, plus the log's loss pictures."""
    if not (folder / BENCH_FILE).exists():
        raise FileNotFoundError(
            f"{folder} is a directory without {BENCH_FILE}, so not a `mixprec bench` results folder; "
            f"{ACCEPTED}, or such a folder"
        )
    bench = load_bench_json(folder / BENCH_FILE)
    if bench is None:
        raise ValueError(f"{folder / BENCH_FILE}: not a JSON list; {ACCEPTED}")
    records = load_log(folder / BENCH_LOG) if (folder / BENCH_LOG).exists() else []
    trailer = read_jsonl(folder / BENCH_LOG)[1] if records else None
    notes = [str(n) for n in (trailer or {}).get("notes", [])]  # the table's notes, as the bench printed them
    note = incomplete(folder)
    out_dir.mkdir(parents=True, exist_ok=True)
    images = [p for p in _log_images(records, out_dir, BENCH_LOG) if p.name != "step_time.png"]
    images.insert(0, plot_bench_records(bench, out_dir / "step_time.png"))
    return [*images, write_summary(out_dir, bench_summary(bench, folder.name, images, notes), note)]


def _log_images(records: list[dict[str, Any]], out_dir: Path, name: str) -> list[Path]:
    if not records:
        return []
    if not is_bench_log(records):
        return log_images(records, out_dir, name)
    return [*plot_bench_log(records, out_dir, name), *histogram_images(records, out_dir)]
