"""benchmarks/torchao_float8_suite.py substitutes mixprec for torchao's public float8 API, tells the tests
that use that API from the rest, opens the GPU gates in its CPU copy, and counts what fails on one side."""

from __future__ import annotations

import importlib.util
import json
import warnings
from pathlib import Path

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip("torchao.float8")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "torchao_float8_suite.py"
# A stand-in for one of torchao's test files: one test of the public API whose assertion only torchao's
# module meets, one torchao gates on a GPU, one that touches nothing of the API.
FAKE_TESTS = """
import torch
from torchao.float8.config import Float8LinearConfig
from torchao.float8.float8_linear_utils import convert_to_float8_training


def test_api_module_is_torchaos():
    model = torch.nn.Sequential(torch.nn.Linear(16, 16))
    model = convert_to_float8_training(model, config=Float8LinearConfig(emulate=True))
    assert type(model[0]).__module__.startswith("torchao")


def test_gpu_gate():
    assert torch.accelerator.is_available()


def test_plain():
    assert torch.ones(1).item() == 1.0
"""


def _script():
    spec = importlib.util.spec_from_file_location("torchao_float8_suite", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_harness_substitutes_mixprec_and_counts_each_side(tmp_path: Path) -> None:
    (tmp_path / "test_fake.py").write_text(FAKE_TESTS)
    out = tmp_path / "suite.json"
    argv = ["--ao-tests", str(tmp_path), "--files", "test_fake.py", "--force-cpu", "--json", str(out)]
    assert _script().main(argv) == 0
    variants = json.loads(out.read_text())["variants"]
    for name, gate in (("plain", "failed"), ("cpu", "passed")):
        outcomes = variants[name]["outcomes"]
        assert outcomes["torchao"]["test_fake.py"]["test_api_module_is_torchaos"] == "passed [api]"
        assert outcomes["mixprec"]["test_fake.py"]["test_api_module_is_torchaos"].startswith("failed: ")
        assert outcomes["mixprec"]["test_fake.py"]["test_api_module_is_torchaos"].endswith("[api]")
        for mode in ("torchao", "mixprec"):
            assert outcomes[mode]["test_fake.py"]["test_gpu_gate"].startswith(gate), (name, mode)
            assert outcomes[mode]["test_fake.py"]["test_plain"] == "passed"
        summary = variants[name]["summary"]
        assert summary["files"]["test_fake.py"]["api_tests"] == 1
        assert [r["test"] for r in summary["torchao_only_passes"]] == ["test_api_module_is_torchaos"]


def test_the_cpu_copy_rewrites_only_what_it_says() -> None:
    script = _script()
    text = "if torch.accelerator.is_available():\n    d = torch.accelerator.current_accelerator()\n"
    assert script.force_cpu(text, "test_base.py") == 'if True:\n    d = torch.device("cpu")\n'
    with pytest.raises(SystemExit, match="no longer holds 'dim=4096,'"):
        script.force_cpu(text, "test_numerics_integration.py")
