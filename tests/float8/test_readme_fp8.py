"""The README's fp8 training example runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_fp8_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    section = README.read_text().split("\n## fp8 training", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```python\n(.*?)```", section, re.S)
    assert block, "no python block under '## fp8 training'"
    exec(compile(block.group(1), "README.md#fp8-training", "exec"), {})
    assert "keep in bf16:" in capsys.readouterr().out


def test_readme_torchao_config_example_prints_its_recipe(capsys: pytest.CaptureFixture[str]) -> None:
    section = README.read_text().split("\n## fp8 training", 1)[1].split("\n## ", 1)[0]
    block = next(b for b in re.findall(r"```python\n(.*?)```", section, re.S) if "cast_config_input" in b)
    exec(compile(block, "README.md#code-written-for-torchaofloat8", "exec"), {})
    printed = block.split("print(config.lowbit_recipe)  # ")[1].splitlines()[0]
    assert capsys.readouterr().out.strip() == printed
