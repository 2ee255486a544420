"""benchmarks/lowbit_lm.py runs, keeps 4-bit recipes' first and last Linear in bf16, writes its JSON."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from torch import nn

from mixprec.lowbit import LowbitLinear

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "lowbit_lm.py"


def _script():
    spec = importlib.util.spec_from_file_location("lowbit_lm", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_four_bit_recipes_end_in_bf16_and_fp8_converts_everything() -> None:
    script = _script()
    for mode, expected in (("nvfp4 sr=off", [False, True, True, False]), ("mxfp8", [True] * 4)):
        model = nn.Sequential(*(nn.Linear(32, 32) for _ in range(4)))
        script._convert(mode, model, seed=0)
        assert [isinstance(m, LowbitLinear) for m in model] == expected


def test_the_classification_run_writes_every_mode(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    results = _script().main(
        ["--task", "classify", "--steps", "4", "--modes", "nvfp4,mxfp8", "--json", str(out)]
    )
    assert list(results["modes"]) == ["bf16", "nvfp4", "mxfp8"]  # bf16, the reference, is always run
    written = json.loads(out.read_text())
    assert written["modes"]["nvfp4"]["val_loss"][0] > 0 and written["seeds"] == [0]


def test_runs_made_apart_combine_into_one_table_and_disagreeing_references_are_refused() -> None:
    script = _script()
    argv = ["--task", "classify", "--steps", "3"]
    a = script.main([*argv, "--modes", "fp8_rowwise", "--seeds", "0"])
    b = script.main([*argv, "--modes", "mxfp8", "--seeds", "0"])
    c = script.main([*argv, "--modes", "mxfp8", "--seeds", "1"])
    joined = script.combine([a, b])
    assert list(joined["modes"]) == ["bf16", "fp8_rowwise", "mxfp8"] and joined["seeds"] == [0]
    assert joined["modes"]["mxfp8"]["val_loss"] == b["modes"]["mxfp8"]["val_loss"]
    with pytest.raises(ValueError, match="mode 'fp8_rowwise' ran seeds \\[0\\], bf16 ran \\[0, 1\\]"):
        script.combine([a, b, c])
    bad = json.loads(json.dumps(b))
    bad["modes"]["bf16"]["val_loss"][0] += 1e-6
    with pytest.raises(ValueError, match="seed 0: bf16 references differ"):
        script.combine([a, bad])
    with pytest.raises(ValueError, match="one task, steps and device"):
        script.combine([a, script.main([*argv[:3], "4", "--modes", "mxfp8"])])
