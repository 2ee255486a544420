"""`write_report`: turn a run log (JSON Lines) into PNGs and a short Markdown summary.

Reads the records :class:`ScalerLog` writes (``step, scale, skipped, grad_amax, loss`` ...) and those of
``mixprec bench --log`` (``step, workload, mode, loss, scale, skipped, step_time_ms``); one run per
``(workload, mode)`` pair, or a single run when those keys are absent.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mixprec.inspect.plots import group_runs, plot_gradient_histogram, plot_scale_history
from mixprec.inspect.summaries import Log2Histogram
from mixprec.inspect.underflow_report import format_scale

__all__ = ["load_log", "summarize", "write_report"]


def load_log(path: str | Path) -> list[dict[str, Any]]:
    """The records of a JSON Lines run log (blank lines skipped).

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        ValueError: naming the line that is not a JSON object with an integer ``step``, or for an empty log.
    """
    path = Path(path)
    records = []
    with path.open() as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"{path}:{number}: not valid JSON ({exc.msg}): {line.strip()[:80]!r}"
                ) from exc
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ValueError(
                    f"{path}:{number}: expected a JSON object with an integer 'step', "
                    f"got {line.strip()[:80]!r}"
                )
            records.append(record)
    if not records:
        raise ValueError(f"{path}: the log holds no records")
    return records


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
    """Write ``scale_history.png``, ``grad_histogram.png`` (when the log holds histograms) and ``summary.md``.

    Args:
        log: the JSON Lines run log.
        out_dir: the directory to write into (created if missing).

    Returns:
        The files written, the Markdown summary last.
    """
    records = load_log(log)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    images = [
        plot_scale_history(records, out_dir / "scale_history.png", title=f"{Path(log).name}: loss scale")
    ]
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
    summary = out_dir / "summary.md"
    summary.write_text(summarize(records, images))
    return [*images, summary]
