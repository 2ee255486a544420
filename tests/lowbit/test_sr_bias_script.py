"""benchmarks/sr_bias.py runs, its old rule is the clamping one (so its before/after is honest), and the
rule switch is undone after each use."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

from mixprec.lowbit import quantize

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "sr_bias.py"


def _script():
    spec = importlib.util.spec_from_file_location("sr_bias", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_old_rule_clamps_block_maxima_and_is_undone() -> None:
    script = _script()
    x = script.tensors()["outliers 64x256"]
    g = torch.Generator().manual_seed(0)
    new = quantize(x, "mxfp4", stochastic=True, generator=g).scale.view(torch.uint8)
    with script.old_rule():
        old = quantize(x, "mxfp4", stochastic=True, generator=g).scale.view(torch.uint8)
    assert torch.equal(old, quantize(x, "mxfp4").scale.view(torch.uint8))  # the nearest (floor) scale
    assert torch.equal(quantize(x, "mxfp4", stochastic=True, generator=g).scale.view(torch.uint8), new)
    assert not torch.equal(old, new)


def test_the_script_shows_the_bias_and_writes_its_json(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    args = [
        "--draws",
        "8",
        "--seeds",
        "0",
        "1",
        "--lm-steps",
        "0",
        "--teacher-steps",
        "2",
        "--json",
        str(out),
    ]
    results = _script().main(args)
    for name in ("nvfp4", "mxfp4"):
        rules = results["bias"]["binades 96x512"][name]
        assert rules["old SR"]["maxima"][0] < -0.5 < rules["new SR"]["maxima"][0] < 0.5
    written = json.loads(out.read_text())
    assert list(written["training"]) == ["teacher"] and len(written["training"]["teacher"]["new"]) == 2
