"""The fp8 guide page's examples run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[2] / "docs" / "guide" / "fp8.md"


def test_readme_fp8_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    section = PAGE.read_text().split("\n## ", 1)[0]
    block = re.search(r"```python\n(.*?)```", section, re.S)
    assert block, "no python block at the top of docs/guide/fp8.md"
    exec(compile(block.group(1), "docs/guide/fp8.md", "exec"), {})
    assert "keep in bf16:" in capsys.readouterr().out


def test_readme_torchao_config_example_prints_its_recipe(capsys: pytest.CaptureFixture[str]) -> None:
    section = PAGE.read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", section, re.S) if "cast_config_input" in b)
    exec(compile(block, "docs/guide/fp8.md#code-written-for-torchaofloat8", "exec"), {})
    printed = block.split("print(config.lowbit_recipe)  # ")[1].splitlines()[0]
    assert capsys.readouterr().out.strip() == printed
