"""The planner's measured GEMM cost per format and layer shape, relative to bf16, beside the roofline models.

Shapes: the linear layers of the bench's ``lm`` workload at size ``tiny`` (batch 8, as
``benchmarks/plan_precision.py`` plans it) and of its teacher task's outlier MLP (batches of 64), found by
one forward pass with hooks, plus any ``--shape M,N,K``. Per shape, ``mixprec.plan.cost``'s
``MeasuredCost`` (what ``plan_precision(cost="measured")`` uses) times the three training GEMMs of an
``nn.Linear(K, N)`` swapped to each format (forward on an ``(M, K)`` input, input and weight gradients
of an ``(M, N)`` output gradient): ``--warmup`` untimed calls, then ``--repeats`` rounds interleaving the
formats; reported are the median seconds, their IQR, and the median over bf16's median, next to the
roofline cost over bf16 of ``b200`` and ``h100`` (``mixprec.plan.cost.gemm_cost``), its quantization
priced on the path the measured layer ran (``row["b200"]``: ``"unfused"`` on a CPU, ``quantize_path()`` on
CUDA) and on each path of ``QUANTIZE_PATHS`` (``row["b200:fused"]`` ...); the table prints the measured
path's and the fused (compiled) one's.

On a CPU every low-bit format is emulated in PyTorch (quantize, dequantize, a float GEMM), so it is
slower than bf16 there: the figures show what measured cost does on a machine without the hardware (the
planner then keeps layers in bf16 or fp32, whichever is faster). A CPU timing is wall time
(``time.perf_counter``), noisy on a shared machine; the interleaving spreads the noise over the formats
alike. On CUDA, each format's GEMMs run on the tensor-core kernel ``mixprec.lowbit.gemm.kernel_path``
names for the device, else emulated. A format that raises at a shape gets a row with its ``error`` (the
other formats are then timed one by one, so they keep their figures); the exit code is then 1.
The layer and its input are float32 by default; ``--dtype bfloat16`` makes them bf16, as a bf16 model
trains them, so a recipe's high-precision GEMMs (``fp8_rowwise_gw_hp``'s weight gradient) run in bf16 like
the bf16 reference, not in float32 (``fp32`` is then left out of the formats).
``--json`` is rewritten after each shape (``meta.shapes_done`` of ``shapes_planned``), so a run cut
short by a time limit keeps the shapes it measured.

Usage::

    python benchmarks/plan_cost.py --threads 1 --json benchmarks/plan_cost.json
    python benchmarks/plan_cost.py --device cuda --shape 8192,8192,8192 --json plan_cost_cuda.json
    python benchmarks/plan_cost.py --device cuda --dtype bfloat16 --formats fp8_rowwise,fp8_rowwise_gw_hp
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from dataclasses import replace

import torch
from torch import nn

from mixprec.bench import data as datasets
from mixprec.bench.workloads import WORKLOADS
from mixprec.inspect.demo import OutlierMLP
from mixprec.lowbit import RECIPES
from mixprec.lowbit.cost import QUANTIZE_PATHS, quantize_path
from mixprec.plan.cost import TARGETS, MeasuredCost, gemm_cost, measured_name

ROOFLINES = ("b200", "h100")


def _shapes(model: nn.Module, *inputs: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(M, N, K)`` of each linear layer's first call, in call order, without repeats."""
    found: list[tuple[int, int, int]] = []

    def hook(module: nn.Linear, args: tuple, output: torch.Tensor) -> None:
        shape = (args[0].numel() // module.in_features, module.out_features, module.in_features)
        if shape not in found:
            found.append(shape)

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, nn.Linear)]
    with torch.no_grad():
        model(*inputs)
    for handle in handles:
        handle.remove()
    return found


def workload_shapes() -> dict[str, list[tuple[int, int, int]]]:
    spec = WORKLOADS["lm"]
    preset = spec.presets["tiny"]
    preset = replace(preset, params={**preset.params, "batch": 8, "eval_windows": 32})
    work = spec.build(datasets.text_corpus(preset.params["corpus_bytes"]), preset, 0, 1, torch.device("cpu"))
    x, _ = next(iter(work.batches))
    return {"lm": _shapes(work.model, x), "teacher": _shapes(OutlierMLP(), torch.randn(64, 64))}


def _quartiles(values: list[float]) -> list[float]:
    if len(values) < 2:
        return [values[0], values[0]]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return [q[0], q[2]]


def _timed(cost: MeasuredCost, formats: list[str], shape: tuple[int, int, int], args) -> dict[str, str]:
    """Time every format at ``shape`` into ``cost.samples``, interleaved; returns format -> error.

    When the interleaved measurement raises, each format is timed alone, so only the formats that raise
    themselves are lost (their error is kept, the others' timings stand).
    """
    try:
        for fmt in formats:
            cost(fmt, *shape)
        return {}
    except Exception:
        pass
    errors = {}
    for fmt in formats:
        alone = MeasuredCost(args.device, _dtype(args), [fmt], warmup=args.warmup, repeats=args.repeats)
        try:
            alone(fmt, *shape)
        except Exception as exc:
            errors[fmt] = f"{type(exc).__name__}: {exc}"
            print(f"plan_cost: {fmt} at M,N,K={shape} failed: {errors[fmt]}", file=sys.stderr)
        cost.samples.update(alone.samples)
    return errors


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _dtype(args) -> torch.dtype:
    """The layer's parameter and input dtype (``args.dtype``, float32 when absent)."""
    return DTYPES[getattr(args, "dtype", "float32")]


def measure(shapes, formats, args) -> tuple[list[dict], str]:
    """One row per (shape, format); a format that raises at a shape gets a row with its ``error``."""
    cost = MeasuredCost(args.device, _dtype(args), formats, warmup=args.warmup, repeats=args.repeats)
    # the path the timed (eager) layers quantize on: pure torch on a CPU, Triton on CUDA unless switched off
    path = quantize_path() if cost.device.type == "cuda" else "unfused"
    rows = []
    for source, (m, n, k) in shapes:
        errors = _timed(cost, formats, (m, n, k), args)
        bf16 = None if "bf16" in errors else cost("bf16", m, n, k)
        for fmt in formats:
            row = {"source": source, "shape": [m, n, k], "format": fmt}
            for name in ROOFLINES:
                target = TARGETS[name]
                bf16_roof = gemm_cost(target, "bf16", m, n, k)
                for p in QUANTIZE_PATHS:
                    row[f"{name}:{p}"] = gemm_cost(target, fmt, m, n, k, p) / bf16_roof
                row[name] = row[f"{name}:{path}"]
            if fmt in errors:
                rows.append({**row, "error": errors[fmt]})
                continue
            samples = cost.samples[(str(cost.device), fmt, m, n, k)]
            row.update(median_s=cost(fmt, m, n, k), iqr_s=_quartiles(samples), samples_s=samples)
            row["relative_to_bf16"] = row["median_s"] / bf16 if bf16 else None
            rows.append(row)
    return rows, cost.__name__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--formats", default=",".join([*RECIPES, "bf16", "fp32"]))
    parser.add_argument("--shape", action="append", default=[], help="an extra M,N,K (repeatable)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    parser.add_argument(
        "--dtype", choices=list(DTYPES), default="float32",
        help="the layer's parameters and input; a low-bit recipe's high-precision GEMMs run in it",
    )  # fmt: skip
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    formats = [f for f in args.formats.split(",") if f]
    if args.dtype != "float32" and "fp32" in formats:
        if args.formats != parser.get_default("formats"):
            parser.error(f"--formats fp32 needs --dtype float32 (a {args.dtype} layer has no fp32 GEMM)")
        formats.remove("fp32")
    if "bf16" not in formats:
        formats.append("bf16")  # the reference of every ratio
    shapes = [(src, s) for src, found in workload_shapes().items() for s in found]
    shapes += [("extra", tuple(int(v) for v in s.split(","))) for s in args.shape]
    print(f"{measured_name(torch.device(args.device))}: median seconds of the three GEMMs / bf16's "
          "(roofline b200, h100 / bf16: quantization on the measured path, then fused)")  # fmt: skip
    print(f"{'source':8} {'M,N,K':>16} {'format':18} {'median s':>10} {'IQR s':>21} {'x bf16':>7} "
          "b200 fused  h100 fused")  # fmt: skip
    rows: list[dict] = []
    for done, shape in enumerate(shapes, 1):  # the JSON after each shape: a run cut short keeps what it has
        new, name = measure([shape], formats, args)
        _print_rows(new)
        rows += new
        if args.json:
            meta = {"argv": sys.argv, "torch": torch.__version__, "threads": torch.get_num_threads()}
            meta.update(machine=platform.processor() or platform.machine(), cost=name)
            meta.update(shapes_done=done, shapes_planned=len(shapes))
            with open(args.json, "w") as f:
                json.dump({"meta": meta, "args": vars(args), "results": rows}, f, indent=1)
    return 1 if any("error" in r for r in rows) else 0


def _print_rows(rows: list[dict]) -> None:
    for r in rows:
        shape = ",".join(map(str, r["shape"]))
        if "error" in r:
            print(f"{r['source']:8} {shape:>16} {r['format']:18} FAILED: {r['error']}")
            continue
        iqr = f"{r['iqr_s'][0]:.2e}-{r['iqr_s'][1]:.2e}"
        ratio = "-" if r["relative_to_bf16"] is None else f"{r['relative_to_bf16']:.2f}"
        print(
            f"{r['source']:8} {shape:>16} {r['format']:18} {r['median_s']:10.2e} {iqr:>21} "
            f"{ratio:>7} {r['b200']:.2f} {r['b200:fused']:.2f}  {r['h100']:.2f} {r['h100:fused']:.2f}",
            flush=True,
        )


if __name__ == "__main__":
    sys.exit(main())
