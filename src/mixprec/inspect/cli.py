"""``mixprec inspect``: argument parsing and the run behind it.

``INSPECT_HELP``, ``add_inspect_arguments(parser)`` + ``run_inspect(args) -> int`` are the names
``mixprec.cli``'s ``SUBCOMMANDS`` table points to, plus a standalone ``inspect_main(argv) -> int``.
``mixprec report`` (a run log's or bench file's report) is :mod:`mixprec.bench.report_command`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

INSPECT_HELP = "show mixprec's precision diagnostics end to end on small models built to fail"


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
    if args.out and Path(args.out).exists() and not Path(args.out).is_dir():  # before the diagnostics print
        raise ValueError(f"--out {args.out} is a file, not a folder; name a folder to write into")
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


def inspect_main(args: list[str] | None = None) -> int:
    """``mixprec inspect [--out DIR] [--steps N]``; returns the exit code."""
    return _main(args, "mixprec inspect", INSPECT_HELP, add_inspect_arguments, run_inspect)
