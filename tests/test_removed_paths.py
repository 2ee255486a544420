"""The compatibility layer of 0.1.0's moves is gone: each old module path fails to import and each old name
fails to resolve, so that a re-added alias (or a module ``__getattr__`` serving one) fails here. Where each
moved is in CHANGELOG.md ("Removed")."""

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

import mixprec

SRC = Path(mixprec.__file__).resolve().parent

OLD_MODULES = [
    "mixprec._moved",
    "mixprec.master",
    "mixprec.master.optimizer",
    "mixprec.master.compensated",
    "mixprec.master.lowp",
    "mixprec.master.recipes",
    "mixprec.master.casting",
    "mixprec.float8.casts",
    "mixprec.float8.matmul",
    "mixprec.float8.scaling",
    "mixprec.inspect.bench_report",
    "mixprec.inspect.plan",
    "mixprec.inspect.plan_cost",
    "mixprec.inspect.plan_value",
    "mixprec.inspect.plan_schedule",
    "mixprec.inspect.plan_command",
    "mixprec.integrations.replan",
]

OLD_NAMES = [
    ("mixprec.inspect", "plan_precision"),
    ("mixprec.inspect", "PrecisionPlan"),
    ("mixprec.inspect", "Replan"),
    ("mixprec.inspect", "plan_cost"),
    ("mixprec.inspect.cli", "REPORT_HELP"),
    ("mixprec.inspect.cli", "add_report_arguments"),
    ("mixprec.inspect.cli", "run_report"),
    ("mixprec.inspect.cli", "report_main"),
    ("mixprec.inspect.report", "load_bench_json"),
    ("mixprec.inspect.report", "BENCH_FILE"),
    ("mixprec.inspect.report", "BENCH_KEYS"),
    ("mixprec.inspect.report", "BENCH_LOG"),
    ("mixprec.inspect.report", "UNFINISHED"),
    ("mixprec.float8", "casts"),
    ("mixprec.float8", "matmul"),
    ("mixprec.integrations", "replan"),
]


@pytest.mark.parametrize("name", OLD_MODULES)
def test_an_old_module_path_does_not_import(name: str) -> None:
    with pytest.raises(ModuleNotFoundError) as caught:
        importlib.import_module(name)
    missing = caught.value.name  # the old package itself for a submodule of one (mixprec.master.optimizer)
    assert missing is not None and missing != "mixprec" and (name + ".").startswith(missing + ".")


@pytest.mark.parametrize(("module", "name"), OLD_NAMES)
def test_an_old_name_is_not_an_attribute(module: str, name: str) -> None:
    with pytest.raises(AttributeError, match=f"has no attribute '{name}'"):
        getattr(importlib.import_module(module), name)


def test_no_module_serves_names_through_a_module_getattr() -> None:
    """A module-level ``__getattr__`` is how the old names were served; mixprec defines none now."""
    offenders = [
        str(path.relative_to(SRC))
        for path in sorted(SRC.rglob("*.py"))
        if "def __getattr__(name" in path.read_text() or "__getattr__ = " in path.read_text()
    ]
    assert offenders == []


def test_no_finder_is_left_on_the_import_path() -> None:
    """The old modules resolved through a ``sys.meta_path`` finder; importing all of mixprec adds none."""
    code = (
        "import json, sys; before = list(sys.meta_path)\n"
        "import mixprec, mixprec.inspect, mixprec.float8, mixprec.integrations, mixprec.optim, mixprec.amp\n"
        "print(json.dumps([type(f).__module__ for f in sys.meta_path if f not in before]))\n"
    )
    env = {"PYTHONPATH": str(SRC.parent), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert [m for m in json.loads(done.stdout) if m.startswith("mixprec")] == []
