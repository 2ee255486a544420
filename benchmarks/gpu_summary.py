"""Gather what benchmarks/gpu.sh wrote into one JSON file and one Markdown file.

    python benchmarks/gpu_summary.py RESULTS_DIR [WALL_SECONDS]

Reads ``steps.tsv`` (name, exit code or ``skipped: why``, seconds), ``bench-SIZE.json`` (``mixprec bench
--json``), ``precision_paths.json`` / ``fp8_lm.json`` / ``plan_cost.json`` when present, and the tail
of each step's log;
writes ``gpu.json`` (machine, steps, bench records per size, the other benchmarks' JSON) and ``gpu.md``.
Exit code 0 when every step that ran exited 0, else 1.
"""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path
from typing import Any

import torch

from mixprec.inspect.bench_report import bench_summary

EXTRA = ("precision_paths", "fp8_lm", "plan_cost")


def _machine() -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    return {
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }


def _steps(out: Path) -> list[dict[str, Any]]:
    steps = []
    for line in (out / "steps.tsv").read_text().splitlines():
        name, code, seconds = line.split("\t")
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
                "log_tail": tail,
            }
        )
    return steps


def _load(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _markdown(summary: dict[str, Any]) -> str:
    machine = summary["machine"]
    lines = [
        "# benchmarks/gpu.sh",
        "",
        f"{machine['gpu'] or 'no GPU (dry run)'}, torch {machine['torch']} (CUDA {machine['cuda']}), "
        f"Python {machine['python']}; {summary['wall_s']} s in all.",
        "",
        "| step | outcome | seconds |",
        "|---|---|---|",
    ]
    for step in summary["steps"]:
        outcome = step["skipped"] and f"skipped ({step['skipped']})"
        outcome = outcome or ("timed out" if step["timed_out"] else f"exit {step['exit_code']}")
        lines.append(f"| {step['name']} | {outcome} | {step['seconds']} |")
    for size, records in summary["bench"].items():
        body = bench_summary(records, f"size {size}", []).split("\n", 2)[2]
        lines += ["", f"## mixprec bench --size {size}", "", body.rstrip()]
    for name in EXTRA:
        step = next((s for s in summary["steps"] if s["name"] == name), None)
        if step and step["log_tail"]:
            lines += ["", f"## {name} (last lines of its output)", "", "```", *step["log_tail"], "```"]
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
    summary = {
        "machine": _machine(),
        "wall_s": int(argv[1]) if len(argv) > 1 else None,
        "steps": _steps(out),
        "bench": bench,
        **{name: _load(out / f"{name}.json") for name in EXTRA},
    }
    (out / "gpu.json").write_text(json.dumps(summary, indent=1, allow_nan=False) + "\n")
    (out / "gpu.md").write_text(_markdown(summary))
    failed = [s["name"] for s in summary["steps"] if s["exit_code"] not in (None, 0)]
    if failed:
        print(f"gpu_summary: failed or timed out: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
