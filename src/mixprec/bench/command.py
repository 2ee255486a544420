"""``mixprec bench``: the command-line front of the bench (arguments, then plan, run, report)."""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch

from mixprec.bench.modes import ALIASES, DEFAULT_MODES, MODES
from mixprec.bench.plan import make_plan, split_names
from mixprec.bench.report import RECORD_KEYS, format_table, write_json, write_log, write_plots
from mixprec.bench.runner import run_jobs
from mixprec.bench.workloads import SIZES, WORKLOADS

HELP = "train real workloads in each precision mode; compare step time, memory and accuracy"
DESCRIPTION = """\
Trains each workload in each precision mode from the same seed and data order, then prints step time,
speedup over fp32, peak memory, final loss and metric, skipped steps and final loss scale.

workloads:
{workloads}

modes:
{modes}
  aliases: {aliases}
  default on cpu:  {cpu_modes}
  default on cuda: {cuda_modes}
  fp16 modes run on a CPU only where the preset is small: CPUs have no fast fp16 matmul/conv kernel.

--json writes a list of records with keys {keys};
final_loss is the held-out loss, final_metric is {metrics}.
"""


def _describe() -> str:
    workloads = "\n".join(f"  {name:<17} {spec.summary}" for name, spec in WORKLOADS.items())
    modes = "\n".join(f"  {name:<17} {spec.summary}" for name, spec in MODES.items())
    aliases = ", ".join(
        f"{alias} = {'/'.join(f'{v} ({k})' for k, v in per.items())}" for alias, per in ALIASES.items()
    )
    return DESCRIPTION.format(
        workloads=workloads,
        modes=modes,
        aliases=aliases,
        cpu_modes=", ".join(DEFAULT_MODES["cpu"]),
        cuda_modes=", ".join(DEFAULT_MODES["cuda"]),
        keys=", ".join(RECORD_KEYS),
        metrics=", ".join(f"{spec.metric} ({name})" for name, spec in WORKLOADS.items()),
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``mixprec bench`` options on ``parser``."""
    parser.description = _describe()
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "--workload", action="append", metavar="NAME[,NAME]", help="workload(s) to run (default: all)"
    )
    parser.add_argument(
        "--modes",
        action="append",
        metavar="MODE[,MODE]",
        help="precision modes (default: by device, see below)",
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_const", const="quick", dest="size", help="small run (minutes)")
    size.add_argument(
        "--size",
        choices=SIZES,
        default="default",
        help="size preset: tiny (smoke test), quick (= --quick), default, large (sized for a GPU)",
    )
    parser.add_argument("--steps", type=int, help="training steps per run (overrides the preset)")
    parser.add_argument("--device", default="auto", help="auto (default), cpu, cuda or cuda:N")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights, data split and batch order")
    parser.add_argument(
        "--data", metavar="FILE", help="UTF-8 text file for the lm workload (default: stdlib sources)"
    )
    parser.add_argument("--json", metavar="PATH", help="write one JSON record per workload x mode")
    parser.add_argument("--plot", metavar="DIR", help="write loss curves and a step-time chart (PNG)")
    parser.add_argument(
        "--log", metavar="PATH", help="write a JSONL line per training step (for mixprec report)"
    )
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="run everything in this process (faster start; CPU peak memory is then not reported)",
    )


def _header(device: str, size: str) -> str:
    if device.startswith("cuda"):
        tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        where = (
            f"{torch.cuda.get_device_name(torch.device(device))}; fp32 TF32 matmul/cuDNN: {tf32[0]}/{tf32[1]}"
        )
    else:
        where = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    return f"mixprec bench: {device} ({where}), torch {torch.__version__}, size {size}"


def _prepare_outputs(args: argparse.Namespace) -> None:
    """Fail before training, not after it, when an output cannot be written."""
    for path in (args.json, args.log):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError as exc:
            raise ValueError("--plot needs matplotlib: pip install 'mixprec[plot]'") from exc


def run(args: argparse.Namespace) -> int:
    """Run the bench for parsed ``args``; returns the process exit code (1 if any run failed)."""
    started = time.perf_counter()
    _prepare_outputs(args)
    plan = make_plan(
        workloads=split_names(args.workload),
        modes=split_names(args.modes),
        size=args.size or "default",
        steps=args.steps,
        device=args.device,
        seed=args.seed,
        data=args.data,
        progress=sys.stderr.isatty(),
    )
    for note in plan.notes:
        print(f"note: {note}", file=sys.stderr)
    results, failures = run_jobs(plan.jobs, isolated=not args.in_process)
    if results:
        print(format_table(results, plan.notes, header=_header(plan.device, plan.size)))
        if args.json:
            write_json(results, args.json)
        if args.log:
            write_log(results, args.log)
        if args.plot:
            write_plots(results, args.plot)
    print(f"total wall time {time.perf_counter() - started:.1f} s", file=sys.stderr)
    for failure in failures:
        print(failure, file=sys.stderr)
    return 1 if failures else 0
