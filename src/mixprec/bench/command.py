"""``mixprec bench``: the command-line front of the bench (check everything, estimate, run, report).

Order of work: every input and output is checked first (one clear error, before any training); the time
estimate is printed; the workloads run with their modes interleaved (``mixprec.bench.schedule``);
after each workload the JSON (and the step log) are replaced, complete, with everything so far (see
:mod:`mixprec._files`), and after every round the step log again with the steps of the runs still
training, so an interrupt, a time limit's SIGTERM (handled as an interrupt) or a failure later keeps
what was measured; then the table; the plots and the results folder's ``summary.md`` come last.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from mixprec._files import write_atomic
from mixprec.bench import checks
from mixprec.bench.budget import DEFAULT_TIME, Budget, parse_time
from mixprec.bench.jobs import Plan, make_plan, split_names
from mixprec.bench.machine import choose_threads, count_threads
from mixprec.bench.modes import ALIASES, DEFAULT_MODES, MODES
from mixprec.bench.progress import Progress, estimate_s, format_duration, machine_factor
from mixprec.bench.report import RECORD_KEYS, format_table, make_records, write_json, write_log
from mixprec.bench.runner import RunResult
from mixprec.bench.schedule import Running, run_plan
from mixprec.bench.workloads import SIZES, WORKLOADS

DEFAULT_FOLDER = "mixprec-bench-%Y%m%d-%H%M%S"  # time.strftime pattern, in the current directory
HELP = "train real workloads in each precision mode; compare step time, memory and accuracy"
DESCRIPTION = """\
Trains each workload in each precision mode from the same seed and data order, the modes interleaved a
few steps at a time (each run in a process of its own), then prints the median step time and its spread,
the speedup over fp32 with a 90% interval, peak memory, held-out loss and metric, skipped steps and the
final loss scale. The 'fp32 (A/A)' row is a second fp32 process: how far it lands from 1.00x widens
every interval. A row marked NOISY had timings too spread out to trust (a busy machine); rerun then.
Default: about 3-4 minutes on a quiet 2-core CPU, and cut to fit --time (5 min) where it would take longer;
--full: the longer study (about 10 minutes). The
results go into a new folder ./mixprec-bench-DATE-TIME (or --out DIR) unless --json, --log or --plot
names single outputs; `mixprec report DIR` redraws them.

workloads:
{workloads}

modes:
{modes}
  aliases: {aliases}
  default on cpu:  {cpu_modes}
  default on cuda: {cuda_modes}
  fp16 modes run on a CPU only where the preset is small: CPUs have no fast fp16 matmul/conv kernel.

--json writes a list of records with keys {keys};
final_loss is the held-out loss, final_metric is {metrics}. `mixprec report` reads --json and --log files.
"""


def _alias_targets(per: dict[str, str]) -> str:
    """``fp32`` when every device runs the same mode, else ``O2-bf16 (cpu)/O2-fp16 (cuda)``."""
    if len(set(per.values())) == 1 and len(per) > 1:
        return next(iter(per.values()))
    return "/".join(f"{v} ({k})" for k, v in per.items())


def _describe() -> str:
    workloads = "\n".join(f"  {name:<19} {spec.summary}" for name, spec in WORKLOADS.items())
    modes = "\n".join(f"  {name:<19} {spec.summary}" for name, spec in MODES.items())
    aliases = ", ".join(f"{alias} = {_alias_targets(per)}" for alias, per in ALIASES.items() if per)
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
    add = parser.add_argument
    add("--workload", action="append", metavar="NAME[,NAME]", help="workload(s) to run (default: all)")
    add("--modes", action="append", metavar="MODE[,MODE]", help="precision modes (default: by device)")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--full", action="store_const", const="full", dest="size", help="the longer study")
    quick = ", ".join(
        f"{name} {spec.presets['quick'].steps}" for name, spec in WORKLOADS.items() if spec.default
    )
    size.add_argument(
        "--quick",
        action="store_const",
        const="quick",
        dest="size",
        help=f"a short smoke run: steps per mode {quick}; the bench prints its time estimate for this "
        "machine as it starts",
    )
    size.add_argument(
        "--size",
        choices=SIZES,
        help="size preset: tiny (tests), quick (= --quick), default (cut to fit --time), full (= --full), "
        "large (GPU)",
    )
    add("--steps", type=int, help="training steps per run (overrides the preset and --time)")
    add(
        "--time",
        metavar="DURATION",
        help=f"time budget for the whole bench, e.g. 300s, 5m or off (default {DEFAULT_TIME} for the default "
        "size, off for the others): each workload runs the largest share of its rounds that fits, chosen "
        "from the estimate and again before each workload from the pace so far; the table says what it chose",
    )
    add(
        "--threads",
        default="auto",
        metavar="N|auto",
        help="torch CPU threads per run (default auto: torch's default, fewer when other programs keep "
        "cores busy)",
    )
    add("--device", default="auto", help="auto (default), cpu, cuda or cuda:N")
    add("--seed", type=int, default=0, help="seed for weights, data split and batch order")
    add("--data", metavar="FILE", help="UTF-8 text file for the lm workload (default: stdlib sources)")
    add(
        "--images",
        metavar="DIR",
        help="IDX image files for the cnn workload (e.g. /usr/share/datasets/fashion-mnist; default: "
        "scikit-learn's digits)",
    )
    add(
        "--out",
        metavar="DIR",
        help="results folder: bench.json, steps.jsonl, plots/ and summary.md (default, unless --json, --log "
        "or --plot is given: ./mixprec-bench-DATE-TIME)",
    )
    add("--mkdir", action="store_true", help="create missing parent directories of the outputs")
    add("--json", metavar="FILE", help="write one JSON record per workload x mode (rewritten as runs end)")
    add(
        "--log",
        metavar="FILE",
        help="write a JSONL line per training step (for mixprec report; rewritten after every round)",
    )
    add("--plot", metavar="DIR", help="write loss-vs-fp32 and step-time pictures (PNG) into DIR")
    add(
        "--compile",
        action="store_true",
        help="torch.compile every run's model (default backend), the same way in every mode: compiled bf16 "
        "against compiled fp8; the first steps compile (untimed warm-up)",
    )
    add(
        "--in-process",
        action="store_true",
        help="run everything in this process (faster start; CPU peak memory is then not reported)",
    )


def _header(plan: Plan, threads: int) -> str:
    device = plan.device
    if device.startswith("cuda"):
        tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        name = torch.cuda.get_device_name(torch.device(device))
        where = f"{name}; fp32 TF32 matmul/cuDNN: {tf32[0]}/{tf32[1]}"
    else:
        where = f"{platform.processor() or platform.machine()}, {count_threads(threads)} per run"
    compiled = ", torch.compile" if any(job.compiled for job in plan.jobs) else ""
    return f"mixprec bench: {device} ({where}), torch {torch.__version__}, size {plan.size}{compiled}"


def _check_outputs(args: argparse.Namespace) -> None:
    """Fail before training, not after it, when an output cannot be written."""
    checks.distinct({"--json": args.json, "--log": args.log})
    if args.json:
        checks.output_file(args.json, "--json", args.mkdir)
    if args.log:
        checks.output_file(args.log, "--log", args.mkdir)
    if args.plot:
        checks.output_dir(args.plot, "--plot", args.mkdir)
        checks.matplotlib_available()
    if args.out:
        checks.output_dir(args.out, "--out", args.mkdir)


def _results_folder(args: argparse.Namespace, notes: list[str]) -> Path | None:
    """The results folder (``--out``, or a new dated one when no output was named), its files put into
    ``args``; None when the user named only single outputs."""
    if args.out is None and (args.json or args.log or args.plot):
        return None
    folder = Path(args.out or time.strftime(DEFAULT_FOLDER))
    for number in range(2, 100):  # a dated folder is new: another run started in the same second
        if args.out is not None or not folder.exists():
            break
        folder = Path(f"{time.strftime(DEFAULT_FOLDER)}-{number}")
    checks.output_dir(folder, "--out", args.mkdir)
    args.json = args.json or str(folder / "bench.json")
    args.log = args.log or str(folder / "steps.jsonl")
    if args.plot is None:
        try:
            checks.matplotlib_available()
            args.plot = str(folder / "plots")
        except ValueError:
            notes.append("no plots in the results folder: pip install 'mixprec[plot]' for matplotlib")
    return folder


def _summary(table: str, folder: Path, written: list[str], wall: str) -> str:
    """``summary.md`` of a results folder: the table as printed, the files beside it."""
    files = "\n".join(
        f"- `{Path(p).relative_to(folder) if Path(p).is_relative_to(folder) else p}`" for p in written
    )
    return (
        f"# mixprec bench results\n\nTotal wall time {wall}.\n\n```text\n{table}\n```\n\n"
        f"Files:\n\n{files}\n\n`mixprec report {folder}` redraws the pictures and tables from them.\n"
    )


def _announce(plan: Plan, factor: float | None) -> None:
    workloads = len({job.workload for job in plan.jobs})
    modes = len({job.mode for job in plan.jobs})
    if factor is None:
        when = "no CPU reference on this device: the estimate follows the first round of each mode"
    else:
        busy = f", this machine now {factor:.1f}x the reference's time" if factor > 1.3 else ""
        when = f"about {format_duration(estimate_s(plan.jobs, factor))}{busy}"
    print(
        f"mixprec bench: {len(plan.jobs)} runs ({workloads} workloads x up to {modes} modes, "
        f"size {plan.size}, {plan.device}); {when}",
        file=sys.stderr,
        flush=True,
    )


def _save(
    results: list[RunResult], args: argparse.Namespace, planned: int, notes: Sequence[str] = ()
) -> list[str]:
    """Write the JSON and the log (its trailer holding ``notes``) from everything so far; returns the
    paths written."""
    written = []
    if args.json:
        written.append(str(write_json(results, args.json, planned)))
    if args.log:
        written.append(str(write_log(results, args.log, planned, notes=notes)))
    return written


def _save_round(
    results: list[RunResult], running: list[Running], args: argparse.Namespace, planned: int
) -> None:
    """After a round: the step log with the finished runs and the steps so far of those still training."""
    if args.log:
        write_log(results, args.log, planned, running)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM (``timeout``'s, a scheduler's) stops the bench as Ctrl-C does: the workers are closed and
    the files keep the last round; the old handler is back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _finish(results: list[RunResult], args: argparse.Namespace, plan: Plan, table: str, wall: str) -> None:
    """The last writes (JSON, log, plots, the folder's summary), each file named on stderr."""
    written = _save(results, args, len(plan.jobs), plan.notes)
    if args.plot:
        from mixprec.bench.plots import write_plots

        written += [str(p) for p in write_plots(results, make_records(results, len(plan.jobs)), args.plot)]
    if args.folder is not None:
        summary = args.folder / "summary.md"
        written.append(str(write_atomic(summary, _summary(table, args.folder, written, wall))))
    for path in written:
        print(f"wrote {path}", file=sys.stderr)
    if args.folder is not None:
        print(
            f"results in {args.folder}/ (`mixprec report {args.folder}` redraws them)",
            file=sys.stderr,
        )


def run(args: argparse.Namespace) -> int:
    """Run the bench for parsed ``args``; returns the process exit code (1 if any run failed)."""
    started = time.perf_counter()
    budget_s = _budget_s(args)
    _check_outputs(args)
    threads, why = choose_threads(args.threads, args.device)
    plan = make_plan(
        workloads=split_names(args.workload),
        modes=split_names(args.modes),
        size=args.size or "default",
        steps=args.steps,
        device=args.device,
        seed=args.seed,
        data=args.data,
        images=args.images,
        threads=threads,
        compiled=getattr(args, "compile", False),
    )
    args.folder = _results_folder(args, plan.notes)
    if why != "torch's default":
        plan.notes.append(f"{count_threads(threads)} per run: {why}")
    if not plan.device.startswith("cuda"):
        torch.set_num_threads(threads)  # the machine probe measures what the runs will use
    factor = machine_factor(plan.device)
    budget = None
    if budget_s is not None:
        budget = Budget(budget_s - (time.perf_counter() - started), factor, plan.notes)
        plan.jobs = budget.first(plan.jobs)
    _announce(plan, factor)
    for note in plan.notes:
        print(f"note: {note}", file=sys.stderr)
    progress = Progress(plan.jobs, factor, bar=True)
    try:
        with _sigterm_interrupts():
            results, failures = run_plan(
                plan.jobs,
                isolated=not args.in_process,
                progress=progress,
                on_workload_done=lambda r: _save(r, args, len(plan.jobs)),
                rechoose=None if budget is None else (lambda jobs: budget.rechoose(jobs, progress)),
                cut=None
                if budget is None
                else (lambda jobs, done, rounds: budget.cut_rounds(jobs, done, rounds, progress)),
                on_round=lambda done, running: _save_round(done, running, args, len(plan.jobs)),
            )
    except KeyboardInterrupt:
        if args.log:
            print(f"{args.log} keeps the steps of every round that finished", file=sys.stderr)
        raise
    finally:
        progress.close()
    wall = format_duration(time.perf_counter() - started)
    outcome = budget.outcome(results) if budget is not None else None
    if outcome is not None:
        plan.notes.append(outcome)
    if results:
        table = format_table(results, plan.notes, header=_header(plan, threads))
        print(table, flush=True)
        _finish(results, args, plan, table, wall)
    print(f"total wall time {wall}{_estimates(progress)}", file=sys.stderr)
    for failure in failures:
        print(failure, file=sys.stderr)
    return 1 if failures else 0


def _budget_s(args: argparse.Namespace) -> float | None:
    """Seconds of ``--time`` (its default for the default size); None: no budget (``--steps`` fixes them).

    Raises:
        ValueError: for a malformed ``--time`` (see :func:`mixprec.bench.budget.parse_time`).
    """
    given = getattr(args, "time", None)
    seconds = parse_time(given if given is not None else DEFAULT_TIME)
    if args.steps is not None:
        if given is not None and seconds is not None:
            raise ValueError(f"--time {given} and --steps {args.steps} both set the length: give one of them")
        return None
    if given is None and (args.size or "default") != "default":
        return None
    return seconds


def _estimates(progress: Progress) -> str:
    if progress.first_total is None:
        return " (no estimate: no CPU reference, and the first round did not finish)"
    first = f"estimated {format_duration(progress.first_total)}"
    if not progress.corrections:
        return f" ({first})"
    at, total = progress.corrections[-1]
    return f" ({first}, corrected to {format_duration(total)} after {format_duration(at)})"
