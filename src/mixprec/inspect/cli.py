"""``mixprec report`` and ``mixprec inspect``: argument parsing and the runs behind them.

Each command is ``*_HELP``, ``add_*_arguments(parser)`` + ``run_*(args) -> int``, the names
``mixprec.cli``'s ``SUBCOMMANDS`` table points to, plus a standalone ``*_main(argv) -> int``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

REPORT_HELP = (
    "turn a run log (JSONL from ScalerLog or `mixprec bench --log`) into PNGs and a Markdown summary"
)
INSPECT_HELP = "show mixprec's precision diagnostics end to end on small models built to fail"


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
    from mixprec.inspect.report import incomplete, write_report

    log = Path(args.log)
    default = log / "report" if log.is_dir() else log.with_name(log.stem + "_report")
    out = Path(args.out) if args.out else default
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


def add_inspect_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``mixprec inspect`` options on ``parser``."""
    parser.add_argument("--out", metavar="DIR", help="also write the PNGs, a scaler log and its report here")
    parser.add_argument(
        "--steps", type=int, default=40, help="training steps of the scaler-log demo (with --out; default 40)"
    )


def run_inspect(args: argparse.Namespace) -> int:
    """Print each diagnostic on the demo models (and write pictures with ``--out``). Returns the exit code."""
    from mixprec.inspect import _showcase

    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    _showcase.print_diagnostics()
    if args.out:
        try:
            written = _showcase.write_pictures(Path(args.out), steps=args.steps)
        except ImportError as exc:  # matplotlib missing: the printed diagnostics above still stand
            print(f"mixprec inspect: {exc}", file=sys.stderr)
            return 1
        for path in written:
            print(f"wrote {path}")
    return 0


def _main(
    argv: list[str] | None,
    prog: str,
    help_text: str,
    add: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], int],
) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=help_text)
    add(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except (ValueError, FileNotFoundError) as exc:
        parser.print_usage(sys.stderr)
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2


def report_main(args: list[str] | None = None) -> int:
    """``mixprec report LOG [--out DIR]``; returns the exit code (2: bad or missing log, 1: no matplotlib)."""
    return _main(args, "mixprec report", REPORT_HELP, add_report_arguments, run_report)


def inspect_main(args: list[str] | None = None) -> int:
    """``mixprec inspect [--out DIR] [--steps N]``; returns the exit code."""
    return _main(args, "mixprec inspect", INSPECT_HELP, add_inspect_arguments, run_inspect)
