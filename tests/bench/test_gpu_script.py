"""benchmarks/gpu.sh parses, plans within its budget, clamps to it, skips what a missing package needs, and
its dry run (every step on the CPU at toy size) writes gpu.json + gpu.md with each step's results."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu.sh"
STEPS = ["env", "numerics", "lowbit_lm", "plan_cost", "bench", "tests", "precision_paths"]

pytestmark = pytest.mark.skipif(
    shutil.which("bash") is None or shutil.which("timeout") is None, reason="bash"
)


def _run(*args: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("ONLY", "GPU_SH_BUDGET", "GPU_SH_DRY_RUN")}
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**clean, **env},
        check=False,
    )


def _plan(done: subprocess.CompletedProcess) -> tuple[dict[str, str], int]:
    """step -> limit ('-' when skipped) and the printed total, from a --plan output."""
    assert done.returncode == 0, done.stderr
    limits = {}
    for line in done.stdout.splitlines()[1:-1]:
        name, limit = line.split()[:2]
        limits[name] = limit
    total = re.fullmatch(r"total\s+(\d+)\s+\(budget .*", done.stdout.splitlines()[-1])
    assert total, done.stdout
    return limits, int(total.group(1))


def _steps(out: Path) -> dict[str, dict]:
    return {s["name"]: s for s in json.loads((out / "gpu.json").read_text())["steps"]}


def test_gpu_script_parses() -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPT)], check=False).returncode == 0


def test_the_plan_lists_every_step_with_limits_that_fit_the_budget() -> None:
    done = _run("--plan")
    limits, total = _plan(done)
    assert list(limits) == STEPS  # the cheap, most informative first; fp8_lm is gone
    expected = {"env": 25, "numerics": 60, "lowbit_lm": 80, "plan_cost": 60, "bench": 75, "tests": 60}
    assert {k: int(v) for k, v in limits.items()} == {**expected, "precision_paths": 40}
    assert total == sum(int(v) for v in limits.values()) <= 450
    assert "--device cuda" in done.stdout and "--plot <RESULTS_DIR>/plots-large" in done.stdout
    assert not list(ROOT.glob("<RESULTS_DIR>*"))  # a plan writes nothing


def test_the_budget_clamps_the_limits_and_skips_what_does_not_fit() -> None:
    limits, total = _plan(_run("--plan", GPU_SH_BUDGET="100"))
    assert limits["env"] == "25" and limits["numerics"] == "60"
    assert limits["lowbit_lm"] == "10"  # 100 - 5 (the summary) - 85: clamped from 80
    assert all(limits[s] == "-" for s in ("plan_cost", "bench", "tests", "precision_paths"))
    assert total == 95
    done = _run("--plan", "--dry-run", GPU_SH_BUDGET="30")
    assert "numerics              -  skipped: budget: 0 s of 30 left, under 10 s" in done.stdout
    assert "tests                 -  skipped: dry run" in done.stdout  # the dry run's reason wins
    assert _run("--plan", GPU_SH_BUDGET="lots").returncode == 2
    bad = _run("--plan", ONLY="env,fp8_lm")
    assert bad.returncode == 2 and "unknown step 'fp8_lm'" in bad.stderr


def test_a_small_budget_clamps_a_real_run(tmp_path: Path) -> None:
    # 50 s leaves 45 after the summary's 5: numerics is clamped from 60 yet has room on a loaded machine
    # (at a 20 s budget its 15 s ran out under six concurrent processes).
    done = _run("--dry-run", str(tmp_path), timeout=150, GPU_SH_BUDGET="50", ONLY="numerics,precision_paths")
    steps = _steps(tmp_path)
    assert list(steps) == ["numerics", "precision_paths"], done.stderr  # ONLY: nothing else recorded
    assert steps["numerics"]["limit_s"] <= 45 and steps["numerics"]["exit_code"] == 0  # clamped from 60
    last = steps["precision_paths"]
    assert (last["skipped"] or "").startswith("budget") or last["limit_s"] <= 45 - steps["numerics"][
        "seconds"
    ]


def test_a_missing_package_skips_or_trims_the_bench(tmp_path: Path) -> None:
    """gpu.sh reads env.json's packages: no scikit-learn drops cnn/tabular, no matplotlib drops --plot."""

    def env_json(*missing: str) -> None:
        packages = {
            n: {"package": n, "ok": n not in missing, "version": None, "error": "gone"} for n in missing
        }
        (tmp_path / "env.json").write_text(json.dumps({"packages": packages}))

    env_json("sklearn")
    done = _run("--dry-run", str(tmp_path), WORKLOADS="tabular-regression", ONLY="bench")
    assert done.returncode == 0, done.stderr
    assert _steps(tmp_path)["bench"]["skipped"].startswith("scikit-learn is not installed")
    env_json("sklearn", "matplotlib")
    done = _run("--dry-run", str(tmp_path), timeout=120, WORKLOADS="lm,cnn", MODES="fp32", ONLY="bench")
    assert done.returncode == 0, done.stderr
    assert _steps(tmp_path)["bench"]["exit_code"] == 0
    assert "--workload lm --modes fp32" in done.stderr and "--plot" not in done.stderr
    assert {r["workload"] for r in json.loads((tmp_path / "bench-tiny.json").read_text())} == {"lm"}


def test_gpu_script_dry_run_runs_every_step_and_writes_one_json_and_markdown_tables(tmp_path: Path) -> None:
    env = {"MODES": "fp32", "WORKLOADS": "tabular-regression"}
    done = _run("--dry-run", str(tmp_path), timeout=300, **env)
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "gpu.json").read_text())
    steps = {s["name"]: s for s in summary["steps"]}
    assert list(steps) == STEPS
    assert steps["tests"]["skipped"].startswith("dry run")
    assert all(steps[s]["exit_code"] == 0 and steps[s]["limit_s"] > 0 for s in STEPS if s != "tests")
    assert sum(s["limit_s"] for s in steps.values()) <= 450
    assert [r["mode"] for r in summary["bench"]["tiny"]] == ["fp32"]
    assert {r["format"] for r in summary["plan_cost"]["results"]} == {"fp8_rowwise", "bf16"}
    assert summary["env"]["packages"]["pytest"]["ok"] and summary["env"]["device"] is None
    assert {r["recipe"] for r in summary["numerics"]["rows"]} >= {"fp8_rowwise", "mxfp8", "nvfp4"}
    assert all(r["passed"] for r in summary["numerics"]["rows"] if r["path"] != "hp")
    assert list(summary["lowbit_lm"]["modes"]) == ["bf16", "fp8_rowwise", "nvfp4"]
    assert {r["path"] for r in summary["precision_paths"]["rows"]} >= {"fp32", "optimi-kahan", "O2"}
    table = (tmp_path / "gpu.md").read_text()
    assert "| tests | skipped | - | 0 | 60 | dry run: the CUDA tests need a GPU |" in table
    for heading in ("machine and packages", "lowbit_mm vs emulated_mm", "low-bit recipes against bf16"):
        assert f"## {heading}" in table
    assert "## measured GEMM cost per format" in table and "## precision paths" in table
    assert "| nvfp4 | wgrad | emulated | 0.00e+00 | ok |" in table
    assert "## mixprec bench --size tiny" in table and "| tabular-regression | fp32 |" in table


def test_the_old_dry_run_variable_still_means_dry_run() -> None:
    done = _run("--plan", GPU_SH_DRY_RUN="1")
    assert "--device cpu" in done.stdout and "--device cuda" not in done.stdout
