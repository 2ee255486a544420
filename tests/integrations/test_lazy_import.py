"""Importing mixprec (and mixprec.integrations) imports none of the frameworks."""

from __future__ import annotations

import os
import subprocess
import sys

FRAMEWORKS = ("lightning", "pytorch_lightning", "transformers", "accelerate")


def test_importing_mixprec_imports_no_framework() -> None:
    code = (
        "import sys, mixprec, mixprec.integrations, mixprec.inspect\n"
        f"print(sorted(name for name in {FRAMEWORKS!r} if name in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=dict(os.environ)
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
