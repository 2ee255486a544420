"""benchmarks/gpu.sh parses, and its dry run (the bench on the CPU, size tiny) writes gpu.json + gpu.md."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu.sh"

pytestmark = pytest.mark.skipif(
    shutil.which("bash") is None or shutil.which("timeout") is None, reason="bash"
)


def test_gpu_script_parses() -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPT)], check=False).returncode == 0


def test_gpu_script_dry_run_writes_one_json_and_a_markdown_table(tmp_path: Path) -> None:
    env = {**os.environ, "GPU_SH_DRY_RUN": "1", "MODES": "fp32", "WORKLOADS": "tabular-regression"}
    done = subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "gpu.json").read_text())
    assert [s["name"] for s in summary["steps"]][:2] == ["tests", "bench-tiny"]
    assert summary["steps"][0]["skipped"].startswith("dry run")
    assert summary["steps"][1]["exit_code"] == 0
    assert [r["mode"] for r in summary["bench"]["tiny"]] == ["fp32"]
    step = next(s for s in summary["steps"] if s["name"] == "plan_cost")
    assert step["exit_code"] == 0  # the dry run times two formats' measured cost on the CPU
    assert {r["format"] for r in summary["plan_cost"]["results"]} == {"fp8_rowwise", "bf16"}
    table = (tmp_path / "gpu.md").read_text()
    assert "## mixprec bench --size tiny" in table and "| tabular-regression | fp32 |" in table
