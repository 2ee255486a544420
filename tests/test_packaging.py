"""The package's metadata: one version, shipped type information, a changelog entry for that version."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest

import mixprec

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11; CI runs 3.11

ROOT = Path(__file__).resolve().parents[1]


def test_version_has_one_source() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"], "pyproject must not hold its own copy of the version"
    assert "version" in project["project"]["dynamic"]
    attr = project["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert attr == "mixprec.__version__"
    assert re.fullmatch(r"\d+\.\d+\.\d+(?:[ab]\d+|rc\d+|\.dev\d+)?", mixprec.__version__)
    # The installed distribution (editable here) reports the same version as the module.
    assert importlib.metadata.version("mixprec") == mixprec.__version__


def test_py_typed_is_shipped() -> None:
    assert (ROOT / "src" / "mixprec" / "py.typed").is_file()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "py.typed" in project["tool"]["setuptools"]["package-data"]["mixprec"]


def test_changelog_names_the_current_version() -> None:
    text = (ROOT / "CHANGELOG.md").read_text()
    assert re.search(rf"^## \[?{re.escape(mixprec.__version__)}\]?", text, re.M), text[:400]
