"""benchmarks/gpu.sh parses, plans within its budget, clamps to it, skips what a missing package needs, and
its dry run (every step on the CPU at toy size) writes gpu.json + gpu.md with each step's results."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu.sh"
STEPS = [
    "env",
    "numerics",
    "tests",
    "distributed",
    "fp8",
    "bench",
    "lowbit_lm",
    "plan_cost",
    "precision_paths",
    "optim",
]
LIMITS = {"env": 15, "numerics": 20, "tests": 40, "distributed": 25, "fp8": 105, "bench": 55, "lowbit_lm": 30}
LIMITS.update(plan_cost=20, precision_paths=20, optim=25)

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
    assert list(limits) == STEPS  # the cheap, most informative first
    assert {k: int(v) for k, v in limits.items()} == LIMITS
    assert total == sum(LIMITS.values()) <= 360 - 5  # six minutes, 5 s of it for the summary
    assert "(budget 360 s, 5 s kept for the summary)" in done.stdout
    assert "--device cuda" in done.stdout and "gpu_fp8.py --device cuda --budget-s 90" in done.stdout
    assert "--time 38s" in done.stdout and "--plot" not in done.stdout  # the bench fits itself; no pictures
    assert "gpu_distributed.py --device cuda --steps 8" in done.stdout
    assert "optimizer_speed.py --device cuda --budget-s 22 " in done.stdout  # stops 3 s before its limit
    assert not list(ROOT.glob("<RESULTS_DIR>*"))  # a plan writes nothing


def test_the_budget_clamps_the_limits_and_skips_what_does_not_fit() -> None:
    done = _run("--plan", GPU_SH_BUDGET="115")
    limits, total = _plan(done)
    assert [limits[s] for s in ("env", "numerics", "tests", "distributed")] == ["15", "20", "40", "25"]
    assert limits["fp8"] == "10"  # 115 - 5 (the summary) - 100: clamped from 105, its own budget with it
    assert "--budget-s 5 " in done.stdout and "(clamped from 105 to the budget)" in done.stdout
    assert all(limits[s] == "-" for s in ("bench", "lowbit_lm", "plan_cost", "precision_paths", "optim"))
    assert total == 110
    done = _run("--plan", "--dry-run", GPU_SH_BUDGET="30")
    assert "numerics             10  " in done.stdout  # 30 - 5 - 15: clamped from 20
    assert "distributed           -  skipped: budget: 0 s of 30 left, under 10 s" in done.stdout
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
    """gpu.sh reads env.json's packages: no scikit-learn drops cnn/tabular, no matplotlib PLOT=1's --plot."""

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
    done = _run(
        "--dry-run", str(tmp_path), timeout=120, WORKLOADS="lm,cnn", MODES="fp32", ONLY="bench", PLOT="1"
    )
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
    assert sum(s["limit_s"] for s in steps.values()) <= 355 and summary["partial"] == {}
    assert [r["case"] for r in summary["distributed"]["rows"] if r["passed"]] == [
        "ddp_amp", "ddp_fp8_comm", "fsdp2_fp8"
    ]  # fmt: skip
    fp8 = {(r["config"], r["compiled"]): r for r in summary["fp8"]["rows"]}
    assert set(fp8) == {
        (c, m) for c in ("bf16", "mixprec tensorwise", "torchao rowwise") for m in (False, True)
    }
    assert all(r.get("step_ms", 0) > 0 or "skipped" in r for r in fp8.values())  # torchao may be missing
    assert {g["format"] for g in summary["fp8"]["gemm"]} >= {"bf16", "fp8_tensorwise", "fp8_blockwise"}
    quant = {(q["format"], q["path"]): q for q in summary["fp8"]["quantize"]}  # the CPU: pure torch only
    assert all(quant[f, "pure torch"]["median_ms"] > 0 for f in ("fp8_tensorwise", "fp8_blockwise_2d"))
    assert quant["fp8_rowwise", "fused"]["skipped"].startswith("not eligible on cpu")
    assert [r["mode"] for r in summary["bench"]["tiny"]] == ["fp32"]
    assert {r["format"] for r in summary["plan_cost"]["results"]} == {"fp8_rowwise", "bf16"}
    assert summary["env"]["packages"]["pytest"]["ok"] and summary["env"]["device"] is None
    assert {r["recipe"] for r in summary["numerics"]["rows"]} >= {"fp8_rowwise", "mxfp8", "nvfp4"}
    assert all(r["passed"] for r in summary["numerics"]["rows"] if r["path"] != "hp")
    assert list(summary["lowbit_lm"]["modes"]) == ["bf16", "fp8_rowwise", "nvfp4"]
    assert {r["path"] for r in summary["precision_paths"]["rows"]} >= {"fp32", "optimi-kahan", "O2"}
    optim = {r["config"]: r for r in summary["optim"]["rows"]}
    assert set(optim) == {
        "torch-fused", "mixprec-kahan", "mixprec-stochastic", "optimi-kahan", "mixprec-int8"
    }  # fmt: skip
    assert all(r["median_ms"] > 0 and len(r["rounds_ms"]) == 2 for r in optim.values())
    assert optim["torch-fused"]["vs_torch_fused"] == 1.0 and summary["optim"]["partial"] is None
    table = (tmp_path / "gpu.md").read_text()
    assert "| tests | skipped | - | 0 | 40 | dry run: the CUDA tests need a GPU |" in table
    for heading in (
        "machine and packages",
        "lowbit_mm vs emulated_mm",
        "low-bit recipes against bf16",
        "DDP and FSDP2",
        "fp8 training speed",
    ):
        assert f"## {heading}" in table
    assert "## measured GEMM cost per format" in table and "## precision paths" in table
    assert "## optimizer step time on bf16 parameters" in table and "| mixprec-kahan |" in table
    assert "| nvfp4 | wgrad | emulated | 0.00e+00 | ok |" in table
    assert "## mixprec bench --size tiny" in table and "| tabular-regression | fp32 |" in table


def test_the_old_dry_run_variable_still_means_dry_run() -> None:
    done = _run("--plan", GPU_SH_DRY_RUN="1")
    assert "--device cpu" in done.stdout and "--device cuda" not in done.stdout


def _history(ms: float, rounds: int = 3, per_round: int = 20) -> list[dict]:
    return [
        {"step": r * per_round + i, "round": r, "loss": 4.0 - 0.01 * i, "scale": None, "skipped": False,
         "step_time_ms": ms}
        for r in range(rounds)
        for i in range(per_round)
    ]  # fmt: skip


def test_the_summary_tabulates_what_steps_cut_short_kept_and_marks_it_partial(tmp_path: Path) -> None:
    """A step that ran out of time: its file (with or without its own "partial" reason) is tabulated under
    a PARTIAL heading; a bench without its JSON is tabulated from the step log the bench rewrites after
    every round, with the bench's statistics (the first round of 20 steps is the large preset's warm-up)."""
    from mixprec.bench.report import write_log
    from mixprec.bench.schedule import Running

    rows = "numerics\t124\t20\t20\nfp8\t124\t105\t105\nbench\t124\t80\t80\n"
    (tmp_path / "steps.tsv").write_text(rows)
    numerics = {"meta": {"shape": [8, 8, 8], "device": "cuda"}, "rows": [
        {"recipe": "fp8_rowwise", "gemm": "fprop", "path": "fp8_rowwise", "rel_error": 1e-4, "passed": True}
    ]}  # fmt: skip
    (tmp_path / "numerics.json").write_text(json.dumps(numerics))
    fp8 = {
        "meta": {"layers": 2, "width": 4096, "context": 2048, "batch": 4, "rounds": 5, "device": "cuda"},
        "rows": [{"config": "bf16", "compiled": False, "step_ms": 50.0, "step_ms_range": [49.0, 51.0],
                  "vs_bf16": 1.0, "vs_bf16_range": [1.0, 1.0], "rounds": 5, "warmup_s": 1.0,
                  "graph_breaks": None, "transient_gib": 2.5}],
        "gemm": [],
        "partial": "stopped by SIGTERM (the step's time limit) after 103 s",
    }  # fmt: skip
    (tmp_path / "fp8.json").write_text(json.dumps(fp8))
    running = [Running("lm", mode, _history(ms)) for mode, ms in (("fp32", 10.0), ("mixprec-bf16", 5.0))]
    write_log([], tmp_path / "bench-large-steps.jsonl", 3, running)
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_summary.py"), str(tmp_path), "300", "360"],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, check=False,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr  # the steps timed out
    table = (tmp_path / "gpu.md").read_text()
    assert (
        "(gemm_numerics.py) (PARTIAL: the step ran out of its 20 s; the file holds what it wrote before)"
        in table
    )
    assert "(gpu_fp8.py) (PARTIAL: stopped by SIGTERM (the step's time limit) after 103 s)" in table
    assert "| bf16 | eager | 50.00 [49.00-51.00] | 1.000 [1.000-1.000] | 2.50 | 1.0 | 5 |" in table
    heading = (
        "## mixprec bench --size large, from its step log (PARTIAL: 0 of 3 runs finished, 2 stopped while"
    )
    assert heading in table
    assert "| lm | mixprec-bf16 | 60 | 2 | 5.0 | 5.0-5.0 | 2.00 | 3.8100 |" in table
    summary = json.loads((tmp_path / "gpu.json").read_text())
    assert set(summary["partial"]) == {"numerics", "fp8"}
    assert [r["mode"] for r in summary["bench_log"]["large"]["rows"]] == ["fp32", "mixprec-bf16"]


def test_a_step_stopped_by_its_time_limit_keeps_its_measurements(tmp_path: Path) -> None:
    """The real path: `timeout` sends SIGTERM at the limit; lowbit_lm writes the step times it has."""
    env = {"ONLY": "lowbit_lm", "LOWBIT_STEPS": "1000000", "LIMIT_LOWBIT_LM": "25"}
    done = _run("--dry-run", str(tmp_path), timeout=120, **env)
    step = _steps(tmp_path)["lowbit_lm"]
    assert step["timed_out"] and done.returncode == 1, done.stderr[-2000:]
    written = json.loads((tmp_path / "lowbit_lm.json").read_text())
    assert written["partial"].startswith("stopped by SIGTERM (the step's time limit) during step ")
    assert all(m["step_s_median"] > 0 and m["val_loss"] is None for m in written["modes"].values())
    assert (
        "## low-bit recipes against bf16 (lowbit_lm.py) (PARTIAL: stopped by SIGTERM"
        in (tmp_path / "gpu.md").read_text()
    )
