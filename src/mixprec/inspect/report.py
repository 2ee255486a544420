"""`write_report`: turn a run log into PNGs and a short Markdown summary.

Reads the JSON Lines :class:`ScalerLog` writes (``step, scale, skipped, grad_amax, loss`` ...): the loss
scale over steps (and loss, grad amax), the gradient histogram when logged. Bench's files (``mixprec bench
--json``, ``--log``, a results folder) are :func:`mixprec.bench.write_report`'s (``mixprec report``), which
builds on the helpers here; given one, :func:`write_report` and :func:`incomplete` raise a ``ValueError``
that names it (inspect does not import bench).
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

__all__ = [
    "ACCEPTED",
    "histogram_images",
    "incomplete",
    "load_log",
    "log_images",
    "summarize",
    "write_report",
    "write_summary",
]


ACCEPTED = (
    "`mixprec report` reads a JSON Lines step log (ScalerLog, `mixprec bench --log FILE`) or the JSON "
    "list `mixprec bench --json FILE` writes"
)


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
    """Why the run log at ``path`` holds an unfinished run, or None: it has no end-of-log trailer (its
    writer was stopped before closing it, or is still writing).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the log is cut off (``TruncatedFile``), or ``path`` is a bench file (a results folder, a
            ``mixprec bench --json`` list, or a log whose trailer counts planned runs), which
            :func:`mixprec.bench.incomplete` reads.
    """
    path = Path(path)
    if path.is_dir() or _is_json_list(path):
        raise _bench_file(path, "incomplete")
    records, trailer = read_jsonl(path)
    if trailer is None:
        return (
            f"{path}: incomplete: no end-of-log record after {len(records)} records (the program writing "
            "it was stopped before closing the log, or is still running)"
        )
    if "runs_planned" in trailer:  # only bench's log counts runs
        raise _bench_file(path, "incomplete")
    return None


def _is_json_list(path: Path) -> bool:
    """Whether ``path`` holds a JSON list, as ``mixprec bench --json`` writes (a run log holds objects)."""
    with path.open(encoding="utf-8", errors="replace") as stream:
        return stream.read(4096).lstrip().startswith("[")


def _bench_file(path: Path, name: str) -> ValueError:
    """The error for a bench file given to inspect's ``name``: which reader takes it instead."""
    return ValueError(
        f"{path} is a `mixprec bench` file (a results folder, a `mixprec bench --json` list or a --log); "
        f"mixprec.inspect.{name} reads ScalerLog run logs: use `mixprec report {path}` or "
        f"mixprec.bench.{name}"
    )


def _loss_cell(losses: Sequence[float], nonfinite: Sequence[Any]) -> str:
    """``first → last`` of the finite losses, and how many were not finite (from which step)."""
    cell = f"{losses[0]:.4g} → {losses[-1]:.4g}" if losses else "-"
    if nonfinite:
        first = "" if nonfinite[0] is None else f", first at step {nonfinite[0]}"
        cell += f" ({len(nonfinite)} non-finite{first})"
    return cell


def _run_row(label: str, run: Sequence[Mapping[str, Any]]) -> str:
    losses = [r["loss"] for r in run if r.get("loss") is not None]
    # ScalerLog and the bench write a non-finite loss as null: count those steps, so a run that went to
    # NaN does not read as ending on its last finite loss
    nonfinite = [r.get("step") for r in run if "loss" in r and r["loss"] is None]
    scales = [r["scale"] for r in run if r.get("scale") is not None]
    amaxes = [r["grad_amax"] for r in run if r.get("grad_amax") is not None]
    times = [r["step_time_ms"] for r in run if r.get("step_time_ms") is not None]
    skipped = [r["step"] for r in run if r.get("skipped")]
    shown = ", ".join(str(s) for s in skipped[:8]) + (" ..." if len(skipped) > 8 else "")
    cells = [
        label,
        str(len(run)),
        _loss_cell(losses, nonfinite),
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
        named += f" and {len(culprits) - 8} more" if len(culprits) > 8 else ""
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
    """Write the pictures and ``summary.md`` for a :class:`ScalerLog` run log.

    An unfinished run (see ``mixprec.inspect.report.incomplete``) is reported on what it holds, and its
    summary says so first. Bench's files (a results folder, a ``mixprec bench --json`` list or a ``--log``)
    are :func:`mixprec.bench.write_report`'s, behind ``mixprec report``.

    Args:
        log: a JSON Lines run log.
        out_dir: the directory to write into (created if missing).

    Returns:
        The files written, the Markdown summary last.

    Raises:
        FileNotFoundError: ``log`` does not exist.
        ValueError: the log is cut off (``TruncatedFile``, a ValueError), or it is not a run log (the
            message says which file is wanted; for a bench file, that ``mixprec report`` reads it).
        ImportError: matplotlib is missing.
    """
    log = Path(log)
    if log.is_dir() or _is_json_list(log):
        raise _bench_file(log, "write_report")
    records = load_log(log)
    if any(r.get("workload") is not None and r.get("mode") is not None for r in records):  # bench's log
        raise _bench_file(log, "write_report")
    note = incomplete(log)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    images = log_images(records, out_dir, log.name)
    return [*images, write_summary(out_dir, summarize(records, images), note)]


def write_summary(out_dir: Path, text: str, note: str | None = None) -> Path:
    """Write ``text`` as ``out_dir/summary.md``, with ``note`` (why the run is unfinished) under its title."""
    if note:
        title, _, rest = text.partition("\n")
        text = f"{title}\n\n**{note}.**\n{rest}"
    return write_atomic(out_dir / "summary.md", text)


def log_images(records: Sequence[Mapping[str, Any]], out_dir: Path, name: str) -> list[Path]:
    """A run log's pictures: ``scale_history.png``, and ``grad_histogram.png`` when histograms were logged."""
    scale = plot_scale_history(records, out_dir / "scale_history.png", title=f"{name}: loss scale")
    return [scale, *histogram_images(records, out_dir)]


def histogram_images(records: Sequence[Mapping[str, Any]], out_dir: Path) -> list[Path]:
    """``grad_histogram.png`` of the last logged gradient histogram against the format ranges, or nothing."""
    with_histogram = [r for r in records if r.get("grad_log2_hist")]
    if not with_histogram:
        return []
    last = with_histogram[-1]
    return [
        plot_gradient_histogram(
            {"parameter gradients": Log2Histogram.from_dict(last["grad_log2_hist"])},
            out_dir / "grad_histogram.png",
            scale=last.get("scale") or 1.0,
            title=f"parameter gradients at step {last['step']} against format ranges",
        )
    ]
