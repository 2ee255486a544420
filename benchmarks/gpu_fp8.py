"""fp8 training speed in one process: bf16, torchao and mixprec float8, eager and compiled, side by side.

The model is the bench's ``CharGPT`` (pre-LN blocks, 4x GELU MLP, SDPA attention), 2 layers of width 4096,
32 heads, context 2048, batch 4, vocabulary 256 (403M parameters) on ``--device cuda``; a toy of width 64
on ``--device cpu`` (what ``benchmarks/gpu.sh --dry-run`` runs). Parameters are bf16 (no autocast), the
optimizer torch's AdamW (fused on CUDA). Configs, in this order:

- ``bf16``: the model as it is;
- ``torchao tensorwise`` / ``torchao rowwise``: ``torchao.float8.convert_to_float8_training`` with
  ``Float8LinearConfig.from_recipe_name`` (left out, with the import error, where torchao does not import);
- ``mixprec tensorwise`` / ``mixprec rowwise``: ``mixprec.float8.convert_to_float8_training`` with
  ``Float8Config.from_recipe_name``;

every Linear converted but the output head, in both libraries. Each config runs eager, then compiled:
each transformer block ``.compile()``-d (torch's regional compilation: the two blocks share one compiled
graph, so a config's warm-up compiles once; ``--compile-backend``, default inductor on CUDA and
aot_eager on a CPU, where inductor's C++ build would take minutes).

A step is what a user pays for: zero_grad, forward, cross-entropy, backward and AdamW's step, timed by the
wall clock between two synchronizes. After ``--warmup`` untimed steps per config (the compile happens
there; its seconds are reported), ``--rounds`` rounds each run ``--steps`` steps of every config in
turn, the order rotated each round, so a change in the machine's speed lands on all alike. Reported per
config: the median over rounds of the round's median step time and the range of the round medians; the
ratio to bf16 (same eager/compiled) paired round by round (median, range); the transient memory of a
step, ``torch.cuda.max_memory_allocated`` during the step minus the memory allocated before it (the
activations and temporaries; weights, gradients kept by ``set_to_none`` zeroing aside); the graph breaks
Dynamo counted while compiling it. Then the GEMM level, at ``--gemm-shape`` (8192^3 on CUDA): one
bf16 ``nn.Linear``'s forward and both backward GEMMs with their quantization, per format, timed by
``benchmarks/plan_cost.py``'s ``measure`` (``mixprec.plan.cost.MeasuredCost``: interleaved repeats,
median and IQR), relative to bf16; and at the same shape, one rowwise fp8 GEMM (bf16 out, no fast
accumulation) three ways: torch's rowwise kernel (CUTLASS), and what mixprec runs (torchao's
``addmm_float8_unwrapped``): the tensorwise kernel with unit scales then ``out *= scale_a * scale_b``,
the scaling fused (Triton) or torch's expression, interleaved rounds of ``--gemm-repeats`` timed calls,
median and range in ms, TFLOP/s, the ratio to the rowwise kernel, the transient memory of a call, and
whether the fused scaling gives torch's expression's bits (the CPU has no rowwise kernel: that row is
skipped there). Then the quantize level, at ``--quant-shape`` (8192x8192 bf16 on
CUDA): per fp8 format, an operand quantized along K and its transposed copy quantized along M (what the
forward and the backward need), by the pure-torch quantizers (``MIXPREC_FUSED_QUANTIZE=0``) and by the
fused Triton kernels (``mixprec.lowbit.triton_quantize``, where the device has them), interleaved
rounds of ``--quant-repeats`` timed calls each, the median and range in ms and in GB/s (the input read
once and two fp8 copies written), and whether the fused result is the pure-torch one bit for bit; for
``F64_SCALE_FORMATS`` also the fused kernels with their scales divided in float64 (``fused f64``, the
division they made before the float32 one: the same bits, more registers). Then
the passes: per lowbit recipe, the operand quantizations (each one read of a high-precision input,
weight or grad_output) one ``LowbitLinearFunction`` forward and backward makes, counted by a patched
counter, per use (``mixprec.lowbit.gemm.SHARE_CASTS = False``, as before the cast-transpose) and shared
(the default), with whether both give the same output and gradients bit for bit; counts, not times, so
the CPU's figures are the GPU's.

A config that fails (to convert, to compile, in a step) gets its row with the error and the others go on.
``--json`` is rewritten after every round and every row (``benchmarks/checkpoint.py``; ``"partial"``
until the end, also on SIGTERM), and ``--budget-s`` makes the script itself stop starting compiles that
would not finish in time (a skipped config says so), so a time limit loses at most the round in progress.
Exit code 1 if a config failed.

Usage::

    python benchmarks/gpu_fp8.py --device cuda --budget-s 85 --json fp8.json
    python benchmarks/gpu_fp8.py --device cpu                 # the toy, eager and aot_eager-compiled
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mixprec.bench.models import CharGPT
from mixprec.float8 import Float8Config
from mixprec.float8 import convert_to_float8_training as mixprec_convert
from mixprec.lowbit.triton_quantize import ENV_SWITCH

sys.path.insert(0, str(Path(__file__).resolve().parent))
import plan_cost  # a sibling script, not a package: its GEMM timing is reused, not copied
from checkpoint import STOPPED, stop_on_sigterm, write_json

GIB = 2**30
VOCAB = 256
SIZES = {
    "cuda": {"width": 4096, "layers": 2, "heads": 32, "context": 2048, "batch": 4},
    "cpu": {"width": 64, "layers": 2, "heads": 2, "context": 32, "batch": 2},
}
CONFIGS = (
    ("bf16", None),
    ("mixprec", "tensorwise"),
    ("torchao", "tensorwise"),
    ("mixprec", "rowwise"),
    ("torchao", "rowwise"),
)
GEMM_FORMATS = ("bf16", "fp8_tensorwise", "fp8_rowwise", "fp8_blockwise", "fp8_rowwise_gw_hp")
GEMM_SHAPE = {"cuda": "8192,8192,8192", "cpu": "64,64,64"}
QUANT_FORMATS = ("fp8_tensorwise", "fp8_tensorwise_e5m2", "fp8_rowwise", "fp8_blockwise", "fp8_blockwise_2d")
#: Formats whose fused kernels are also timed with the scale divided in float64 (``fused f64`` rows): where
#: the float32 division changed registers most for sm_90 (docs/measured-figures.md: the 1x128 cast-transpose
#: spilled, the per-row casts held 220 registers).
F64_SCALE_FORMATS = ("fp8_rowwise", "fp8_blockwise")
QUANT_SHAPE = {"cuda": "8192,8192", "cpu": "64,256"}
#: A guess at one config's compile warm-up before any has run (seconds), for ``--budget-s``.
FIRST_COMPILE_GUESS_S = {"cuda": 25.0, "cpu": 10.0}
#: Seconds kept for the compiled configs' rounds when deciding whether one more compile fits.
ROUNDS_RESERVE_S = {"cuda": 6.0, "cpu": 2.0}


def _not_head(module: nn.Module, fqn: str) -> bool:
    return fqn != "head"


def convert(library: str, recipe: str | None, model: nn.Module, device: torch.device) -> None:
    """Swap ``model``'s Linear layers (the head aside) for ``library``'s fp8 ones of ``recipe``."""
    if library == "mixprec":
        mixprec_convert(model, config=Float8Config.from_recipe_name(recipe), module_filter_fn=_not_head)
    elif library == "torchao":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torchao warns about its optional C extensions
            from torchao.float8 import Float8LinearConfig
            from torchao.float8 import convert_to_float8_training as torchao_convert
        config = Float8LinearConfig.from_recipe_name(recipe)
        if device.type != "cuda":
            config = dataclasses.replace(config, emulate=True)  # no fp8 GEMM on a CPU
        torchao_convert(model, config=config, module_filter_fn=_not_head)


def _graph_breaks() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


class Config:
    """One (library, recipe, eager or compiled) model with its optimizer and fixed batch (:meth:`build`)."""

    def __init__(self, library: str, recipe: str | None, compiled: bool, device: torch.device) -> None:
        self.library, self.recipe, self.compiled, self.device = library, recipe, compiled, device
        self.name = f"{library} {recipe}" if recipe else library
        self.times: dict[int, list[float]] = {}  # round -> step seconds
        self.transient: list[int] = []
        self.warmup_s: float | None = None
        self.graph_breaks: int | None = None
        self.error: str | None = None

    def build(self, args: argparse.Namespace) -> None:
        size = SIZES[self.device.type]
        torch.manual_seed(0)
        with torch.device(self.device):
            model = CharGPT(VOCAB, size["context"], size["width"], size["layers"], size["heads"])
        self.model = model.to(torch.bfloat16)
        convert(self.library, self.recipe, self.model, self.device)
        if self.compiled:
            for block in self.model.blocks:
                block.compile(backend=args.compile_backend)
        fused = {"fused": True} if self.device.type == "cuda" else {}
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, **fused)
        gen = torch.Generator(self.device).manual_seed(1)
        shape = (size["batch"], size["context"] + 1)
        tokens = torch.randint(0, VOCAB, shape, generator=gen, device=self.device)
        self.x, self.y = tokens[:, :-1], tokens[:, 1:]

    def step(self) -> tuple[float, int]:
        """One training step: its wall seconds and its transient bytes (CUDA; 0 on a CPU)."""
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            before = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        logits = self.model(self.x)
        loss = F.cross_entropy(logits.float().view(-1, VOCAB), self.y.reshape(-1))
        loss.backward()
        self.optimizer.step()
        if cuda:
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        transient = torch.cuda.max_memory_allocated(self.device) - before if cuda else 0
        if not torch.isfinite(loss):
            raise FloatingPointError(f"{self.name}: loss {loss.item()} after {len(self.transient)} steps")
        return seconds, transient

    def warm_up(self, steps: int) -> None:
        breaks = _graph_breaks()
        start = time.perf_counter()
        for _ in range(steps):
            self.step()
        self.warmup_s = time.perf_counter() - start
        if self.compiled:
            self.graph_breaks = _graph_breaks() - breaks

    def run_round(self, index: int, steps: int) -> None:
        for _ in range(steps):
            seconds, transient = self.step()
            self.times.setdefault(index, []).append(seconds)
            self.transient.append(transient)

    def release(self) -> None:
        """Drop the model and optimizer (their memory goes back to the allocator)."""
        self.model = self.optimizer = None  # type: ignore[assignment]


def _range(values: list[float]) -> list[float]:
    return [min(values), max(values)] if values else []


def row(config: Config, reference: Config | None) -> dict[str, Any]:
    """The config's row: medians over rounds, the paired ratio to ``reference`` (bf16), memory."""
    out: dict[str, Any] = {"config": config.name, "library": config.library, "recipe": config.recipe}
    out.update(compiled=config.compiled, warmup_s=config.warmup_s, graph_breaks=config.graph_breaks)
    if config.error is not None:
        out["error"] = config.error
    medians = {r: statistics.median(t) for r, t in config.times.items()}
    if not medians:
        return out
    out.update(rounds=len(medians), step_ms=statistics.median(medians.values()) * 1e3)
    out["step_ms_range"] = [v * 1e3 for v in _range(list(medians.values()))]
    if config.device.type == "cuda":
        out["transient_gib"] = statistics.median(config.transient) / GIB
    if reference is not None and reference.times:
        theirs = {r: statistics.median(t) for r, t in reference.times.items()}
        ratios = [medians[r] / theirs[r] for r in medians if r in theirs]
        if ratios:
            out.update(vs_bf16=statistics.median(ratios), vs_bf16_range=_range(ratios))
    return out


def _error(exc: BaseException) -> str:
    """``Type: message`` in one line (a compile error's message is its last line), at most 2000 characters."""
    lines = "".join(traceback.format_exception_only(exc)).strip().splitlines()
    return (lines[-1] if lines else type(exc).__name__)[:2000]


def _attempt(config: Config, call: Callable[[], object]) -> bool:
    """``call()``; on an error it is the config's, its memory is freed and False is returned."""
    try:
        call()
        return True
    except Exception as exc:  # one failing config (a compile error, an fp8 kernel) must not stop the rest
        config.error = _error(exc)
        print(f"gpu_fp8: {config.name}{' compiled' if config.compiled else ''} failed: {config.error}",
              file=sys.stderr, flush=True)  # fmt: skip
        config.release()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return False


class Results:
    """Every row so far, written to ``--json`` whole after each change."""

    def __init__(self, args: argparse.Namespace) -> None:
        device = torch.device(args.device)
        self.path = args.json
        self.meta: dict[str, Any] = {"device": str(device), "torch": torch.__version__, **SIZES[device.type]}
        self.meta.update(vocab=VOCAB, rounds=args.rounds, steps=args.steps, warmup=args.warmup)
        self.meta.update(compile_backend=args.compile_backend, dtype="bfloat16 parameters, no autocast")
        if device.type == "cuda":
            self.meta["gpu"] = torch.cuda.get_device_name(device)
        try:
            import torchao

            self.meta["torchao"] = torchao.__version__
        except Exception as exc:
            self.meta["torchao"] = None
            self.meta["torchao_error"] = _error(exc)
        self.configs: dict[bool, list[Config]] = {False: [], True: []}
        self.skipped: list[dict[str, Any]] = []
        self.gemm: list[dict[str, Any]] = []
        self.rowwise_gemm: list[dict[str, Any]] = []
        self.quantize: list[dict[str, Any]] = []
        self.passes: list[dict[str, Any]] = []

    def rows(self) -> list[dict[str, Any]]:
        out = []
        for compiled in (False, True):
            reference = next((c for c in self.configs[compiled] if c.library == "bf16"), None)
            out += [row(c, reference) for c in self.configs[compiled]]
        return out + self.skipped

    def save(self, partial: str | None) -> None:
        data = {
            "meta": self.meta,
            "rows": self.rows(),
            "gemm": self.gemm,
            "rowwise_gemm": self.rowwise_gemm,
            "quantize": self.quantize,
            "passes": self.passes,
        }
        write_json(self.path, data, partial)


def run_configs(results: Results, compiled: bool, args: argparse.Namespace, started: float) -> None:
    """Build and warm up each config (compiled ones while ``--budget-s`` leaves time for a compile like
    the longest so far), then the interleaved rounds."""
    device = torch.device(args.device)
    warmups: list[float] = []
    for library, recipe in args.configs:
        config = Config(library, recipe, compiled, device)
        label = f"{config.name}{' compiled' if compiled else ''}"
        if library == "torchao" and results.meta["torchao"] is None:
            results.skipped.append(
                {"config": config.name, "compiled": compiled, "skipped": "torchao does not import"}
            )
            continue
        left = None if args.budget_s is None else args.budget_s - (time.perf_counter() - started)
        guess = max(warmups, default=FIRST_COMPILE_GUESS_S[device.type])
        if compiled and left is not None and left < 1.2 * guess + ROUNDS_RESERVE_S[device.type]:
            why = f"budget: {left:.0f} s of {args.budget_s:.0f} left, a compiled warm-up took {guess:.0f} s"
            results.skipped.append({"config": config.name, "compiled": compiled, "skipped": why})
            results.save(f"running: {label} skipped")
            continue
        results.configs[compiled].append(config)
        if _attempt(config, lambda c=config: c.build(args)) and _attempt(
            config, lambda c=config: c.warm_up(args.warmup)
        ):
            warmups.append(config.warmup_s or 0.0)
        results.save(f"running: {label} warmed up")
    active = [c for c in results.configs[compiled] if c.error is None]
    for index in range(args.rounds):
        shift = index % len(active) if active else 0
        for config in active[shift:] + active[:shift]:
            _attempt(config, lambda c=config, i=index: c.run_round(i, args.steps))
        active = [c for c in active if c.error is None]
        results.save(f"running: {'compiled' if compiled else 'eager'} round {index + 1} of {args.rounds}")
    for config in results.configs[compiled]:
        config.release()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_gemm(results: Results, args: argparse.Namespace) -> None:
    """The GEMM level: plan_cost's measure at ``--gemm-shape`` (one shape, every format interleaved)."""
    shape = tuple(int(v) for v in args.gemm_shape.split(","))
    # bf16 layers, as the steps' model: rowwise_gw_hp's high-precision wgrad then runs in bf16, as bf16's
    options = argparse.Namespace(
        device=args.device, warmup=args.gemm_warmup, repeats=args.gemm_repeats, dtype="bfloat16"
    )
    try:
        rows, _ = plan_cost.measure([("gemm", shape)], list(GEMM_FORMATS), options)
    except Exception as exc:
        results.gemm = [{"shape": list(shape), "error": _error(exc)}]
        return
    results.gemm = [
        {k: r.get(k) for k in ("format", "shape", "median_s", "iqr_s", "relative_to_bf16", "error")}
        for r in rows
    ]


ROWWISE_PATHS = ("rowwise kernel", "tensorwise + fused post-scale", "tensorwise + torch post-scale")


def _with_switch(value: str, fn: Callable[[], Any]) -> Any:
    """``fn()`` with ``MIXPREC_FUSED_QUANTIZE`` set to ``value`` (restored after)."""
    before = os.environ.get(ENV_SWITCH)
    os.environ[ENV_SWITCH] = value
    try:
        return fn()
    finally:
        if before is None:
            del os.environ[ENV_SWITCH]
        else:
            os.environ[ENV_SWITCH] = before


def run_rowwise_gemm(results: Results, args: argparse.Namespace) -> None:
    """The rowwise GEMM paths at ``--gemm-shape`` (see the module doc): the rowwise kernel against the
    tensorwise kernel with the scales applied after, fused and not, timed in turn each round."""
    from mixprec.lowbit import gemm as lowbit_gemm
    from mixprec.lowbit import triton_quantize
    from mixprec.lowbit.kernels import KERNELS
    from mixprec.lowbit.quantize import quantize

    device = torch.device(args.device)
    m, n, k = (int(v) for v in args.gemm_shape.split(","))
    gen = torch.Generator(device).manual_seed(0)
    x = torch.randn(m, k, device=device, generator=gen).to(torch.bfloat16)
    w = torch.randn(n, k, device=device, generator=gen).to(torch.bfloat16)
    qa, qb = quantize(x, "fp8_rowwise_fp32"), quantize(w, "fp8_rowwise_fp32")
    mat_a, mat_b, da, db = qa.data, qb.data.t(), qa.block_descale(), qb.block_descale().t()
    del x, w
    rowwise = next(kern for kern in KERNELS if kern.name == "fp8_rowwise")
    bf16 = torch.bfloat16
    calls: dict[str, Callable[[], torch.Tensor]] = {
        ROWWISE_PATHS[0]: lambda: lowbit_gemm._call(rowwise, mat_a, mat_b, da, db, bf16, False),
        ROWWISE_PATHS[1]: lambda: lowbit_gemm._rowwise_post_scaled(mat_a, mat_b, da, db, bf16),
        ROWWISE_PATHS[2]: lambda: _with_switch(
            "0", lambda: lowbit_gemm._rowwise_post_scaled(mat_a, mat_b, da, db, bf16)
        ),
    }
    rows = {p: {"path": p, "shape": [m, n, k]} for p in ROWWISE_PATHS}
    outs: dict[str, torch.Tensor] = {}
    if device.type != "cuda":
        rows[ROWWISE_PATHS[0]]["skipped"] = f"no rowwise kernel on {device.type}"
        del calls[ROWWISE_PATHS[0]]
    probe = torch.empty(1, 1, dtype=bf16, device=device)
    if not triton_quantize.post_scale_eligible(probe):
        why = f"not eligible on {device.type} (Triton {triton_quantize.triton_available()})"
        rows[ROWWISE_PATHS[1]]["skipped"] = why
        del calls[ROWWISE_PATHS[1]]
    for path in list(calls):  # the first call (Triton's compile) and the output to compare
        try:
            outs[path] = calls[path]()
            _sync(device)
        except Exception as exc:
            rows[path]["error"] = _error(exc)
            del calls[path]
    times: dict[str, list[float]] = {p: [] for p in calls}
    transient: dict[str, int] = {}
    keys = list(calls)
    for rnd in range(args.gemm_repeats):
        for path in keys[rnd % len(keys) :] + keys[: rnd % len(keys)] if keys else []:
            _sync(device)
            if device.type == "cuda":
                before = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
            started = time.perf_counter()
            calls[path]()
            _sync(device)
            times[path].append(time.perf_counter() - started)
            if device.type == "cuda":
                transient[path] = torch.cuda.max_memory_allocated(device) - before
    for path, row_ in rows.items():
        if times.get(path):
            ms = [t * 1e3 for t in times[path]]
            row_.update(median_ms=statistics.median(ms), range_ms=_range(ms), repeats=len(ms))
            row_["tflops"] = 2 * m * n * k / (row_["median_ms"] * 1e-3) / 1e12
            if path in transient:
                row_["transient_mib"] = transient[path] / 2**20
    base = rows[ROWWISE_PATHS[0]].get("median_ms")
    for path in ROWWISE_PATHS[1:]:
        if base and "median_ms" in rows[path]:
            rows[path]["vs_rowwise_kernel"] = rows[path]["median_ms"] / base
        if path in outs and ROWWISE_PATHS[0] in outs:  # two roundings of one product: near, not equal
            diff = (outs[path].float() - outs[ROWWISE_PATHS[0]].float()).abs().max()
            rows[path]["max_abs_diff_vs_rowwise_kernel"] = float(diff)
    fused, plain = outs.get(ROWWISE_PATHS[1]), outs.get(ROWWISE_PATHS[2])
    if fused is not None and plain is not None:
        rows[ROWWISE_PATHS[1]]["bitwise_vs_torch_post_scale"] = bool(torch.equal(fused, plain))
        if not torch.equal(fused, plain):
            rows[ROWWISE_PATHS[1]]["error"] = "the fused post-scale differs from torch's out *= a * b"
    results.rowwise_gemm = list(rows.values())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _pure_pair(x: torch.Tensor, fmt: str) -> tuple[Any, Any]:
    """``x`` quantized along K and ``x.T`` along M by the pure-torch quantizers (the switch set)."""
    from mixprec.lowbit.quantize import quantize

    before = os.environ.get(ENV_SWITCH)
    os.environ[ENV_SWITCH] = "0"
    try:
        return quantize(x, fmt, pad=True), quantize(x.t(), fmt, pad=True)
    finally:
        if before is None:
            del os.environ[ENV_SWITCH]
        else:
            os.environ[ENV_SWITCH] = before


def _bitwise(a: Any, b: Any) -> bool:
    """Two Quantized: the same scales and fp8 bits (a nan equal to a nan)."""

    def same(u: torch.Tensor, v: torch.Tensor) -> bool:
        nan_u, nan_v = torch.isnan(u.float()), torch.isnan(v.float())
        bits = torch.uint8 if u.element_size() == 1 else torch.int32
        return bool(torch.equal(nan_u, nan_v) and torch.equal(u.view(bits)[~nan_u], v.view(bits)[~nan_v]))

    return a.data.shape == b.data.shape and same(a.scale, b.scale) and same(a.data, b.data)


def _f64_scale_quantize(x: torch.Tensor, fmt: str) -> tuple[Any, Any]:
    """``triton_quantize.quantize`` with every kernel's scale divided in float64, not float32."""
    from mixprec.lowbit import triton_quantize

    saved = dict(triton_quantize.F32_DIV)
    triton_quantize.F32_DIV.update(dict.fromkeys(saved, False))
    try:
        return triton_quantize.quantize(x, fmt, transpose=True)
    finally:
        triton_quantize.F32_DIV.update(saved)


def run_quantize(results: Results, args: argparse.Namespace) -> None:
    """The quantize level: pure-torch against fused quantization of one operand and its transposed copy,
    every (format, path) timed in turn each round (the order rotated), with a bitwise check."""
    from mixprec.lowbit import triton_quantize

    device = torch.device(args.device)
    m, k = (int(v) for v in args.quant_shape.split(","))
    x = torch.randn(m, k, device=device, generator=torch.Generator(device).manual_seed(0))
    x = (x * torch.logspace(-2, 2, k, device=device)).to(torch.bfloat16)  # columns of many magnitudes
    moved = x.numel() * x.element_size() + 2 * x.numel()  # bf16 read once, two fp8 copies written
    runs: dict[tuple[str, str], Callable[[], object]] = {}
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for fmt in QUANT_FORMATS:
        rows[fmt, "pure torch"] = {"format": fmt, "path": "pure torch", "shape": [m, k]}
        runs[fmt, "pure torch"] = functools.partial(_pure_pair, x, fmt)
        fused = {"format": fmt, "path": "fused", "shape": [m, k]}
        rows[fmt, "fused"] = fused
        if not triton_quantize.fused_eligible(x, fmt):
            fused["skipped"] = f"not eligible on {device.type} (Triton {triton_quantize.triton_available()})"
            continue
        try:
            started = time.perf_counter()
            got, got_t = triton_quantize.quantize(x, fmt, transpose=True)
            _sync(device)
            fused["first_call_s"] = round(time.perf_counter() - started, 2)  # the Triton compile
            ref, ref_t = _pure_pair(x, fmt)
            fused["bitwise"] = _bitwise(got, ref) and got_t is not None and _bitwise(got_t, ref_t)
            if not fused["bitwise"]:
                fused["error"] = "the fused result differs from the pure-torch quantizers'"
            runs[fmt, "fused"] = functools.partial(triton_quantize.quantize, x, fmt, transpose=True)
        except Exception as exc:
            fused["error"] = _error(exc)
            continue
        if fmt not in F64_SCALE_FORMATS:
            continue
        # The same kernels with their scales divided in float64 (the float32 division's registers A/B).
        f64 = {"format": fmt, "path": "fused f64", "shape": [m, k]}
        rows[fmt, "fused f64"] = f64
        try:
            got, got_t = _f64_scale_quantize(x, fmt)
            f64["bitwise"] = _bitwise(got, ref) and got_t is not None and _bitwise(got_t, ref_t)
            runs[fmt, "fused f64"] = functools.partial(_f64_scale_quantize, x, fmt)
        except Exception as exc:
            f64["error"] = _error(exc)
    times: dict[tuple[str, str], list[float]] = {key: [] for key in runs}
    for fn in runs.values():  # warm-up: the pure path's first call, the allocator
        fn()
    keys = list(runs)
    for rnd in range(args.quant_repeats):
        for key in keys[rnd % len(keys) :] + keys[: rnd % len(keys)]:
            _sync(device)
            started = time.perf_counter()
            runs[key]()
            _sync(device)
            times[key].append(time.perf_counter() - started)
    for key, row_ in rows.items():
        if times.get(key):
            ms = [t * 1e3 for t in times[key]]
            row_.update(median_ms=statistics.median(ms), range_ms=_range(ms), repeats=len(ms))
            row_["gb_per_s"] = moved / (row_["median_ms"] * 1e-3) / 1e9
            pure = rows[key[0], "pure torch"].get("median_ms")
            if key[1] != "pure torch" and pure:
                row_["vs_pure"] = row_["median_ms"] / pure
    results.quantize = list(rows.values())


PASS_RECIPES = ("fp8_tensorwise", "fp8_rowwise", "fp8_rowwise_gw_hp", "fp8_blockwise", "mxfp8", "nvfp4")


def count_passes(recipe: str, device: torch.device, share: bool) -> tuple[int, list[torch.Tensor]]:
    """Operand quantizations of one lowbit linear layer's forward and backward (x (2, 256, 256), w (512, 256)
    bf16), and the output and gradients, with the shared casts on or off."""
    from mixprec.lowbit import RECIPES
    from mixprec.lowbit import gemm as lowbit_gemm

    count = [0]
    saved = {n: getattr(lowbit_gemm, n) for n in ("_quantize_operand", "_quantize_both", "SHARE_CASTS")}

    def counted(real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*a: Any, **k: Any) -> Any:
            count[0] += 1
            return real(*a, **k)

        return call

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 256, 256, generator=g).to(device, torch.bfloat16).requires_grad_()
    w = (torch.randn(512, 256, generator=g) / 16).to(device, torch.bfloat16).requires_grad_()
    go = torch.randn(2, 256, 512, generator=g).to(device, torch.bfloat16)
    try:
        lowbit_gemm._quantize_operand = counted(saved["_quantize_operand"])
        lowbit_gemm._quantize_both = counted(saved["_quantize_both"])
        lowbit_gemm.SHARE_CASTS = share
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # emulation on a device without the kernel
            out = lowbit_gemm.LowbitLinearFunction.apply(
                x, w, RECIPES[recipe], torch.Generator(device).manual_seed(1)
            )
            out.backward(go)
    finally:
        for name, value in saved.items():
            setattr(lowbit_gemm, name, value)
    assert x.grad is not None and w.grad is not None
    return count[0], [out.detach(), x.grad, w.grad]


def run_passes(results: Results, args: argparse.Namespace) -> None:
    """The passes: operand quantizations per layer per step, per use and shared (see the module doc)."""
    device = torch.device(args.device)
    for recipe in PASS_RECIPES:
        entry: dict[str, Any] = {"recipe": recipe}
        try:
            before, old = count_passes(recipe, device, share=False)
            after, new = count_passes(recipe, device, share=True)
            same = all(torch.equal(a, b) for a, b in zip(old, new, strict=True))
            entry.update(per_use=before, shared=after, bitwise=same)
            if not same:
                entry["error"] = "the shared casts' step differs from the per-use step"
        except Exception as exc:
            entry["error"] = _error(exc)
        results.passes.append(entry)


def _print(results: Results) -> None:
    meta = results.meta
    print(
        f"{meta.get('gpu', meta['device'])}, torch {meta['torch']}, torchao {meta['torchao']}; GPT "
        f"{meta['layers']} x d={meta['width']}, seq {meta['context']}, batch {meta['batch']}; step = "
        f"fwd+bwd+AdamW, median of {meta['rounds']} interleaved rounds [range]; transient: peak - before"
    )
    print(f"{'config':20} {'mode':9} {'step ms':>9} {'range':>17} {'x bf16':>6} {'range':>13} "
          f"{'GiB':>6} {'warm-up s':>9} {'breaks':>6}")  # fmt: skip
    for r in results.rows():
        mode = "compiled" if r["compiled"] else "eager"
        if "skipped" in r or "error" in r or "step_ms" not in r:
            print(f"{r['config']:20} {mode:9} {_status(r)}")
            continue
        ratio = f"{r['vs_bf16']:.3f}" if "vs_bf16" in r else "-"
        spread = "{:.3f}-{:.3f}".format(*r["vs_bf16_range"]) if "vs_bf16_range" in r else "-"
        gib = f"{r['transient_gib']:.2f}" if "transient_gib" in r else "-"
        breaks = "-" if r["graph_breaks"] is None else str(r["graph_breaks"])
        times = "{:.2f}-{:.2f}".format(*r["step_ms_range"])
        print(f"{r['config']:20} {mode:9} {r['step_ms']:9.2f} {times:>17} {ratio:>6} {spread:>13} {gib:>6} "
              f"{r['warmup_s']:9.1f} {breaks:>6}")  # fmt: skip
    for g in results.gemm:
        if g.get("error") or g.get("median_s") is None:
            print(f"GEMM {g.get('format', '-')}: FAILED: {g.get('error')}")
        else:
            ratio = "-" if g["relative_to_bf16"] is None else f"{g['relative_to_bf16']:.2f}x bf16"
            print(f"GEMM fwd+bwd {','.join(map(str, g['shape']))} {g['format']:18} "
                  f"{g['median_s'] * 1e3:8.3f} ms  {ratio}")  # fmt: skip

    for r in results.rowwise_gemm:
        vs = f"  {r['vs_rowwise_kernel']:.2f}x rowwise kernel" if "vs_rowwise_kernel" in r else ""
        bits = f"  bitwise: {r['bitwise_vs_torch_post_scale']}" if "bitwise_vs_torch_post_scale" in r else ""
        where = f"rowwise GEMM {','.join(map(str, r['shape']))} {r['path']:30}"
        _print_timed(where, r, "tflops", "TFLOP/s", vs + bits)
    for q in results.quantize:
        vs = f"  {q['vs_pure']:.2f}x pure" if "vs_pure" in q else ""
        bits = "" if "bitwise" not in q else f"  bitwise: {q['bitwise']}"
        _print_timed(f"quantize {q['format']:20} {q['path']:10}", q, "gb_per_s", "GB/s", vs + bits)
    for p in results.passes:
        where = f"quantization passes per linear per step, {p['recipe']:18}"
        if "per_use" not in p:
            print(f"{where} FAILED: {p.get('error')}")
            continue
        print(f"{where} {p['per_use']} per use -> {p['shared']} shared  bitwise: {p['bitwise']}")


def _status(row: dict) -> str:
    """Why a row has no figures: the reason it was skipped, or the error it failed with."""
    return row.get("skipped") or "FAILED: " + str(row.get("error"))


def _print_timed(where: str, row: dict, rate: str, unit: str, extras: str) -> None:
    """One timed row: median and range in ms, ``row[rate]`` in ``unit``, then ``extras``; or its status."""
    if "median_ms" not in row:
        print(f"{where} {_status(row)}")
        return
    lo, hi = row["range_ms"]
    print(f"{where} {row['median_ms']:8.3f} ms [{lo:.3f}-{hi:.3f}] {row[rate]:7.1f} {unit}{extras}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (cuda 5, cpu 2)")
    parser.add_argument("--steps", type=int, default=None, help="steps per config per round (cuda 3, cpu 1)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per config (the compile)")
    parser.add_argument("--modes", default="eager,compiled", help="eager, compiled or both")
    names = ["-".join(filter(None, c)) for c in CONFIGS]
    parser.add_argument("--configs", default=",".join(names), help=f"a subset of {names}")
    parser.add_argument(
        "--compile-backend", default=None, help="torch.compile backend (cuda inductor, cpu aot_eager)"
    )
    parser.add_argument(
        "--gemm-shape", default=None, help="M,N,K of the GEMM level (cuda 8192^3; '' to skip)"
    )
    parser.add_argument("--gemm-warmup", type=int, default=2)
    parser.add_argument("--gemm-repeats", type=int, default=10)
    parser.add_argument(
        "--quant-shape", default=None, help="M,K of the quantize level (cuda 8192,8192; '' to skip)"
    )
    parser.add_argument("--quant-repeats", type=int, default=10)
    parser.add_argument(
        "--budget-s", type=float, default=None, help="start no compile that would end past this"
    )
    parser.add_argument("--json", help="write the rows here (after every round and row)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    args.rounds = args.rounds or (5 if cuda else 2)
    args.steps = args.steps or (3 if cuda else 1)
    args.compile_backend = args.compile_backend or ("inductor" if cuda else "aot_eager")
    args.gemm_shape = GEMM_SHAPE[device.type] if args.gemm_shape is None else args.gemm_shape
    args.quant_shape = QUANT_SHAPE[device.type] if args.quant_shape is None else args.quant_shape
    chosen = [c for c in args.configs.split(",") if c]
    if not chosen or set(chosen) - set(names):
        parser.error(f"--configs takes a subset of {names}, got {args.configs!r}")
    args.configs = [c for c, name in zip(CONFIGS, names, strict=True) if name in chosen]
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - {"eager", "compiled"}:
        parser.error(f"--modes takes eager, compiled or both, got {args.modes!r}")
    dynamo = torch._dynamo.config  # five compiled configs share Block.forward: one cache entry each
    limit = "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit"
    setattr(dynamo, limit, max(getattr(dynamo, limit), 64))
    started = time.perf_counter()
    stop_on_sigterm()
    results = Results(args)
    results.save("running: starting")
    try:
        if "eager" in modes:
            run_configs(results, False, args, started)
        if args.gemm_shape:
            run_gemm(results, args)
            results.save("running: GEMM level done")
            run_rowwise_gemm(results, args)
            results.save("running: rowwise GEMM paths done")
        if args.quant_shape:
            run_quantize(results, args)
            results.save("running: quantize level done")
        run_passes(results, args)
        results.save("running: passes counted")
        if "compiled" in modes:
            run_configs(results, True, args, started)
    except KeyboardInterrupt as exc:
        why = STOPPED if str(exc) == STOPPED else "interrupted"
        results.save(f"{why} after {time.perf_counter() - started:.0f} s")
        _print(results)
        return 124
    results.meta["seconds"] = round(time.perf_counter() - started, 1)
    results.save(None)
    _print(results)
    failed = [r for r in results.rows() if "error" in r] + [g for g in results.gemm if g.get("error")]
    failed += [q for q in results.quantize if q.get("error")] + [p for p in results.passes if p.get("error")]
    failed += [r for r in results.rowwise_gemm if r.get("error")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
