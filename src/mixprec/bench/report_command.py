"""``mixprec report``: turn a run log or a bench result into PNGs and a Markdown summary.

``REPORT_HELP``, ``add_report_arguments(parser)`` and ``run_report(args) -> int`` are the names
``mixprec.cli``'s ``SUBCOMMANDS`` table points to; ``report_main(argv) -> int`` runs it alone. It lives in
bench because it reads bench's files (:func:`mixprec.bench.write_report`), which hands a run log to inspect.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mixprec.bench.results import incomplete, write_report

__all__ = ["REPORT_HELP", "add_report_arguments", "report_main", "run_report"]

REPORT_HELP = (
    "turn a `mixprec bench` results folder, a `mixprec bench --json` file or a run log (JSONL from "
    "ScalerLog or `mixprec bench --log`) into PNGs and a Markdown summary"
)


def add_report_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``mixprec report`` options on ``parser``."""
    parser.add_argument(
        "log",
        metavar="LOG",
        help="JSON Lines run log, `mixprec bench --json` file, or a `mixprec bench` results folder",
    )
    parser.add_argument(
        "--out",
        metavar="DIR",
        help="output directory (default: LOG without suffix + '_report'; for a folder: FOLDER/report)",
    )


def run_report(args: argparse.Namespace) -> int:
    """Write the report; print the paths and the summary. Returns the exit code: 0, 1 when what it read
    is an unfinished run (the report covers what it holds) or matplotlib is missing, 2 for a truncated
    or unreadable file (nothing written)."""
    log = Path(args.log)
    default = log / "report" if log.is_dir() else log.with_name(log.stem + "_report")
    out = Path(args.out) if args.out else default
    if out.exists() and not out.is_dir():  # was an mkdir traceback (FileExistsError)
        flag = "--out" if args.out else "the default output folder"
        raise ValueError(f"{flag} {out} is a file, not a folder; name a folder with --out DIR")
    try:
        written = write_report(log, out)
    except ImportError as exc:  # matplotlib missing: not a usage error
        print(f"mixprec report: {exc}", file=sys.stderr)
        return 1
    print(written[-1].read_text())
    for path in written:
        print(f"wrote {path}")
    unfinished = incomplete(log)
    if unfinished:
        print(f"mixprec report: {unfinished}", file=sys.stderr)
        return 1
    return 0


def report_main(args: list[str] | None = None) -> int:
    """``mixprec report LOG [--out DIR]``; returns the exit code (2: bad or missing log, 1: no matplotlib)."""
    parser = argparse.ArgumentParser(prog="mixprec report", description=REPORT_HELP)
    add_report_arguments(parser)
    parsed = parser.parse_args(args)
    try:
        return run_report(parsed)
    except (ValueError, FileNotFoundError) as exc:  # the usage line and the reason, as `mixprec report`
        parser.print_usage(sys.stderr)
        print(f"mixprec report: error: {exc}", file=sys.stderr)
        return 2
