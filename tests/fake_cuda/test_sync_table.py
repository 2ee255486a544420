"""benchmarks/fake_cuda_syncs.py: host-sync table of docs/gpu.md, one row per path, mixprec beside torch."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from mixprec.float8.config import RECIPE_NAMES
from mixprec.lowbit import RECIPES
from mixprec.optim import METHODS

pytestmark = pytest.mark.skipif(torch.version.cuda is None, reason="needs a CUDA build of torch (fake tier)")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "fake_cuda_syncs.py"


def _script():
    spec = importlib.util.spec_from_file_location("fake_cuda_syncs", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def table(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("syncs") / "syncs.json"
    return _script().main(["--steps", "3", "--json", str(out)])


def _row(table: dict, path: str) -> dict:
    (row,) = [r for r in table["rows"] if r["path"] == path]
    return row


def test_every_recipe_and_method_has_a_row(table: dict) -> None:
    paths = [r["path"] for r in table["rows"]]
    assert all(f"lowbit {name}" in paths for name in RECIPES)
    assert all(any(p.startswith(f"float8 {name},") for p in paths) for name in RECIPE_NAMES)
    assert all(any(p.startswith(f"CompensatedOptimizer({m})") for p in paths) for m in METHODS)


def test_no_path_copies_from_the_host_after_its_first_step(table: dict) -> None:
    assert [r["path"] for r in table["rows"] if r["mixprec"]["h2d_after_first"]] == []


def test_layers_and_scalers_sync_no_more_than_torch(table: dict) -> None:
    for row in table["rows"]:
        if row["path"].startswith(("float8", "lowbit", "GradScaler", "MixedPrecisionOptimizer, no")):
            assert row["mixprec"]["syncs"] <= row["torch"]["syncs"], row
    # the documented extras: the non-finite guard's one read, over torch's loop
    guard = _row(table, "MixedPrecisionOptimizer, dynamic scaler")
    assert guard["mixprec"]["syncs"] == [s + 1 for s in guard["torch"]["syncs"]]
    skip = _row(table, "CompensatedOptimizer(kahan), skip_nonfinite=True")
    assert skip["mixprec"]["syncs"] == [1, 1, 1]


def test_the_markdown_has_a_line_per_row(table: dict) -> None:
    text = _script().markdown(table["rows"])
    assert text.count("\n") == len(table["rows"]) + 1
    assert "| lowbit nvfp4 | 0 | 0 |" in text
