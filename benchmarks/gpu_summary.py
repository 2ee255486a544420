"""Gather what benchmarks/gpu.sh wrote into one JSON file and one Markdown file.

    python benchmarks/gpu_summary.py RESULTS_DIR [WALL_SECONDS [BUDGET_SECONDS]]

Reads ``steps.tsv`` (name, exit code or ``skipped: why``, seconds, limit), ``env.json``
(benchmarks/gpu_env.py), ``numerics.json`` (gemm_numerics.py), ``distributed.json`` (gpu_distributed.py),
``fp8.json`` (gpu_fp8.py), ``lowbit_lm.json``, ``plan_cost.json``, ``precision_paths.json``, ``optim.json``
(optimizer_speed.py) and ``bench-SIZE.json`` (``mixprec bench --json``) when present, and the tail of each
step's log; writes ``gpu.json`` (machine, steps, each benchmark's JSON) and ``gpu.md`` (a table per step's
results). Exit code 0 when every step that ran exited 0, else 1.

A step cut short keeps what it wrote: a file whose ``"partial"`` gives a reason (see
``benchmarks/checkpoint.py``), or the file of a step that ran out of time, is tabulated under a heading
that says PARTIAL and why (``gpu.json``'s ``partial`` maps each such step to its reason). A bench whose
``bench-SIZE.json`` is missing or holds fewer runs than planned is tabulated from its step log
(``bench-SIZE-steps.jsonl``, rewritten by the bench after every round): per mode the steps and rounds
logged, the median step time (after the preset's warm-up) with its IQR, and the paired speedup over fp32
with its interval, by ``mixprec.bench.stats`` as the bench's own table; no held-out loss (the runs were
not evaluated), the last training loss instead.
"""

from __future__ import annotations

import json
import math
import platform
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from mixprec._files import read_jsonl
from mixprec.bench.report import bench_summary
from mixprec.bench.stats import timings
from mixprec.bench.workloads import WORKLOADS

EXTRA = ("env", "numerics", "distributed", "fp8", "lowbit_lm", "plan_cost", "precision_paths", "optim")


def _machine(env: dict[str, Any] | None) -> dict[str, Any]:
    """From env.json when the env step ran (no torch import here), else from this process."""
    if env:
        keys = ("device", "capability", "memory_gib", "torch", "cuda", "python")
        return {"gpu": env.get("device"), **{k: env.get(k) for k in keys[1:]}}
    import torch

    cuda = torch.cuda.is_available()
    return {
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "capability": None,
        "memory_gib": None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }


def _steps(out: Path) -> list[dict[str, Any]]:
    steps = []
    for line in (out / "steps.tsv").read_text().splitlines():
        name, code, seconds, limit = line.split("\t")
        log = out / f"{name}.log"
        tail = log.read_text(errors="replace").splitlines()[-15:] if log.exists() else []
        skipped = code.startswith("skipped")
        steps.append(
            {
                "name": name,
                "exit_code": None if skipped else int(code),
                "skipped": code.removeprefix("skipped: ") if skipped else None,
                "timed_out": code in ("124", "137"),
                "seconds": int(seconds),
                "limit_s": int(limit),
                "log_tail": tail,
            }
        )
    return steps


def _load(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _clean(value: Any) -> Any:
    """NaN and infinities as None: gpu.json is strict JSON (a NaN error is a result, not a crash)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def _num(value: Any, spec: str = ".3g") -> str:
    return "-" if value is None else format(value, spec)


def _table(head: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return lines + ["| " + " | ".join(str(c).replace("|", "/") for c in row) + " |" for row in rows]


def _env_md(env: dict[str, Any]) -> list[str]:
    facts = [
        [k, env.get(k)] for k in ("device", "capability", "memory_gib", "torch", "cuda", "cudnn", "python")
    ]
    facts += [["mixprec", f"{env.get('mixprec')} ({env.get('mixprec_path')})"]]
    packages = [
        [p["package"], f"ok {p.get('version') or ''}".strip() if p["ok"] else f"missing: {p['error']}"]
        for p in env.get("packages", {}).values()
    ]
    return _table(["fact", "value"], facts + packages)


def _numerics_md(numerics: dict[str, Any]) -> list[str]:
    rows = []
    for r in numerics["rows"]:
        if "error" in r:
            rows.append([r["recipe"], "-", "-", "-", f"FAIL: {r['error']}"])
        elif r["path"] == "hp":
            rows.append([r["recipe"], r["gemm"], "hp (torch.mm)", "-", "-"])
        else:
            rows.append(
                [
                    r["recipe"],
                    r["gemm"],
                    r["path"],
                    _num(r["rel_error"], ".2e"),
                    "ok" if r["passed"] else "FAIL",
                ]
            )
    meta = numerics.get("meta", {})
    head = f"M,K,N = {meta.get('shape')} on {meta.get('device')}; pass: max rel. error <= 2**-6"
    return [head, "", *_table(["recipe", "gemm", "path", "rel. error", "result"], rows)]


def _mean(values: list[float | None] | None) -> float | None:
    """The mean, None when there are no values or one is None (a non-finite loss, or not evaluated)."""
    if not values or any(v is None for v in values):
        return None
    return sum(values) / len(values)  # type: ignore[arg-type]


def _lowbit_md(lowbit: dict[str, Any]) -> list[str]:
    base = lowbit["modes"].get("bf16", {}).get("val_loss")
    rows = []
    for mode, r in lowbit["modes"].items():
        losses = r["val_loss"]
        gap = "-"
        if base and losses and None not in base and None not in losses:
            gap = " ".join(f"{v / b - 1:+.2%}" for v, b in zip(losses, base, strict=True))
        spread = f"{_num(r['step_s_p25'], '.4f')}-{_num(r['step_s_p75'], '.4f')}"
        rows.append([mode, _num(_mean(losses), ".4f"), gap, _num(r["step_s_median"], ".4f"), spread])
    rows += [[mode, "FAILED", error, "-", "-"] for mode, error in lowbit.get("errors", {}).items()]
    head = f"task {lowbit['task']}, {lowbit['steps']} steps, {lowbit['device']}; step time: {lowbit['time']}"
    return [head, "", *_table(["mode", "held-out loss", "vs bf16", "s/step", "IQR"], rows)]


def _plan_cost_md(plan: dict[str, Any]) -> list[str]:
    rows = []
    for r in plan["results"]:
        shape = ",".join(map(str, r["shape"]))
        if "error" in r:
            rows.append([r["source"], shape, r["format"], "FAILED", r["error"], "-", "-"])
            continue
        cells = [_num(r["median_s"], ".2e"), _num(r["relative_to_bf16"], ".2f"), _num(r["b200"], ".2f")]
        rows.append([r["source"], shape, r["format"], *cells, _num(r["h100"], ".2f")])
    head = ["source", "M,N,K", "format", "median s", "x bf16", "b200 roofline", "h100 roofline"]
    meta = plan["meta"]
    done = f"; {meta['shapes_done']} of {meta['shapes_planned']} shapes" if "shapes_done" in meta else ""
    return [f"cost: {meta.get('cost')}{done}", "", *_table(head, rows)]


def _precision_paths_md(paths: dict[str, Any]) -> list[str]:
    rows = [
        [r["width"], r["path"], _num(r["step_ms"], ".2f"), _num(r["vs_optimi"], ".2f"),
         _num(r["bytes_per_param"], ".2f"), _num(r["peak_mib"], ".1f")]
        for r in paths["rows"]
    ]  # fmt: skip
    skipped = [f"skipped {k}: {v}" for k, v in paths.get("skipped", {}).items()]
    table = _table(["width", "path", "step ms", "vs optimi", "B/param", "peak MiB"], rows)
    return [*skipped, *([""] if skipped else []), *table]


def _optim_md(data: dict[str, Any]) -> list[str]:
    meta = data["meta"]
    rows = [
        [r["config"], _num(r["median_ms"], ".3f"), f"{_num(r['min_ms'], '.3f')}-{_num(r['max_ms'], '.3f')}",
         _num(r["vs_torch_fused"], ".2f"), len(r["rounds_ms"])]
        for r in data["rows"]
    ]  # fmt: skip
    notes = [f"{kind} {k}: {v}" for kind in ("skipped", "errors") for k, v in data.get(kind, {}).items()]
    for check in ("bitwise_vs_torch_fused", "coded_vs_chunked_engine"):  # mismatched values per case
        if isinstance(meta.get(check), dict):
            cases = meta[check].items()
            notes.append(f"{check}: " + "; ".join(f"{k} {v.get('mismatched', v)}" for k, v in cases))
    head = f"{meta['params'] / 1e6:.0f}M {meta['dtype']} parameters on {meta.get('gpu') or meta['device']}"
    table = _table(["config", "median ms/step", "range", "x torch fused", "rounds"], rows)
    return [head, *notes, "", *table]


def _distributed_md(data: dict[str, Any]) -> list[str]:
    meta = data.get("meta", {})
    head = f"{meta.get('backend', '?')}, world size 1 on {meta.get('gpu') or meta.get('device')}"
    head += f", NCCL {meta['nccl']}" if meta.get("nccl") else ""
    lines = [head + (f"; the group did not start: {meta['error']}" if meta.get("error") else ""), ""]
    rows = []
    for r in data["rows"]:
        if "error" in r:
            rows.append([r["case"], "-", "-", f"FAILED: {r['error']}"])
            continue
        failed = [name for name, ok in r["checks"].items() if not ok]
        checks = ", ".join(f"{name} {'ok' if ok else 'FAILED'}" for name, ok in r["checks"].items())
        if "bitwise" in r:
            checks += (
                f"; twin: {'bitwise' if r['bitwise'] else 'rel. diff ' + _num(r['param_rel_diff'], '.1e')}"
            )
        losses = f"{_num(r['losses'][0], '.4f')} -> {_num(r['losses'][-1], '.4f')}"
        rows.append([r["case"], losses, len(r["losses"]), ("FAILED: " if failed else "") + checks])
    return lines + _table(["case", "loss", "steps", "checks"], rows)


def _fp8_md(data: dict[str, Any]) -> list[str]:
    meta = data.get("meta", {})
    where = meta.get("gpu") or meta.get("device")
    head = (
        f"GPT {meta.get('layers')} x d={meta.get('width')}, seq {meta.get('context')}, "
        f"batch {meta.get('batch')} on {where}, torchao {meta.get('torchao')}; step = fwd + bwd + AdamW, "
        f"median of {meta.get('rounds')} interleaved rounds [range of the round medians]; x bf16 paired "
        "by round; transient = peak during a step - allocated before it"
    )
    rows = []
    for r in data["rows"]:
        mode = "compiled" if r.get("compiled") else "eager"
        if "skipped" in r or "error" in r or "step_ms" not in r:
            why = r.get("skipped") or f"FAILED: {r.get('error', 'no timed round')}"
            rows.append([r["config"], mode, why, "-", "-", "-", "-"])
            continue
        times = f"{_num(r['step_ms'], '.2f')} [{'-'.join(_num(v, '.2f') for v in r['step_ms_range'])}]"
        ratio = "-"
        if r.get("vs_bf16") is not None:
            ratio = f"{r['vs_bf16']:.3f} [{'-'.join(_num(v, '.3f') for v in r['vs_bf16_range'])}]"
        warm = _num(r.get("warmup_s"), ".1f") + (
            "" if r.get("graph_breaks") is None else f" ({r['graph_breaks']})"
        )
        rows.append(
            [r["config"], mode, times, ratio, _num(r.get("transient_gib"), ".2f"), warm, r.get("rounds")]
        )
    head_row = ["config", "mode", "step ms", "x bf16", "transient GiB", "warm-up s (graph breaks)", "rounds"]
    lines = [head, "", *_table(head_row, rows)]
    gemm = []
    for g in data.get("gemm", []):
        if g.get("error") or g.get("median_s") is None:
            gemm.append([g.get("format", "-"), "FAILED", g.get("error") or "-"])
        else:
            gemm.append(
                [g["format"], _num(g["median_s"] * 1e3, ".3f"), _num(g.get("relative_to_bf16"), ".2f")]
            )
    if gemm:
        shape = ",".join(map(str, (data["gemm"][0].get("shape") or [])))
        lines += [
            "",
            f"quantize + GEMM, forward and both backward GEMMs, M,N,K = {shape} (plan_cost.measure):",
            "",
        ]
        lines += _table(["format", "median ms", "x bf16"], gemm)
    rowwise = []
    for r in data.get("rowwise_gemm", []):
        if r.get("median_ms") is None:
            rowwise.append(
                [r.get("path", "-"), r.get("skipped") or f"FAILED: {r.get('error')}", "-", "-", "-", "-"]
            )
            continue
        ms = f"{_num(r['median_ms'], '.3f')} [{'-'.join(_num(v, '.3f') for v in r['range_ms'])}]"
        bits = "-" if "bitwise_vs_torch_post_scale" not in r else str(r["bitwise_vs_torch_post_scale"])
        rowwise.append(
            [r["path"], ms, _num(r.get("tflops"), ".0f"), _num(r.get("vs_rowwise_kernel"), ".2f"),
             _num(r.get("transient_mib"), ".0f"), bits]
        )  # fmt: skip
    if rowwise:
        shape = ",".join(map(str, data["rowwise_gemm"][0].get("shape") or []))
        lines += ["", f"one rowwise fp8 GEMM, M,N,K = {shape}, bf16 out, no fast accumulation:", ""]
        head_rw = ["path", "median ms [range]", "TFLOP/s", "x rowwise kernel", "transient MiB", "bitwise"]
        lines += _table(head_rw, rowwise)
    quant = []
    for q in data.get("quantize", []):
        if q.get("median_ms") is None:
            why = q.get("skipped") or f"FAILED: {q.get('error')}"
            quant.append([q.get("format", "-"), q.get("path", "-"), why, "-", "-", "-"])
        else:
            ms = f"{_num(q['median_ms'], '.3f')} [{'-'.join(_num(v, '.3f') for v in q['range_ms'])}]"
            vs = _num(q.get("vs_pure"), ".2f")
            bits = "-" if "bitwise" not in q else str(q["bitwise"])
            quant.append([q["format"], q["path"], ms, _num(q.get("gb_per_s"), ".0f"), vs, bits])
    if quant:
        shape = "x".join(map(str, data["quantize"][0].get("shape") or []))
        lines += ["", f"quantize an operand and its transposed copy, {shape} bf16 (pure torch vs fused):", ""]
        lines += _table(["format", "path", "median ms [range]", "GB/s", "x pure", "bitwise"], quant)
    return lines


SECTIONS = {
    "env": ("machine and packages (gpu_env.py)", _env_md),
    "numerics": ("lowbit_mm vs emulated_mm per recipe and GEMM (gemm_numerics.py)", _numerics_md),
    "distributed": ("DDP and FSDP2 on a 1-rank process group (gpu_distributed.py)", _distributed_md),
    "fp8": ("fp8 training speed: bf16, torchao, mixprec; eager and compiled (gpu_fp8.py)", _fp8_md),
    "lowbit_lm": ("low-bit recipes against bf16 (lowbit_lm.py)", _lowbit_md),
    "plan_cost": ("measured GEMM cost per format (plan_cost.py)", _plan_cost_md),
    "precision_paths": ("precision paths: step time and memory (precision_paths.py)", _precision_paths_md),
    "optim": ("optimizer step time on bf16 parameters (optimizer_speed.py)", _optim_md),
}


def _markdown(summary: dict[str, Any]) -> str:
    machine = summary["machine"]
    budget = f" of a {summary['budget_s']} s budget" if summary.get("budget_s") else ""
    lines = [
        "# benchmarks/gpu.sh",
        "",
        f"{machine['gpu'] or 'no GPU (dry run)'}, torch {machine['torch']} (CUDA {machine['cuda']}), "
        f"Python {machine['python']}; {summary['wall_s']} s in all{budget}.",
        "",
    ]
    rows = []
    for step in summary["steps"]:
        outcome = "skipped" if step["skipped"] else ("timed out" if step["timed_out"] else "ran")
        code = "-" if step["exit_code"] is None else step["exit_code"]
        rows.append([step["name"], outcome, code, step["seconds"], step["limit_s"], step["skipped"] or ""])
    lines += _table(["step", "outcome", "exit code", "seconds", "limit s", "skipped because"], rows)
    partial = summary.get("partial", {})
    for name, (title, render) in SECTIONS.items():
        if summary.get(name):
            try:
                body = render(summary[name])
            except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:  # a partial file: say so
                body = [f"(could not tabulate {name}.json: {type(exc).__name__}: {exc})"]
            mark = f" (PARTIAL: {partial[name]})" if name in partial else ""
            lines += ["", f"## {title}{mark}", "", *body]
    for size, records in summary["bench"].items():
        if records:
            text = bench_summary(records, f"size {size}", []).split("\n", 2)[2]
            mark = f" (PARTIAL: {partial['bench-' + size]})" if f"bench-{size}" in partial else ""
            lines += ["", f"## mixprec bench --size {size}{mark}", "", text.rstrip()]
    for size, cut in summary.get("bench_log", {}).items():
        lines += ["", f"## mixprec bench --size {size}, from its step log (PARTIAL: {cut['reason']})", ""]
        lines += _bench_log_md(cut)
    for step in summary["steps"]:
        if step["exit_code"] not in (None, 0) and step["log_tail"]:
            lines += [
                "",
                f"## {step['name']} failed (last lines of its output)",
                "",
                "```",
                *step["log_tail"],
                "```",
            ]
    return "\n".join(lines) + "\n"


def _partial(name: str, data: Any, steps: list[dict[str, Any]]) -> str | None:
    """Why ``name``'s file is not the step's complete result, or None: its own ``partial`` reason, or
    the step ran out of time after writing it."""
    if not data:
        return None
    own = data.get("partial") if isinstance(data, dict) else None
    if own:
        return own
    step = next((s for s in steps if s["name"] == name), None)
    if step is not None and step["timed_out"]:
        return f"the step ran out of its {step['limit_s']} s; the file holds what it wrote before"
    return None


def bench_from_log(path: Path, size: str) -> dict[str, Any] | None:
    """A bench cut short, from its step log: per (workload, mode) the steps logged and the bench's own
    statistics over them (``mixprec.bench.stats.timings``); None when there is no log."""
    if not path.exists():
        return None
    try:
        lines, trailer = read_jsonl(path)
    except ValueError as exc:  # cut inside a line (TruncatedFile) or not JSON Lines
        return {"reason": f"{path.name} unreadable: {exc}", "rows": []}
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for line in lines:
        runs.setdefault((line["workload"], line["mode"]), []).append(line)
    results = []
    for (workload, mode), history in runs.items():
        preset = WORKLOADS[workload].presets.get(size) if workload in WORKLOADS else None
        warmup = min(preset.warmup if preset else 0, len(history) - 1)
        results.append(SimpleNamespace(workload=workload, mode=mode, history=history, warmup=warmup))
    rows = []
    for run, timing in zip(results, timings(results), strict=True):
        rows.append(
            {
                "workload": run.workload, "mode": run.mode, "steps": len(run.history),
                "rounds": timing.rounds,
                "step_time_ms": timing.median_ms, "step_time_q25_ms": timing.q25_ms,
                "step_time_q75_ms": timing.q75_ms, "speedup_vs_fp32": timing.speedup,
                "speedup_low": timing.speedup_low, "speedup_high": timing.speedup_high, "noisy": timing.noisy,
                "last_train_loss": run.history[-1].get("loss"),
            }
        )  # fmt: skip
    if trailer is None:
        reason = "the log was never closed (the bench was stopped while writing it)"
    else:
        reason = f"{trailer.get('runs')} of {trailer.get('runs_planned')} runs finished"
        if trailer.get("running"):
            reason += f", {trailer['running']} stopped while training (the rounds they finished are here)"
    return {"reason": reason, "rows": rows}


def _bench_log_md(cut: dict[str, Any]) -> list[str]:
    rows = []
    for r in cut["rows"]:
        speedup = _num(r["speedup_vs_fp32"], ".2f")
        if r["speedup_low"] is not None:
            speedup += f" [{r['speedup_low']:.2f}-{r['speedup_high']:.2f}]"
        rows.append(
            [
                r["workload"], r["mode"], r["steps"], r["rounds"], _num(r["step_time_ms"], ".1f"),
                f"{_num(r['step_time_q25_ms'], '.1f')}-{_num(r['step_time_q75_ms'], '.1f')}",
                speedup + (" NOISY" if r["noisy"] else ""), _num(r["last_train_loss"], ".4f"),
            ]
        )  # fmt: skip
    head = ["workload", "mode", "steps", "rounds", "step ms", "IQR ms", "speedup [90% CI]", "last train loss"]
    return _table(head, rows)


def main(argv: list[str]) -> int:
    if not argv or not Path(argv[0]).is_dir():
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(argv[0])
    bench = {
        path.stem.removeprefix("bench-"): _load(path) or []
        for path in sorted(out.glob("bench-*.json"))
        if not path.stem.endswith("-steps")
    }
    extra = {name: _load(out / f"{name}.json") for name in EXTRA}
    steps = _steps(out)
    partial = {name: why for name in EXTRA if (why := _partial(name, extra[name], steps))}
    bench_log = {}
    sizes = {p.stem.removeprefix("bench-").removesuffix("-steps") for p in out.glob("bench-*-steps.jsonl")}
    for size in sorted(sizes | set(bench)):
        records = bench.get(size) or []
        planned = records[0].get("runs_planned") if records else None
        if records and not (isinstance(planned, int) and len(records) < planned):
            continue
        cut = bench_from_log(out / f"bench-{size}-steps.jsonl", size)
        if cut is not None:
            bench_log[size] = cut
        elif records:
            partial[f"bench-{size}"] = f"{len(records)} of {planned} planned runs"
    summary = {
        "machine": _machine(extra["env"]),
        "wall_s": int(argv[1]) if len(argv) > 1 else None,
        "budget_s": int(argv[2]) if len(argv) > 2 else None,
        "steps": steps,
        "partial": partial,
        "bench": bench,
        "bench_log": bench_log,
        **extra,
    }
    summary = _clean(summary)
    (out / "gpu.json").write_text(json.dumps(summary, indent=1, allow_nan=False) + "\n")
    (out / "gpu.md").write_text(_markdown(summary))
    failed = [s["name"] for s in summary["steps"] if s["exit_code"] not in (None, 0)]
    if failed:
        print(f"gpu_summary: failed or timed out: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
