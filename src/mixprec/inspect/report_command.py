"""``mixprec report``, in the shape of ``mixprec.cli``'s ``SUBCOMMANDS`` table (HELP, add_arguments, run)."""

from mixprec.inspect.cli import REPORT_HELP as HELP
from mixprec.inspect.cli import add_report_arguments as add_arguments
from mixprec.inspect.cli import run_report as run

__all__ = ["HELP", "add_arguments", "run"]
