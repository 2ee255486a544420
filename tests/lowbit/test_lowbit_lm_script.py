"""benchmarks/lowbit_lm.py runs, keeps 4-bit recipes' first and last Linear in bf16, writes its JSON."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

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
