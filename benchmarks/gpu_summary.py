"""Gather what benchmarks/gpu.sh wrote into one JSON file and one Markdown file.

    python benchmarks/gpu_summary.py RESULTS_DIR [WALL_SECONDS [BUDGET_SECONDS]]

Reads ``steps.tsv`` (name, exit code or ``skipped: why``, seconds, limit), ``env.json``
(benchmarks/gpu_env.py), ``numerics.json`` (gemm_numerics.py), ``lowbit_lm.json``, ``plan_cost.json``,
``precision_paths.json`` and ``bench-SIZE.json`` (``mixprec bench --json``) when present, and the tail of
each step's log; writes ``gpu.json`` (machine, steps, each benchmark's JSON) and ``gpu.md`` (a table per
step's results). Exit code 0 when every step that ran exited 0, else 1.
"""

from __future__ import annotations

import json
import math
import platform
import sys
from pathlib import Path
from typing import Any

from mixprec.bench.report import bench_summary

EXTRA = ("env", "numerics", "lowbit_lm", "plan_cost", "precision_paths")


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


def _lowbit_md(lowbit: dict[str, Any]) -> list[str]:
    base = lowbit["modes"].get("bf16", {}).get("val_loss")
    rows = []
    for mode, r in lowbit["modes"].items():
        gap = " ".join(f"{v / b - 1:+.2%}" for v, b in zip(r["val_loss"], base, strict=True)) if base else "-"
        spread = f"{_num(r['step_s_p25'], '.4f')}-{_num(r['step_s_p75'], '.4f')}"
        rows.append(
            [
                mode,
                _num(sum(r["val_loss"]) / len(r["val_loss"]), ".4f"),
                gap,
                _num(r["step_s_median"], ".4f"),
                spread,
            ]
        )
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


SECTIONS = {
    "env": ("machine and packages (gpu_env.py)", _env_md),
    "numerics": ("lowbit_mm vs emulated_mm per recipe and GEMM (gemm_numerics.py)", _numerics_md),
    "lowbit_lm": ("low-bit recipes against bf16 (lowbit_lm.py)", _lowbit_md),
    "plan_cost": ("measured GEMM cost per format (plan_cost.py)", _plan_cost_md),
    "precision_paths": ("precision paths: step time and memory (precision_paths.py)", _precision_paths_md),
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
    for name, (title, render) in SECTIONS.items():
        if summary.get(name):
            try:
                body = render(summary[name])
            except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:  # a partial file: say so
                body = [f"(could not tabulate {name}.json: {type(exc).__name__}: {exc})"]
            lines += ["", f"## {title}", "", *body]
    for size, records in summary["bench"].items():
        body = bench_summary(records, f"size {size}", []).split("\n", 2)[2]
        lines += ["", f"## mixprec bench --size {size}", "", body.rstrip()]
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
    summary = {
        "machine": _machine(extra["env"]),
        "wall_s": int(argv[1]) if len(argv) > 1 else None,
        "budget_s": int(argv[2]) if len(argv) > 2 else None,
        "steps": _steps(out),
        "bench": bench,
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
