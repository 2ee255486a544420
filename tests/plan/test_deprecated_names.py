"""The planner's old names under ``mixprec.inspect`` and ``mixprec.integrations.replan`` still give the
new objects for one release, each with a DeprecationWarning naming the new place; in a fresh interpreter,
so that no earlier import has cached the old modules."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _run(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


CHECK = """
import warnings
import mixprec.plan as new
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    {statement}
messages = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
assert len(messages) == 1 and {new_name!r} in messages[0], messages
assert {got} is {expected}, ({got}, {expected})
print("ok")
"""

CASES = [
    (
        "from mixprec.inspect import plan_precision",
        "mixprec.plan.plan_precision",
        "plan_precision",
        "new.plan_precision",
    ),
    (
        "from mixprec.inspect import PrecisionPlan",
        "mixprec.plan.PrecisionPlan",
        "PrecisionPlan",
        "new.PrecisionPlan",
    ),
    ("from mixprec.inspect import Replan", "mixprec.plan.Replan", "Replan", "new.Replan"),
    ("import mixprec.inspect.plan_cost as m", "mixprec.plan.cost", "m", "new.cost"),
    ("from mixprec.inspect import plan_cost as m", "mixprec.plan.cost", "m", "new.cost"),
    (
        "from mixprec.inspect.plan import plan_precision as f",
        "mixprec.plan.planner",
        "f",
        "new.plan_precision",
    ),
    (
        "from mixprec.inspect.plan_value import PrecisionPlan as c",
        "mixprec.plan.result",
        "c",
        "new.PrecisionPlan",
    ),
    ("from mixprec.inspect.plan_schedule import Replan as c", "mixprec.plan.schedule", "c", "new.Replan"),
    ("import mixprec.inspect.plan_command as m", "mixprec.plan.command", "m", "new.command"),
    (
        "from mixprec.integrations.replan import ReplanSchedule as c",
        "mixprec.plan.schedule",
        "c",
        "new.ReplanSchedule",
    ),
]


@pytest.mark.parametrize(("statement", "new_name", "got", "expected"), CASES)
def test_an_old_name_warns_and_is_the_new_object(statement, new_name, got, expected) -> None:
    done = _run(CHECK.format(statement=statement, new_name=new_name, got=got, expected=expected))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_importing_inspect_neither_warns_nor_loads_the_planner() -> None:
    done = _run(
        """
        import sys
        import mixprec.inspect
        from mixprec.inspect import lowbit_report, trace_dtypes
        print(sorted(m for m in sys.modules if m.startswith("mixprec.plan")))
        """
    )
    assert done.returncode == 0, done.stderr  # -W error: any DeprecationWarning fails the import
    assert done.stdout.strip() == "[]"


def test_an_unknown_name_is_still_an_attribute_error() -> None:
    import mixprec.inspect

    with pytest.raises(AttributeError, match="has no attribute 'plan_nothing'"):
        mixprec.inspect.plan_nothing  # noqa: B018
    with pytest.raises(ImportError):
        import mixprec.inspect.plan_nothing
