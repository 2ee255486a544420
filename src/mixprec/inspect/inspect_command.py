"""``mixprec inspect``, in the shape of ``mixprec.cli``'s ``SUBCOMMANDS`` table (HELP, add_arguments, run)."""

from mixprec.inspect.cli import INSPECT_HELP as HELP
from mixprec.inspect.cli import add_inspect_arguments as add_arguments
from mixprec.inspect.cli import run_inspect as run

__all__ = ["HELP", "add_arguments", "run"]
