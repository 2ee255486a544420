"""The bad-input battery as tests: each case must raise clearly and leave its object unchanged.

``python -m tests.reliability.count`` prints the same cases as counts (tried / clear / obscure / silent /
crash / half-changed).
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from .battery import CLEAR, run_case
from .cases import all_cases

ROOT = Path(__file__).resolve().parents[2]

CASES = all_cases()


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES])
def test_bad_input_is_refused_clearly(case):
    if case.isolate:
        index = CASES.index(case)
        proc = subprocess.run(
            [sys.executable, "-m", "tests.reliability.count", "--child", str(index)],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=300,
        )
        lines = proc.stdout.splitlines()
        assert lines, f"the interpreter died (exit {proc.returncode}): {proc.stderr[-500:]}"
        _, kind, detail = json.loads(lines[0])
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            outcome = run_case(case)
        kind, detail = outcome.kind, outcome.detail
    assert kind == CLEAR, f"{kind}: {detail}"


def test_case_ids_are_unique_and_the_table_is_large():
    assert len({c.id for c in CASES}) == len(CASES) > 300
