"""The ``mixprec`` command: subcommands register from the ``SUBCOMMANDS`` table.

Each entry maps a subcommand to a module and the names of its help text (``str``), its
``add_arguments(parser)`` and its ``run(args) -> int`` there. A module is imported only when the parser is
built, so a subcommand is one line here and three names in its module.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

SUBCOMMANDS: dict[str, tuple[str, str, str, str]] = {
    "bench": ("mixprec.bench.command", "HELP", "add_arguments", "run"),
    "report": ("mixprec.bench.report_command", "REPORT_HELP", "add_report_arguments", "run_report"),
    "inspect": ("mixprec.inspect.cli", "INSPECT_HELP", "add_inspect_arguments", "run_inspect"),
    "plan": ("mixprec.plan.command", "HELP", "add_arguments", "run"),
}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one subparser per ``SUBCOMMANDS`` entry."""
    from mixprec import __version__

    parser = argparse.ArgumentParser(
        prog="mixprec", description="Automatic mixed-precision training for PyTorch."
    )
    parser.add_argument("--version", action="version", version=f"mixprec {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_name, add_name, run_name) in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        text = getattr(module, help_name)
        sub = subparsers.add_parser(name, help=text, description=text)
        getattr(module, add_name)(sub)
        sub.set_defaults(handler=getattr(module, run_name), subparser=sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``mixprec`` and ``python -m mixprec``; returns the exit code.

    Exit codes: 0 success, 1 a run failed, 2 a usage error (unknown workload or mode, bad option),
    130 interrupted.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.handler(args))
    except (ValueError, FileNotFoundError) as exc:
        args.subparser.print_usage(sys.stderr)
        print(f"mixprec {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
