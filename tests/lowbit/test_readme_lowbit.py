"""The block-scaled guide page's example runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[2] / "docs" / "guide" / "lowbit.md"


def test_readme_lowbit_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    section = PAGE.read_text().split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```python\n(.*?)```", section, re.S)
    assert block, "no python block in the page's Quick start section"
    exec(compile(block.group(1), "docs/guide/lowbit.md", "exec"), {})
    out = capsys.readouterr().out
    assert "mxfp8 round-trip error" in out and "keep in high precision:" in out
