"""The README's low-bit training example runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
SECTION = "\n## Low-bit training: block-scaled formats"


def test_readme_lowbit_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    section = README.read_text().split(SECTION, 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```python\n(.*?)```", section, re.S)
    assert block, "no python block under the low-bit section"
    exec(compile(block.group(1), "README.md#low-bit-training", "exec"), {})
    out = capsys.readouterr().out
    assert "mxfp8 round-trip error" in out and "keep in high precision:" in out
