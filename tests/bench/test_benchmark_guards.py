"""The GPU check's benchmarks on the CPU: gemm_numerics covers every recipe and catches a wrong kernel; one
recipe that raises costs lowbit_lm, plan_cost and gemm_numerics only its own rows; precision_paths runs
in-process as a fresh process does and skips torch-optimi's rows without it."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import mixprec.plan.cost as plan_cost_lib
from mixprec.lowbit import RECIPES, Recipe

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# gemm_numerics


def test_numerics_covers_every_recipe_and_gemm_and_a_new_recipe_too(tmp_path: Path, monkeypatch) -> None:
    numerics = _script("gemm_numerics")
    extra = Recipe("mxfp8_floor", "mxfp8_floor", "fp8_rowwise", "fp8_rowwise", "hp", "hp")
    monkeypatch.setitem(numerics.RECIPES, "test_extra", extra)
    out = tmp_path / "n.json"
    assert numerics.main(["--device", "cpu", "--shape", "16,64,32", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["recipe"], r["gemm"]) for r in rows} == {
        (name, gemm) for name in [*RECIPES, "test_extra"] for gemm in ("fprop", "dgrad", "wgrad")
    }
    by = {(r["recipe"], r["gemm"]): r for r in rows}
    assert by[("test_extra", "wgrad")]["path"] == "hp"  # a high-precision operand: nothing to compare
    assert by[("test_extra", "dgrad")]["formats"] == ["fp8_rowwise", "fp8_rowwise"]
    quantized = [r for r in rows if r["path"] != "hp"]
    assert quantized and all(r["passed"] and r["rel_error"] <= 2**-6 for r in quantized)


def test_numerics_fails_a_kernel_that_reads_the_scales_wrong(monkeypatch, capsys) -> None:
    numerics = _script("gemm_numerics")
    right = numerics.lowbit_mm
    monkeypatch.setattr(numerics, "lowbit_mm", lambda a, b, dtype: right(a, b, dtype) * (1 + 2**-5))
    assert numerics.main(["--device", "cpu", "--shape", "16,64,32"]) == 1
    rows = numerics.run(torch.device("cpu"), (16, 64, 32))
    assert all(not r["passed"] for r in rows if r["path"] != "hp")
    assert abs(max(r["rel_error"] for r in rows if r["path"] != "hp") - 2**-5) < 1e-6


def test_numerics_keeps_the_other_recipes_when_one_raises(monkeypatch) -> None:
    numerics = _script("gemm_numerics")
    real = numerics.quantize

    def quantize(x, fmt, **kw):
        if fmt == "mxfp4":
            raise RuntimeError("no mxfp4 here")
        return real(x, fmt, **kw)

    monkeypatch.setattr(numerics, "quantize", quantize)
    rows = numerics.run(torch.device("cpu"), (16, 64, 32))
    broken = [r for r in rows if r["recipe"] == "mxfp4"]
    assert broken == [
        {"recipe": "mxfp4", "gemm": None, "error": "RuntimeError: no mxfp4 here", "passed": False}
    ]
    assert {r["recipe"] for r in rows if r.get("passed")} == set(RECIPES) - {"mxfp4"}
    assert numerics.main(["--device", "cpu", "--shape", "16,64,32"]) == 1


def test_numerics_cut_short_keeps_the_recipes_it_checked(tmp_path: Path, monkeypatch) -> None:
    numerics = _script("gemm_numerics")
    real, calls = numerics.check_recipe, []

    def check_then_time_out(recipe, shape, device):
        calls.append(recipe)
        if len(calls) == 3:
            raise KeyboardInterrupt  # what a time limit's SIGTERM does (benchmarks/checkpoint.py)
        return real(recipe, shape, device)

    monkeypatch.setattr(numerics, "check_recipe", check_then_time_out)
    out = tmp_path / "n.json"
    with pytest.raises(KeyboardInterrupt):
        numerics.main(["--device", "cpu", "--shape", "16,64,32", "--json", str(out)])
    written = json.loads(out.read_text())
    assert written["partial"] == f"running: 2 of {len(RECIPES)} recipes"
    assert [r["recipe"] for r in written["rows"]] == [name for name in list(RECIPES)[:2] for _ in range(3)]


def test_numerics_refuses_a_bad_shape() -> None:
    with pytest.raises(SystemExit):
        _script("gemm_numerics").main(["--shape", "16,64"])


# lowbit_lm


def test_lowbit_lm_keeps_going_past_a_recipe_that_fails_to_build_or_to_step(
    tmp_path: Path, monkeypatch
) -> None:
    script = _script("lowbit_lm")
    convert = script.convert_to_lowbit_training

    def convert_or_fail(model, recipe, **kw):
        if recipe == RECIPES["mxfp8"]:
            raise RuntimeError("mxfp8 cannot convert")
        return convert(model, recipe, **kw)

    monkeypatch.setattr(script, "convert_to_lowbit_training", convert_or_fail)
    step = script.Run.step

    def step_or_fail(run) -> None:
        if run.mode == "fp8_rowwise" and len(run.losses) == 1:
            raise RuntimeError("fp8_rowwise blew up in step 2")
        step(run)

    monkeypatch.setattr(script.Run, "step", step_or_fail)
    out = tmp_path / "r.json"
    argv = ["--task", "classify", "--steps", "3", "--modes", "fp8_rowwise,mxfp8,nvfp4", "--json", str(out)]
    results = script.main(argv)
    assert list(results["modes"]) == ["bf16", "nvfp4"]
    assert results["errors"] == {
        "mxfp8": "RuntimeError: mxfp8 cannot convert",
        "fp8_rowwise": "RuntimeError: fp8_rowwise blew up in step 2",
    }
    written = json.loads(out.read_text())
    assert written["errors"] == results["errors"] and written["modes"]["nvfp4"]["val_loss"][0] > 0


def test_lowbit_lm_stopped_by_a_time_limit_keeps_the_step_times_so_far(tmp_path: Path, monkeypatch) -> None:
    script = _script("lowbit_lm")
    step = script.Run.step

    def step_until_sigterm(run) -> None:
        if len(run.losses) == 5:
            raise KeyboardInterrupt(script.STOPPED)  # the SIGTERM handler's exception, in step 6
        step(run)

    monkeypatch.setattr(script.Run, "step", step_until_sigterm)
    out = tmp_path / "r.json"
    argv = ["--task", "classify", "--steps", "9", "--modes", "fp8_rowwise", "--save-every", "2"]
    with pytest.raises(SystemExit) as stopped:
        script.main([*argv, "--json", str(out)])
    assert stopped.value.code == 124  # timeout's own code for a command it stopped
    written = json.loads(out.read_text())
    assert written["partial"] == "stopped by SIGTERM (the step's time limit) during step 6 of 9"
    assert list(written["modes"]) == ["bf16", "fp8_rowwise"]
    for mode in written["modes"].values():
        assert mode["val_loss"] is None and mode["steps_done"] == 5 and mode["step_s_median"] > 0


def test_lowbit_lm_writes_its_json_as_it_goes_and_marks_the_end(tmp_path: Path, monkeypatch) -> None:
    script = _script("lowbit_lm")
    seen = []
    monkeypatch.setattr(script, "write_json", lambda path, data, partial: seen.append(partial))
    script.main(["--task", "classify", "--steps", "5", "--modes", "bf16", "--save-every", "2", "--json", "x"])
    assert seen == ["running: 2 of 5 steps", "running: 4 of 5 steps", None]


# plan_cost


def test_plan_cost_records_a_failing_format_and_keeps_the_others(monkeypatch) -> None:
    script = _script("plan_cost")
    real = plan_cost_lib.swapped_in

    class Broken(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("mxfp4 kernel refused")

    def swapped_in(linear, fmt, gen):
        return Broken() if fmt == "mxfp4" else real(linear, fmt, gen)

    monkeypatch.setattr(plan_cost_lib, "swapped_in", swapped_in)
    args = argparse.Namespace(device="cpu", warmup=0, repeats=2)
    shapes = [("extra", (16, 32, 64)), ("extra", (8, 32, 32))]
    rows, name = script.measure(shapes, ["fp8_rowwise", "mxfp4", "bf16"], args)
    assert name == "measured:cpu" and len(rows) == 6
    for row in rows:
        if row["format"] == "mxfp4":
            assert row["error"] == "RuntimeError: mxfp4 kernel refused" and "median_s" not in row
        else:
            assert "error" not in row and row["median_s"] > 0 and len(row["samples_s"]) == 2
            assert row["relative_to_bf16"] == pytest.approx(row["median_s"] / next(
                r["median_s"] for r in rows if r["format"] == "bf16" and r["shape"] == row["shape"]
            ))  # fmt: skip
    bf16_too = script.measure(shapes[:1], ["fp8_rowwise", "mxfp4"], args)[0]
    monkeypatch.setattr(
        plan_cost_lib, "swapped_in", lambda lin, fmt, g: Broken() if fmt == "bf16" else real(lin, fmt, g)
    )
    no_reference = script.measure(shapes[:1], ["fp8_rowwise", "bf16"], args)[0]
    assert [r["format"] for r in bf16_too] == ["fp8_rowwise", "mxfp4"]
    assert no_reference[0]["median_s"] > 0 and no_reference[0]["relative_to_bf16"] is None
    assert "error" in no_reference[1]


def test_plan_cost_cut_short_keeps_the_shapes_it_measured(tmp_path: Path, monkeypatch) -> None:
    script = _script("plan_cost")
    monkeypatch.setattr(script, "workload_shapes", lambda: {"lm": [(8, 16, 32), (8, 32, 16)]})
    measure, calls = script.measure, []

    def measure_then_time_out(shapes, formats, args):
        calls.append(shapes)
        if len(calls) == 2:
            raise KeyboardInterrupt  # what a time limit's signal does to the second shape
        return measure(shapes, formats, args)

    monkeypatch.setattr(script, "measure", measure_then_time_out)
    out = tmp_path / "c.json"
    with pytest.raises(KeyboardInterrupt):
        script.main(["--formats", "fp8_rowwise", "--repeats", "1", "--json", str(out)])
    written = json.loads(out.read_text())
    assert (written["meta"]["shapes_done"], written["meta"]["shapes_planned"]) == (1, 2)
    assert [(r["shape"], r["format"]) for r in written["results"]] == [
        ([8, 16, 32], "fp8_rowwise"),
        ([8, 16, 32], "bf16"),
    ]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_plan_cost_runs_a_recipes_high_precision_gemm_in_the_layers_dtype(dtype, capsys) -> None:
    """``--dtype bfloat16``: rowwise_gw_hp's weight-gradient GEMM (the one torch.mm with an (N, K) result)
    runs in bf16 as the bf16 reference does, not in float32; fp32 is left out of a bf16 run's formats."""
    from torch.utils._python_dispatch import TorchDispatchMode

    script = _script("plan_cost")
    seen: list[tuple[torch.dtype, tuple[int, ...]]] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.mm.default:
                seen.append((args[0].dtype, tuple(out.shape)))
            return out

    args = argparse.Namespace(device="cpu", warmup=0, repeats=1, dtype=dtype)
    rows, _ = script.measure([("extra", (16, 32, 64))], ["fp8_rowwise_gw_hp"], args)
    assert "error" not in rows[0] and [r["format"] for r in rows] == ["fp8_rowwise_gw_hp"]
    cost = plan_cost_lib.MeasuredCost("cpu", script._dtype(args), ["fp8_rowwise_gw_hp"], warmup=0, repeats=1)
    with Record():  # the layer measure() times, alone (measure times the bf16 reference too)
        cost("fp8_rowwise_gw_hp", 16, 32, 64)
    wgrad = {d for d, shape in seen if shape == (32, 64)}  # (N, K): the weight gradient
    assert wgrad == {getattr(torch, dtype)}
    if dtype == "bfloat16":
        with pytest.raises(SystemExit):
            script.main(["--dtype", "bfloat16", "--formats", "fp8_rowwise,fp32"])
        assert "--formats fp32 needs --dtype float32" in capsys.readouterr().err


# precision_paths

PATHS_ARGV = ["--widths", "16", "--depth", "1", "--steps", "2", "--warmup", "1", "--rounds", "1"]


def test_precision_paths_skips_optimi_rows_without_torch_optimi(tmp_path: Path, monkeypatch) -> None:
    script = _script("precision_paths")
    monkeypatch.setitem(sys.modules, "optimi", None)  # import optimi raises ImportError
    out = tmp_path / "p.json"
    script.main(
        [*PATHS_ARGV, "--in-process", "--paths", "fp32,optimi-kahan,bf16-true+kahan", "--json", str(out)]
    )
    written = json.loads(out.read_text())
    assert [r["path"] for r in written["rows"]] == ["fp32", "bf16-true+kahan"]
    assert "torch-optimi is not installed" in written["skipped"]["optimi-kahan"]
    assert all(r["vs_optimi"] is None and r["peak_mib"] is None for r in written["rows"])  # in-process CPU


def test_precision_paths_in_process_measures_what_a_fresh_process_does(tmp_path: Path) -> None:
    script = _script("precision_paths")
    runs = {}
    for where in ("fresh", "in-process"):
        out = tmp_path / f"{where}.json"
        flags = ["--in-process"] if where == "in-process" else []
        script.main([*PATHS_ARGV, *flags, "--paths", "optimi-kahan,bf16-true+kahan", "--json", str(out)])
        runs[where] = json.loads(out.read_text())["runs"]
    exact = ("path", "width", "params", "tensor_bytes", "scratch_bytes")
    assert [{k: r[k] for k in exact} for r in runs["fresh"]] == [
        {k: r[k] for k in exact} for r in runs["in-process"]
    ]
    assert all(r["peak_mib"] is not None for r in runs["fresh"])
    assert all(r["peak_mib"] is None for r in runs["in-process"])


def test_precision_paths_keeps_the_others_when_a_path_raises_and_writes_after_each_run(
    tmp_path: Path, monkeypatch
) -> None:
    script = _script("precision_paths")
    build = script.build

    def build_or_fail(path, *args, **kwargs):
        if path == "bf16-true+kahan":
            raise RuntimeError("Expected all tensors to be on the same device")
        return build(path, *args, **kwargs)

    monkeypatch.setattr(script, "build", build_or_fail)
    out = tmp_path / "p.json"
    argv = [*PATHS_ARGV, "--rounds", "2", "--in-process", "--paths", "fp32,optimi-kahan,bf16-true+kahan"]
    assert script.main([*argv, "--json", str(out)]) == 1
    written = json.loads(out.read_text())
    assert written["partial"] is None and [r["path"] for r in written["rows"]] == ["fp32", "optimi-kahan"]
    assert written["errors"] == {
        "bf16-true+kahan width 16 beta2 0.999": "RuntimeError: Expected all tensors to be on the same device"
    }
    assert [r["round"] for r in written["runs"]] == [0, 0, 1, 1]  # the failed path is not retried


def test_precision_paths_stopped_by_a_time_limit_keeps_the_runs_it_finished(
    tmp_path: Path, monkeypatch
) -> None:
    script = _script("precision_paths")
    run, calls = script._run, []

    def run_then_stop(args, path, width, beta2):
        calls.append(path)
        if len(calls) == 3:
            raise KeyboardInterrupt(script.STOPPED)
        return run(args, path, width, beta2)

    monkeypatch.setattr(script, "_run", run_then_stop)
    out = tmp_path / "p.json"
    argv = [*PATHS_ARGV, "--rounds", "2", "--in-process", "--paths", "fp32,optimi-kahan", "--json", str(out)]
    assert script.main(argv) == 124
    written = json.loads(out.read_text())
    assert written["partial"] == "stopped by SIGTERM (the step's time limit) after 2 of 4 runs"
    assert [(r["path"], r["round"]) for r in written["runs"]] == [("fp32", 0), ("optimi-kahan", 0)]


# gpu_distributed


def test_gpu_distributed_trains_ddp_and_fsdp2_on_one_gloo_rank(tmp_path: Path) -> None:
    script = _script("gpu_distributed")
    out = tmp_path / "d.json"
    before = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    assert script.main(["--device", "cpu", "--steps", "4", "--json", str(out)]) == 0
    written = json.loads(out.read_text())
    assert written["partial"] is None and written["meta"]["backend"] == "gloo"
    rows = {r["case"]: r for r in written["rows"]}
    assert list(rows) == ["ddp_amp", "ddp_fp8_comm", "fsdp2_fp8"] and all(r["passed"] for r in rows.values())
    assert rows["ddp_amp"]["bitwise"] and rows["ddp_amp"]["losses"] == rows["ddp_amp"]["twin_losses"]
    assert rows["fsdp2_fp8"]["unsharded_weights"] == ["Float8GatheredWeight"]
    assert {k: os.environ.get(k) for k in before} == before  # the rendezvous variables are put back
    assert not torch.distributed.is_initialized()


def test_gpu_distributed_fails_a_bf16_all_gather_and_keeps_going_past_a_case_that_raises(
    tmp_path: Path, monkeypatch
) -> None:
    script = _script("gpu_distributed")
    real_config = script.Float8Config
    monkeypatch.setattr(script, "Float8Config", lambda **kw: real_config())  # fp8 all-gather left off

    def broken(args, device):
        raise RuntimeError("NCCL error: unhandled system error")

    monkeypatch.setitem(script.RUNS, "ddp_amp", broken)
    out = tmp_path / "d.json"
    assert script.main(["--device", "cpu", "--steps", "3", "--json", str(out)]) == 1
    rows = {r["case"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["ddp_amp"]["error"] == "RuntimeError: NCCL error: unhandled system error"
    assert rows["ddp_fp8_comm"]["passed"]
    assert not rows["fsdp2_fp8"]["passed"] and rows["fsdp2_fp8"]["checks"]["fp8_all_gather"] is False


# gpu_fp8

FP8_ARGV = ["--device", "cpu", "--rounds", "2", "--steps", "1", "--warmup", "1", "--gemm-shape", ""]


def test_gpu_fp8_keeps_going_past_a_failing_config_and_writes_after_each_row(
    tmp_path: Path, monkeypatch
) -> None:
    script = _script("gpu_fp8")
    convert, saved = script.convert, []

    def convert_or_fail(library, recipe, model, device):
        if (library, recipe) == ("mixprec", "rowwise"):
            raise RuntimeError("no rowwise kernel")
        return convert(library, recipe, model, device)

    monkeypatch.setattr(script, "convert", convert_or_fail)
    write = script.write_json
    monkeypatch.setattr(
        script, "write_json", lambda path, data, why: (saved.append(why), write(path, data, why))
    )
    out = tmp_path / "f.json"
    argv = [*FP8_ARGV, "--modes", "eager", "--configs", "bf16,mixprec-rowwise,mixprec-tensorwise"]
    assert script.main([*argv, "--json", str(out)]) == 1
    rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["mixprec rowwise"]["error"] == "RuntimeError: no rowwise kernel"
    assert rows["bf16"]["step_ms"] > 0 and rows["bf16"]["vs_bf16"] == 1.0 and rows["bf16"]["rounds"] == 2
    assert rows["mixprec tensorwise"]["step_ms"] > 0 and rows["mixprec tensorwise"]["vs_bf16"] > 0
    assert saved == [
        "running: starting",
        "running: bf16 warmed up",  # in the script's order, whatever --configs lists
        "running: mixprec tensorwise warmed up",
        "running: mixprec rowwise warmed up",
        "running: eager round 1 of 2",
        "running: eager round 2 of 2",
        "running: quantize level done",
        "running: passes counted",
        None,
    ]
    passes = {p["recipe"]: p for p in json.loads(out.read_text())["passes"]}
    assert passes["fp8_rowwise"] == {"recipe": "fp8_rowwise", "per_use": 6, "shared": 3, "bitwise": True}


def test_gpu_fp8_starts_no_compile_its_budget_cannot_fit_and_a_sigterm_keeps_the_rounds(
    tmp_path: Path, monkeypatch
) -> None:
    script = _script("gpu_fp8")
    out = tmp_path / "f.json"
    assert script.main([*FP8_ARGV, "--configs", "bf16", "--budget-s", "5", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["compiled"], "step_ms" in r) for r in rows] == [(False, True), (True, False)]
    assert rows[1]["skipped"].startswith("budget: ") and "a compiled warm-up took 10 s" in rows[1]["skipped"]

    run_round = script.Config.run_round

    def stopped_in_round_two(self, index, steps):
        if index == 1:
            raise KeyboardInterrupt(script.STOPPED)
        return run_round(self, index, steps)

    monkeypatch.setattr(script.Config, "run_round", stopped_in_round_two)
    assert script.main([*FP8_ARGV, "--configs", "bf16", "--modes", "eager", "--json", str(out)]) == 124
    written = json.loads(out.read_text())
    assert written["partial"].startswith("stopped by SIGTERM (the step's time limit) after ")
    assert written["rows"][0]["rounds"] == 1 and written["rows"][0]["step_ms"] > 0


# optimizer_speed

OPTIM_ARGV = ["--device", "cpu", "--width", "32", "--layers", "1", "--warmup", "1", "--steps", "1"]


def test_optimizer_speed_steps_each_config_on_the_same_start_and_keeps_going_past_a_failure(
    tmp_path: Path, monkeypatch
) -> None:
    script = _script("optimizer_speed")
    monkeypatch.setitem(sys.modules, "optimi", None)  # import optimi raises ImportError: skipped, with why
    real = script.build

    def build(config, params, device):
        if config == "mixprec-stochastic":
            raise RuntimeError("no kernel\nfor this")
        return real(config, params, device)

    monkeypatch.setattr(script, "build", build)
    out = tmp_path / "o.json"
    configs = "torch-fused,mixprec-kahan,mixprec-stochastic,optimi-kahan,mixprec-int8"
    assert script.main([*OPTIM_ARGV, "--rounds", "3", "--configs", configs, "--json", str(out)]) == 1
    written = json.loads(out.read_text())
    rows = {r["config"]: r for r in written["rows"]}
    assert list(rows) == ["torch-fused", "mixprec-kahan", "mixprec-int8"]
    assert written["errors"] == {"mixprec-stochastic": "RuntimeError: for this"}
    assert "import of optimi halted" in written["skipped"]["optimi-kahan"]
    assert all(len(r["rounds_ms"]) == 3 and r["median_ms"] > 0 for r in rows.values())
    assert rows["torch-fused"]["vs_torch_fused"] == 1.0 and written["partial"] is None
    assert written["meta"]["params"] == sum(math.prod(s) for s in script.shapes(32, 1)) == 12 * 32 * 32 + 64


def test_optimizer_speed_steps_what_torch_steps(monkeypatch) -> None:
    """mixprec's configs step the same bf16 weights as torch's AdamW does (within bf16 rounding)."""
    script = _script("optimizer_speed")
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(s, generator=gen, dtype=torch.bfloat16) for s in script.shapes(16, 1)]
    grads = [torch.randn_like(p) for p in start]
    runs = {c: script.Run(c, start, grads, torch.device("cpu")) for c in ("torch-fused", "mixprec-kahan")}
    for run in runs.values():
        run.step(3)
    for a, b, s in zip(runs["torch-fused"].params, runs["mixprec-kahan"].params, start, strict=True):
        torch.testing.assert_close(a, b, atol=0.02, rtol=0.02)
        assert not torch.equal(b, s)  # stepped: the start is a copy each config owns


def test_optimizer_speed_fp32_configs_step_fp32_copies_with_int8_moments(tmp_path: Path) -> None:
    """``mixprec-int8-fp32`` steps fp32 copies of the start (not the bf16 ones) with int8 moments, close
    to torch's AdamW on the same fp32 weights; the fp32 configs are opt-in, refused among the defaults'
    names only when misspelled."""
    script = _script("optimizer_speed")
    assert not set(script.FP32_CONFIGS) & set(script.CONFIGS)
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(s, generator=gen, dtype=torch.bfloat16) for s in script.shapes(16, 1)]
    grads = [torch.randn_like(p) for p in start]
    run = script.Run("mixprec-int8-fp32", start, grads, torch.device("cpu"))
    torch_run = script.Run("torch-fused", [p.float() for p in start], grads, torch.device("cpu"))
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in run.params)
    assert run.params[0].data_ptr() != start[0].data_ptr()
    run.step(3)
    torch_run.step(3)
    state = run.optimizer.optimizer.state[run.params[0]]
    assert state["exp_avg"].dtype in (torch.int8, torch.uint8)  # int8 codes, not torch's fp32 moments
    for a, b in zip(run.params, torch_run.params, strict=True):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-3)
    out = tmp_path / "o.json"
    argv = [*OPTIM_ARGV, "--rounds", "1", "--no-bitwise", "--json", str(out)]
    assert script.main([*argv, "--configs", "torch-fused,mixprec-int8-fp32"]) == 0
    assert [r["config"] for r in json.loads(out.read_text())["rows"]] == ["torch-fused", "mixprec-int8-fp32"]
    with pytest.raises(SystemExit):
        script.main([*argv, "--configs", "mixprec-int8-fp16"])


def test_optimizer_speed_coded_check_covers_fp32_weights() -> None:
    """The device check's cases include fp32 weights; on a CPU without the interpreter both sides are the
    chunked engine, so every count is 0 and the kernel did not run."""
    script = _script("optimizer_speed")
    out = script.coded_check(torch.device("cpu"), [(8, 300), (300,)], steps=2)
    assert set(out) == {"int8-kahan", "int8-nearest", "fp8-kahan", "int8-nearest-fp32"}
    fp32 = out["int8-nearest-fp32"]
    assert fp32["values"]["weights"] == 2 * (8 * 300 + 300) and fp32["values"]["kahan"] == 0
    assert all(v == 0 for case in out.values() for v in case["mismatched"].values())
    assert not any(case["kernel_ran"] for case in out.values())


def test_optimizer_speed_warms_a_compiling_config_after_the_first_round_and_stops_at_its_budget(
    tmp_path: Path, monkeypatch
) -> None:
    script = _script("optimizer_speed")
    monkeypatch.setattr(script, "COMPILES", ("mixprec-kahan",))  # stands in for torchao's compile
    out = tmp_path / "o.json"
    script.main([*OPTIM_ARGV, "--rounds", "3", "--configs", "torch-fused,mixprec-kahan", "--json", str(out)])
    rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows["torch-fused"]["rounds_ms"]) == ["0", "1", "2"]
    assert list(rows["mixprec-kahan"]["rounds_ms"]) == ["1", "2"]  # paired with torch-fused's rounds 1, 2
    fused, kahan = rows["torch-fused"]["rounds_ms"], rows["mixprec-kahan"]["rounds_ms"]
    ratios = sorted(kahan[i] / fused[i] for i in ("1", "2"))
    assert rows["mixprec-kahan"]["vs_low"] == ratios[0] and rows["mixprec-kahan"]["vs_high"] == ratios[1]
    script.main(
        [*OPTIM_ARGV, "--rounds", "50", "--budget-s", "0.001", "--configs", "torch-fused", "--json", str(out)]
    )
    written = json.loads(out.read_text())
    assert written["partial"] == "--budget-s 0.001: 1 of 50 rounds fit"
    assert len(written["rows"][0]["rounds_ms"]) == 1
