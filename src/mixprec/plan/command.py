"""``mixprec plan``: run the precision planner on a bench workload or a user's model, print the table.

In the shape of ``mixprec.cli``'s ``SUBCOMMANDS`` table (HELP, add_arguments, run). The model is either a
bench workload (``mixprec.bench`` registry, built from ``--seed`` at ``--size``, planned on its first
``--batches`` training batches with its own loss) or ``--from module:function``, a function returning
``(model, batches, loss_fn)`` with ``loss_fn(model, batch) -> loss``. Writes the plan's JSON and plot.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import sys
import time
import types
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mixprec._files import write_atomic
from mixprec.lowbit.cost import QUANTIZE_PATHS

#: --budget when neither it nor --max-cost is given (plan_precision's default); both are refused.
_DEFAULT_BUDGET = 0.01

HELP = "plan a format per linear layer (low-bit, bf16, fp32) by measured divergence under a budget"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from mixprec.bench.workloads import SIZES, WORKLOADS
    from mixprec.plan.config import RECIPES
    from mixprec.plan.measure import HIGH_PRECISION

    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--workload",
        default="lm",
        choices=list(WORKLOADS),
        help="a bench workload (default lm); lm-gemm is sized for a GPU above --size tiny and is refused "
        "there (the plan runs on the CPU)",
    )
    source.add_argument(
        "--from",
        dest="factory",
        metavar="MODULE:FUNCTION",
        help="a function returning "
        "(model, batches, loss_fn); its module is imported from the current directory too",
    )
    parser.add_argument(
        "--size", default="tiny", choices=SIZES, help="bench workload size preset (default tiny)"
    )
    parser.add_argument("--batches", type=int, default=2, help="planning batches of a workload (default 2)")
    parser.add_argument(
        "--formats",
        default="nvfp4,mxfp8,bf16",
        metavar="FORMAT[,FORMAT]",
        help=f"comma-separated candidate formats (default nvfp4,mxfp8,bf16), from: "
        f"{', '.join([*RECIPES, *HIGH_PRECISION])}",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=None,
        help="bound on the plan's measured relative loss change, > 0, not with --max-cost (default 0.01)",
    )
    parser.add_argument(
        "--grad-budget", type=float, default=None, help="optional bound on its weight-gradient change"
    )
    parser.add_argument(
        "--max-cost",
        type=float,
        default=None,
        help="instead of --budget: the most accurate plan within this GEMM cost relative to all-bf16",
    )
    parser.add_argument(
        "--min-low-share", type=float, default=None, help="with --max-cost: least share of FLOPs below bf16"
    )
    parser.add_argument(
        "--measure",
        choices=("exact", "local"),
        default="exact",
        help="exact: a pass per layer and format; local: estimates from one pass (plans still measured) "
        "(default exact)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="price each format on the torch.compile path (--cost measured times the compiled layers)",
    )
    parser.add_argument(
        "--quantize",
        choices=QUANTIZE_PATHS,
        default=None,
        help="the quantization path a roofline --cost prices: fused (torch.compile), triton (CUDA eager), "
        "unfused (pure torch); default: fused with --compile, unfused if MIXPREC_FUSED_QUANTIZE=0, "
        "else triton",
    )
    parser.add_argument(
        "--exhaustive", action="store_true", help="measure every layer in every format (a complete plot)"
    )
    parser.add_argument(
        "--cost",
        default="b200",
        help="cost target: b200, h100, b200-peak, h100-peak, measured (timed here) (default b200, also for a "
        "--from model on a GPU)",
    )
    parser.add_argument(
        "--tokens-per-step",
        type=int,
        default=None,
        help="rows M of each layer's GEMMs in one training step: the shape the cost is priced at "
        "(default: the calibration batch's rows, with a warning)",
    )
    parser.add_argument(
        "--max-memory",
        default=None,
        help="bound on the step's memory (bytes, or '2GiB', '512MB'): the plan also picks the optimizer's "
        "state_format and the save_activations format (default: no bound, memory reported)",
    )
    parser.add_argument(
        "--weight-update",
        default="kahan",
        choices=("kahan", "stochastic", "masters"),
        help="how the model is stepped, for the memory model (default kahan)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seeds the workload, dropout and stochastic rounding (default 0)"
    )
    parser.add_argument(
        "--json", type=Path, default=Path("plan.json"), help="where the plan goes (default: ./plan.json)"
    )
    parser.add_argument(
        "--plot", type=Path, default=Path("plan.png"), help="where the plot goes (default: ./plan.png)"
    )


def _say(text: str) -> None:
    """What the command is doing, on stderr (stdout keeps the table)."""
    print(f"mixprec plan: {text}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    import torch

    from mixprec.bench.jobs import refuse_gpu_presets
    from mixprec.bench.progress import format_duration
    from mixprec.plan.planner import plan_precision

    if args.batches < 1:
        raise ValueError(f"--batches must be >= 1, got {args.batches}")
    for flag, path, name in (("--json", args.json, "plan.json"), ("--plot", args.plot, "plan.png")):
        if not path.parent.is_dir():
            raise FileNotFoundError(f"output folder {path.parent} does not exist")
        if path.is_dir():  # refused now, not by a traceback after the planning
            raise ValueError(f"{flag} {path} is a folder; name a file in it, e.g. {path / name}")
    _check_plot_format(args.plot)
    formats = tuple(f.strip() for f in args.formats.split(",") if f.strip())
    if not args.factory:
        refuse_gpu_presets(
            [args.workload],
            args.size,
            work=f"and a plan makes a forward and backward pass per layer and format on each of its "
            f"{args.batches} batches: hours",
            hint="mixprec plan builds bench workloads on the CPU: plan it at --size tiny, or pass "
            "--from MODULE:FUNCTION with the model on a GPU",
        )
        _say(f"building workload {args.workload} at size {args.size} on the CPU")
    started = time.perf_counter()
    model, batches, loss_fn = _from_factory(args.factory) if args.factory else _from_workload(args)
    if isinstance(batches, Iterator):  # a generator: read once here, as plan_precision would
        batches = list(batches)
    linears = sum(isinstance(module, torch.nn.Linear) for module in model.modules())
    _say(
        f"planning {linears} linear layer(s) in {', '.join(formats)} on {_count(batches)} "
        f"(--measure {args.measure}: forward and backward passes per layer and format; the table follows)"
    )
    with warnings.catch_warnings(record=True) as caught:  # the filters in force still apply
        plan = _plan(plan_precision, model, batches, loss_fn, formats, args)
    for warning in caught:
        _say_warning(warning)
    _say(f"planned in {format_duration(time.perf_counter() - started)}")
    print(plan.table())
    write_atomic(args.json, plan.to_json())  # complete or absent, see mixprec._files
    plan.plot(args.plot)
    print(f"wrote {args.json.resolve()} and {args.plot.resolve()} (--json and --plot choose where)")
    return 0


def _check_plot_format(path: Path) -> None:
    """Refuse a --plot suffix matplotlib cannot write before planning (the plot is drawn after it)."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:  # PrecisionPlan.plot says how to install it
        return
    suffix = path.suffix.lstrip(".").lower() or "png"
    supported = FigureCanvasBase.get_supported_filetypes()
    if suffix not in supported:
        raise ValueError(
            f"--plot {path}: matplotlib cannot write '.{suffix}'; accepted: {', '.join(sorted(supported))}"
        )


def _count(batches: Any) -> str:
    """``"2 batch(es)"``; an iterable without a length (a DataLoader over an IterableDataset) is counted
    by plan_precision as it reads it."""
    try:
        return f"{len(batches)} batch(es)"
    except TypeError:
        return "the given batches"


def _say_warning(warning: warnings.WarningMessage) -> None:
    """The planner's warnings as a CLI user reads them: its keyword arguments named by their flags,
    one plain line on stderr (not Python's ``file:line: UserWarning``); other warnings shown as usual."""
    text = str(warning.message)
    if text.startswith("plan_precision: tokens_per_step not given"):
        text = text.replace("plan_precision: tokens_per_step not given", "--tokens-per-step not given")
        text = text.replace("pass tokens_per_step=N", "pass --tokens-per-step N")
        print(f"mixprec plan: note: {text}", file=sys.stderr)
        return
    warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno)


def _plan(plan_precision: Any, model: Any, batches: Any, loss_fn: Any, formats: tuple, args: Any) -> Any:
    return plan_precision(
        model,
        batches,
        loss_fn,
        formats=formats,
        budget=_DEFAULT_BUDGET if args.budget is None and args.max_cost is None else args.budget,
        max_cost=args.max_cost,
        min_low_share=args.min_low_share,
        cost=args.cost,
        tokens_per_step=args.tokens_per_step,
        grad_budget=args.grad_budget,
        exhaustive=args.exhaustive,
        measure=args.measure,
        seed=args.seed,
        max_memory=int(args.max_memory) if str(args.max_memory).isdigit() else args.max_memory,
        weight_update=args.weight_update,
        compiled=args.compile,
        quantize=args.quantize,
    )


def _from_workload(args: argparse.Namespace) -> tuple[Any, list, Any]:
    import torch

    from mixprec.bench.workloads import WORKLOADS

    if args.workload not in WORKLOADS:
        raise ValueError(f"unknown workload {args.workload!r}; known: {', '.join(WORKLOADS)}")
    spec = WORKLOADS[args.workload]
    if args.size not in spec.presets:
        raise ValueError(f"unknown size {args.size!r}; known: {', '.join(spec.presets)}")
    preset = spec.presets[args.size]
    job = types.SimpleNamespace(seed=args.seed, data=None, images=None)
    work = spec.build(spec.load(preset, job), preset, args.seed, 1, torch.device("cpu"))
    batches = list(itertools.islice(work.batches, args.batches))

    def loss_fn(model: torch.nn.Module, batch: tuple) -> torch.Tensor:
        return work.loss_fn(model(batch[0]), batch[1])

    return work.model, batches, loss_fn


def _from_factory(spec: str) -> tuple[Any, Any, Any]:
    module_name, sep, function = spec.partition(":")
    if not sep or not module_name or not function:
        raise ValueError(f"--from must be MODULE:FUNCTION, got {spec!r}")
    if "" not in sys.path:
        sys.path.insert(0, "")
    try:
        factory = getattr(importlib.import_module(module_name), function)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load {spec!r}: {exc}") from None
    if not callable(factory):
        raise ValueError(
            f"--from {spec!r} is a {type(factory).__name__}, not a function returning "
            "(model, batches, loss_fn)"
        )
    result = factory()
    if not isinstance(result, tuple) or len(result) != 3:
        raise ValueError(f"{spec} must return (model, batches, loss_fn), got {type(result).__name__}")
    return result
