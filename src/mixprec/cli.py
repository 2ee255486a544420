"""The ``mixprec`` command: subcommands register from the ``SUBCOMMANDS`` table.

Each entry maps a subcommand to a module exposing ``HELP: str``, ``add_arguments(parser)`` and
``run(args) -> int``. A module is imported only when the parser is built, so adding ``report`` or
``inspect`` is one line here and one module there.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

SUBCOMMANDS: dict[str, str] = {
    "bench": "mixprec.bench.command",
    "report": "mixprec.inspect.report_command",
    "inspect": "mixprec.inspect.inspect_command",
    "plan": "mixprec.inspect.plan_command",
}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one subparser per ``SUBCOMMANDS`` entry."""
    from mixprec import __version__

    parser = argparse.ArgumentParser(
        prog="mixprec", description="Automatic mixed-precision training for PyTorch."
    )
    parser.add_argument("--version", action="version", version=f"mixprec {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        sub = subparsers.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(sub)
        sub.set_defaults(handler=module.run, subparser=sub)
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
