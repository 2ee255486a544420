"""``mixprec.float8.matmul`` and ``mixprec.float8.scaling`` (the fp8 stack's own GEMM and scaling before the
one engine) and ``mixprec.float8.casts`` (now in ``config.py``) still import for a release, as the objects
they moved to, with a DeprecationWarning; nothing in mixprec imports them."""

from __future__ import annotations

import subprocess
import sys

import pytest

OLD = {
    "mixprec.float8.matmul": {
        "Float8LinearFunction": "mixprec.lowbit.gemm.LowbitLinearFunction",
        "scaled_mm": "mixprec.lowbit.gemm.scaled_mm",
        "_scaled_mm_accepts": "mixprec.lowbit.gemm.scaled_mm_accepts",
        "GRAD_OUTPUT": "mixprec.lowbit.history.GRAD_OUTPUT",
    },
    "mixprec.float8.scaling": {
        "amax_to_scale": "mixprec.lowbit.history.amax_to_scale",
        "delayed_scale": "mixprec.lowbit.history.delayed_scale",
        "push_amax": "mixprec.lowbit.history.push_amax",
        "to_float8": "mixprec.lowbit.history.to_float8",
        "EPS": "mixprec.lowbit.history.EPS",
    },
}


def _run_importing(statement: str, then: str) -> None:
    """Run ``statement`` in a fresh interpreter recording every warning as ``seen`` (the
    DeprecationWarnings' texts as ``messages``), then the checks ``then``; fail with its stderr."""
    code = (
        "import importlib, warnings\n"
        "with warnings.catch_warnings(record=True) as seen:\n"
        "    warnings.simplefilter('always')\n"
        f"    {statement}\n"
        "messages = [str(w.message) for w in seen if w.category is DeprecationWarning]\n"
        f"{then}"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("old", sorted(OLD))
def test_an_old_module_warns_and_holds_the_engines_objects(old: str) -> None:
    checks = "; ".join(
        f"assert old.{name} is importlib.import_module({new.rpartition('.')[0]!r}).{new.rpartition('.')[2]}"
        for name, new in OLD[old].items()
    )
    _run_importing(
        f"old = importlib.import_module({old!r})",
        f"assert any(m.startswith({old + ' moved to mixprec.lowbit'!r}) for m in messages), messages\n"
        f"{checks}\n",
    )


def test_casts_is_config() -> None:
    _run_importing(
        "from mixprec.float8.casts import CastConfig, ScalingType, recipe_casts",
        "import mixprec.float8.config as config\n"
        "assert CastConfig is config.CastConfig and ScalingType is config.ScalingType\n"
        "assert recipe_casts is config.recipe_casts\n"
        "assert messages == ['mixprec.float8.casts moved to mixprec.float8.config; the old name is "
        "deprecated and will be removed in the next release'], messages\n"
        "assert {w.filename for w in seen} == {'<string>'}, [w.filename for w in seen]\n",
    )


def test_mixprec_itself_imports_none() -> None:
    code = (
        "import mixprec, mixprec.float8, mixprec.lowbit, mixprec.inspect, mixprec.plan, sys\n"
        "old = {'mixprec.float8.matmul', 'mixprec.float8.scaling', 'mixprec.float8.casts'}\n"
        "assert not old & set(sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", "-c", code], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
