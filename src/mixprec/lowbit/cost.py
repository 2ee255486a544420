"""The roofline cost of a linear layer's training GEMMs per format, and the filter that uses it.

A linear layer with ``M`` rows of input (tokens), ``K`` inputs and ``N`` outputs runs three GEMMs per
training step (forward ``M x K x N``, input gradient ``M x N x K``, weight gradient ``N x M x K``), each of
``2 M N K`` FLOPs. On a target with dense tensor-core rate ``R[class]`` (FLOP/s) and memory bandwidth ``B``
(byte/s), one GEMM takes ``max(2 M N K / R, bytes moved / B)`` (the roofline model: Williams, Waterman and
Patterson, "Roofline", CACM 2009), and a low-bit format also pays the memory-bound quantization of its
operands (below). So a 4-bit GEMM is up to 4x cheaper than bf16 on a large matrix and the gain shrinks
on a small one, where the casts and the memory traffic dominate (the effect torchtitan's
``auto_filter_small_kn`` encodes in a size threshold).

Dense rates (TFLOPS, without sparsity) and bandwidth, from NVIDIA's datasheets:

====== ====== ====== ====== ====== ========== ==================================================
target fp32   bf16   fp8    fp4    HBM (TB/s)  source
====== ====== ====== ====== ====== ========== ==================================================
h100   67     989    1979   --     3.35        NVIDIA H100 Tensor Core GPU datasheet, H100 SXM
                                               (tensor-core figures listed with sparsity, halved)
b200   75     2250   4500   9000   8.0         NVIDIA DGX/HGX B200 datasheet, per GPU (sparse
                                               FP4 18 / FP8 9 / BF16 4.5 PFLOPS, halved)
====== ====== ====== ====== ====== ========== ==================================================

Hopper has fp8 tensor cores but neither fp4 nor MX block-scaled GEMMs (those are Blackwell's), so on
``"h100"`` the MX and NVFP4 formats cost what bf16 costs plus their casts: the planner never picks them
there. The fp32 figure is the non-tensor-core rate (PyTorch's default fp32 matmul). ``"<target>-peak"``
drops the memory terms (compute at the peak rate only): the large-matrix limit, which is how a small
stand-in model's layers would cost at scale.

**The quantization, priced on the path that runs.** Each low-bit recipe adds the memory traffic of its
quantizer calls (:func:`~mixprec.lowbit.cost.quantize_bytes`, bytes read plus written over ``B``),
counted per call as ``mixprec.lowbit.gemm.LowbitLinearFunction`` makes them (an operand with one format
in both its GEMMs quantized once with its transposed copy, ``gemm.shared_operands``; the others per use;
bf16 operands, ``s = 2`` bytes; ``e`` the element's bytes, ``c`` a copy's scale bytes per element).
``quantize`` picks the path (:data:`~mixprec.lowbit.cost.QUANTIZE_PATHS`,
:func:`~mixprec.lowbit.cost.quantize_path`):

* ``"triton"``, CUDA eager (the kernels of ``mixprec.lowbit.triton_quantize``, read from them):
  tensorwise and rowwise fp8 pay an amax pass and one cast pass that writes both copies, ``2 s + 2 (e + c)``
  per element of the operand (``6`` bytes: a rowwise cast no longer writes and reads a transposed bf16
  copy); 1x128 / 128x128 blocks pay one pass, ``s + 2 (e + c)`` (no amax pass). A format without a kernel
  (MX, NVFP4), stochastic rounding and NVFP4's Hadamard rotation run the pure-torch ops, priced as below.
* ``"fused"``, ``torch.compile``: inductor fuses each pure-torch ``quantize`` call into one pass that reads
  the source and writes ``e + c``, after an amax pass where the amax spans more than a 1 x B run (a tensor,
  a row, a 2-D tile, NVFP4's tensor amax); a non-tensorwise pair is two calls (``x`` and ``x.T``), a
  tensorwise one a single cast whose transpose is a view. This is a model of inductor's fusion, not read
  from generated code.
* ``"unfused"``, the pure-torch ops one kernel each (a CPU, ``MIXPREC_FUSED_QUANTIZE=0``, no Triton): the
  float32 copy (``s + 4``), abs and amax (``12``), scale, clamp and cast (``21`` for fp8; ``241.5`` for
  e2m1, whose rounding and packing take about 30 float32 ops), the ops on each block's amax and scale
  (50-123 bytes per block, by scale kind), a contiguous copy of a transposed view (``2 s``), a second
  abs/amax for a two-level format's tensor amax, stochastic rounding's float64 noise (``224``) and the
  Hadamard rotation (``54``): 39 bytes per element per axis for fp8 tensorwise, rowwise and 128x128, 43
  for MXFP8, 262-275 for the fp4 formats. ``tests/lowbit/test_cost_paths.py`` records the ops of real
  CPU calls (a ``TorchDispatchMode``) and checks every format's call and every recipe's training step
  against these counts, so the model follows the code.

:func:`auto_filter` is torchao's ``_auto_filter_for_recipe`` / torchtitan's ``auto_filter_small_kn``
(a ``module_filter_fn(module, fqn) -> bool``) decided by this cost model at the run's ``tokens_per_step``
instead of fixed size thresholds; :func:`mixprec.plan.plan_precision` prices its formats with the same
:func:`relative_cost`, so the two agree on which layers are too small to gain.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import nn

from mixprec.lowbit.formats import LowbitFormat, get_format
from mixprec.lowbit.gemm import shared_operands
from mixprec.lowbit.recipes import HP, RECIPES, Recipe, get_recipe
from mixprec.lowbit.triton_quantize import format_supported

__all__ = [
    "QUANTIZE_PATHS",
    "TARGETS",
    "CostFn",
    "Target",
    "auto_filter",
    "format_class",
    "gemm_cost",
    "quantize_bytes",
    "quantize_path",
    "relative_cost",
]

#: ``cost(format, m, n, k) -> float``: the time (any unit, compared only with itself) of a layer's three
#: training GEMMs in ``format``; ``m`` rows of input, ``k`` inputs, ``n`` outputs.
CostFn = Callable[[str, int, int, int], float]

#: Bytes per stored element and per element of scale overhead, by format class.
_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp8": 1.0, "fp4": 0.5}


@dataclass(frozen=True)
class Target:
    """A GPU as the cost model sees it: dense TFLOPS per format class and HBM bandwidth in TB/s."""

    name: str
    tflops: dict[str, float]
    hbm_tb_s: float
    source: str
    roofline: bool = True


TARGETS: dict[str, Target] = {
    "h100": Target(
        "h100",
        {"fp32": 67.0, "bf16": 989.0, "fp8": 1979.0},
        3.35,
        "NVIDIA H100 Tensor Core GPU datasheet (H100 SXM, dense = listed sparse / 2)",
    ),
    "b200": Target(
        "b200",
        {"fp32": 75.0, "bf16": 2250.0, "fp8": 4500.0, "fp4": 9000.0},
        8.0,
        "NVIDIA DGX B200 / HGX B200 datasheet, per GPU (dense = listed sparse / 2)",
    ),
}
#: The same GPUs at their peak rates only (``"b200-peak"``, ``"h100-peak"``): the large-matrix limit, where
#: the casts and memory traffic are negligible; the cost of a small model's layers once scaled up.
TARGETS.update(
    {
        f"{name}-peak": Target(f"{name}-peak", t.tflops, t.hbm_tb_s, t.source, roofline=False)
        for name, t in list(TARGETS.items())
    }
)


def format_class(fmt: str) -> str:
    """``"fp32"``, ``"bf16"``, ``"fp8"`` or ``"fp4"`` for a planner format name."""
    if fmt in ("fp32", "bf16"):
        return fmt
    return "fp4" if "fp4" in fmt else "fp8"


def _block_scaled(fmt: str) -> bool:
    return fmt.startswith(("mx", "nv"))


#: How each operand's quantization runs, the path the roofline prices (see the module doc):
#: ``"fused"``: every format in fused passes (``torch.compile``: inductor fuses the pure-torch quantizers);
#: ``"triton"``: CUDA eager, the Triton kernels of ``mixprec.lowbit.triton_quantize`` for the formats
#: that have one, the pure-torch ops for the rest (MX, NVFP4, stochastic rounding, the Hadamard rotation);
#: ``"unfused"``: the pure-torch ops for every format (a CPU, ``MIXPREC_FUSED_QUANTIZE=0``, no Triton).
QUANTIZE_PATHS = ("fused", "triton", "unfused")

# The pure-torch quantize() of an (M, K) operand along K, in bytes read plus written per element, counted
# from the ops it issues (tests/lowbit/test_cost_paths.py records them and checks these numbers):
_TO_FP32 = 4.0  # the float32 copy written (the source read is counted apart, by its own bytes)
_AMAX = 12.0  # abs (read 4, write 4) and amax (read 4): one more of each for a two-level tensor amax
_TAIL = {"fp8": 21.0, "fp4": 241.5}  # scale (8), clamp (8) and cast (5); e2m1 rounds and packs in ~30 ops
_STOCHASTIC = 224.0  # float64 noise, floor and the casts around them, per element
# Per block, the ops on its amax and scale (bytes per block of float32 scratch), nearest and stochastic.
_SCALE_OPS = {"fp32": (82.0, 0.0), "pow2": (104.0, 66.0), "e4m3": (50.0, 77.0), "e4m3_2l": (50.0, 69.0)}
_E8M0_OPS = {"floor": (90.0, 77.0), "rceil": (123.0, 109.0)}
#: The bf16 -> float32 Hadamard rotation of NVFP4's wgrad operands in eager mode (pad, batched matmul,
#: the copies around it), bytes per element.
_ROTATE = 54.0


def quantize_path(quantize: str | None = None, *, compiled: bool = False) -> str:
    """The quantization path (:data:`~mixprec.lowbit.cost.QUANTIZE_PATHS`) the roofline prices for a run.

    An explicit ``quantize`` is returned as it is (after checking it). None picks the path a CUDA run
    takes: ``"fused"`` when ``compiled`` (under ``torch.compile`` inductor fuses the quantizers, whatever
    the environment says), else ``"unfused"`` when the environment variable ``MIXPREC_FUSED_QUANTIZE``
    is ``"0"`` (the switch that turns the Triton kernels off), else ``"triton"`` (Triton ships with
    torch's CUDA builds, so a GPU run has its kernels).

    Raises:
        ValueError: for a ``quantize`` that is not None or one of
            :data:`~mixprec.lowbit.cost.QUANTIZE_PATHS`, naming it.
    """
    if quantize is not None:
        if not isinstance(quantize, str) or quantize not in QUANTIZE_PATHS:
            raise ValueError(
                f"quantize must be one of {', '.join(map(repr, QUANTIZE_PATHS))} or None (the path a CUDA "
                f"run takes), got {quantize!r}"
            )
        return quantize
    if compiled:
        return "fused"
    from mixprec.lowbit.triton_quantize import ENV_SWITCH

    return "unfused" if os.environ.get(ENV_SWITCH, "1") == "0" else "triton"


@dataclass(frozen=True)
class _Cast:
    """One quantizer call of a training step: ``elements`` of an operand to ``fmt``; ``kind`` ``"one"``
    (along the contiguous axis), ``"one_t"`` (a transposed view), ``"pair"`` (both axes,
    ``quantize_pair``), ``"scaled"`` (a per-tensor recipe's amax and cast with its transpose) or
    ``"rotate"`` (the Hadamard rotation); ``source`` bytes per element read."""

    elements: int
    fmt: str
    kind: str
    stochastic: bool = False
    source: float = 2.0


def _casts(recipe: Recipe, m: int, n: int, k: int) -> list[_Cast]:
    """The quantizer calls of one training step of an ``(m, k) x (k, n)`` layer, as
    ``mixprec.lowbit.gemm.LowbitLinearFunction`` makes them (both gradients asked for)."""
    if recipe.scaling is not None:  # each tensor: its amax, one cast that writes the transpose too
        return [
            _Cast(m * k, recipe.fprop_x, "scaled"),
            _Cast(n * k, recipe.fprop_w, "scaled"),
            _Cast(m * n, recipe.dgrad_go, "scaled"),
        ]
    share_x, share_w, share_go = shared_operands(recipe)
    casts: list[_Cast] = []
    for size, shared, first, second, sr, rotated in (
        (m * k, share_x, recipe.fprop_x, recipe.wgrad_x, False, recipe.rht),
        (n * k, share_w, recipe.fprop_w, recipe.dgrad_w, False, False),
        (m * n, share_go, recipe.dgrad_go, recipe.wgrad_go, recipe.sr, recipe.rht),
    ):
        if shared:
            casts.append(_Cast(size, first, "pair"))
            continue
        if first != HP:
            casts.append(_Cast(size, first, "one", sr))
        if second != HP:
            if rotated:  # the wgrad operand is rotated to float32, then quantized from that
                casts.append(_Cast(size, "", "rotate"))
            casts.append(_Cast(size, second, "one_t", sr, 4.0 if rotated else 2.0))
    return casts


def _scale_bytes(fmt: LowbitFormat) -> float:
    """Stored scale bytes per element of one quantized copy (a per-row or per-tensor scale: ~0)."""
    rows, cols = fmt.block
    if cols == -1:
        return 0.0
    per_scale = 1.0 if fmt.scale in ("e8m0", "e4m3") else 4.0
    return per_scale / (max(rows, 1) * cols)


def _elem_bytes(fmt: LowbitFormat) -> float:
    return 0.5 if fmt.element == "e2m1" else 1.0


def _unfused_bytes(fmt: LowbitFormat, source: float, transposed: bool, stochastic: bool) -> float:
    """Bytes per element of the pure-torch ``quantize`` (see the constants above)."""
    rows, cols = fmt.block
    if fmt.scale == "e8m0":
        ops = _E8M0_OPS["rceil" if fmt.rule.value == "rceil" else "floor"]
    else:
        ops = _SCALE_OPS["e4m3_2l" if fmt.two_level else fmt.scale]
    per_block = 0.0 if (rows, cols) == (-1, -1) else ops[1 if stochastic else 0] / (max(rows, 1) * cols)
    if cols == -1:  # one scale per row: its ops are per row, negligible next to a row's elements
        per_block = 0.0
    total = source + (0.0 if source == 4.0 else _TO_FP32)  # read the source, write its float32 copy
    total += 2.0 * source if transposed else 0.0  # the transposed view made contiguous first
    total += _AMAX * (2 if fmt.two_level else 1) + _TAIL["fp4" if fmt.element == "e2m1" else "fp8"]
    return total + per_block + (_STOCHASTIC if stochastic else 0.0)


def _amax_pass(fmt: LowbitFormat) -> bool:
    """Whether a fused quantizer reads the source once more for its amax: the amax spans more than the
    1 x B run a tile holds (a tensor, a row, a 2-D tile, a two-level format's tensor amax)."""
    rows, cols = fmt.block
    return rows != 1 or cols == -1 or fmt.two_level


def _cast_bytes(cast: _Cast, path: str) -> float:
    """Bytes read plus written by one quantizer call on ``path``."""
    if cast.kind == "rotate":
        return cast.elements * (cast.source + 4.0 if path == "fused" else _ROTATE)
    fmt = get_format(cast.fmt)
    elem, scale = _elem_bytes(fmt), _scale_bytes(fmt)
    s = cast.source
    triton = path == "triton" and format_supported(fmt) and not cast.stochastic
    if cast.kind == "scaled":  # amax, then one cast writing the copy and (Triton) its transpose
        if path == "unfused" or (path == "triton" and not triton):
            # abs and max in the source dtype (3 s), then to float32, scale, clamp, cast (a transposed view)
            return cast.elements * (3 * s + s + _TO_FP32 + _TAIL["fp8"] - 1.0 + elem)
        return cast.elements * (2 * s + elem * (2 if triton else 1))
    if path == "fused" or triton:
        # Triton: an amax kernel before the cast for a tensor's or a row's scale, none for 1x128 /
        # 128x128 blocks (amax, scale and cast in one pass over a tile); inductor: see _amax_pass
        amax_pass = fmt.block[1] == -1 if triton else _amax_pass(fmt)
        reads = s * (2 if amax_pass else 1)
        if cast.kind != "pair":
            return cast.elements * (reads + elem + scale)
        if triton:  # one cast-transpose kernel writes both copies
            return cast.elements * (reads + 2 * (elem + scale))
        if fmt.is_tensorwise:  # one cast; the transposed copy is a view of the same bits
            return cast.elements * (reads + elem)
        return 2 * cast.elements * (reads + elem + scale)  # x and x.T quantized apart
    one = _unfused_bytes(fmt, s, cast.kind == "one_t", cast.stochastic)
    if cast.kind == "pair" and not fmt.is_tensorwise:
        one += _unfused_bytes(fmt, s, True, cast.stochastic)
    return cast.elements * one


def quantize_bytes(fmt: str, m: int, n: int, k: int, quantize: str = "triton") -> float:
    """Bytes read and written by the quantization of one training step of an ``(m, k) x (k, n)`` layer.

    Every quantizer call ``mixprec.lowbit.gemm.LowbitLinearFunction`` makes for ``fmt``'s recipe
    (``x`` (m, k), ``w`` (n, k) and the output gradient (m, n), bf16, both gradients asked for), priced on
    ``quantize``'s path by the byte counts of the module doc. 0 for ``"bf16"`` and ``"fp32"``.

    Args:
        fmt: a recipe name or recipe string (:func:`~mixprec.lowbit.get_recipe`), ``"bf16"`` or ``"fp32"``.
        m, n, k: the layer's rows (tokens), outputs and inputs.
        quantize: one of :data:`~mixprec.lowbit.cost.QUANTIZE_PATHS`.

    Raises:
        ValueError: for an unknown recipe or a ``quantize`` not in
            :data:`~mixprec.lowbit.cost.QUANTIZE_PATHS`.
    """
    path = quantize_path(quantize)
    if fmt in ("bf16", "fp32"):
        return 0.0
    return float(sum(_cast_bytes(cast, path) for cast in _casts(get_recipe(fmt), m, n, k)))


def gemm_cost(target: Target, fmt: str, m: int, n: int, k: int, quantize: str = "triton") -> float:
    """Seconds for the three training GEMMs of an ``(m, k) x (k, n)`` layer in ``fmt`` on ``target``,
    with the operands' quantization priced on ``quantize``'s path
    (:data:`~mixprec.lowbit.cost.QUANTIZE_PATHS`; the default is CUDA eager with Triton, what
    :func:`~mixprec.lowbit.cost.quantize_path` picks for an uncompiled run).

    Raises:
        ValueError: for a ``quantize`` not in :data:`~mixprec.lowbit.cost.QUANTIZE_PATHS`, or a
            low-bit ``fmt`` that is not a recipe.
    """
    path = quantize_path(quantize)
    cls = format_class(fmt)
    if cls not in target.tflops or (_block_scaled(fmt) and "fp4" not in target.tflops):
        cls_rate, elem = target.tflops["bf16"], _BYTES[cls]  # no hardware path: runs at the bf16 rate
    else:
        cls_rate, elem = target.tflops[cls], _BYTES[cls]
    rate, bandwidth = cls_rate * 1e12, target.hbm_tb_s * 1e12
    out_bytes = 2.0 if cls != "fp32" else 4.0
    total = 0.0
    for a, b, c in ((m, k, n), (m, n, k), (n, m, k)):  # (rows, reduction, cols) of fprop, dgrad, wgrad
        moved = elem * (a * b + b * c) + out_bytes * a * c
        total += max(2.0 * a * b * c / rate, moved / bandwidth if target.roofline else 0.0)
    if cls in ("fp8", "fp4") and target.roofline:
        total += quantize_bytes(fmt, m, n, k, path) / bandwidth
    return total


def check_tokens_per_step(tokens_per_step: object) -> int:
    """``tokens_per_step`` if it is a positive int, else a ValueError naming it."""
    if isinstance(tokens_per_step, bool) or not isinstance(tokens_per_step, int) or tokens_per_step < 1:
        raise ValueError(
            "tokens_per_step must be a positive int (the rows M of each linear layer's GEMMs in one "
            f"training step: batch x sequence length per rank), got {tokens_per_step!r}"
        )
    return tokens_per_step


def resolve_target(target: str | CostFn, quantize: str = "triton") -> tuple[str, CostFn]:
    """``(name, cost(format, m, n, k))`` for a target name of :data:`TARGETS` (its roofline with the
    quantization on ``quantize``'s path) or a callable (``quantize`` does not change it)."""
    path = quantize_path(quantize)
    if isinstance(target, str):
        if target not in TARGETS:
            raise ValueError(f"unknown cost target {target!r}; known: {', '.join(TARGETS)} (or a callable)")
        spec = TARGETS[target]
        return target, lambda fmt, m, n, k: gemm_cost(spec, fmt, m, n, k, path)
    if not callable(target):
        raise TypeError(f"target must be a target name or a callable cost(format, m, n, k), got {target!r}")
    return getattr(target, "__name__", "custom"), target


def relative_cost(cost: CostFn, fmt: str, m: int, n: int, k: int) -> float:
    """``fmt``'s cost of an ``(m, k) x (k, n)`` layer's three training GEMMs over bf16's (< 1: it gains)."""
    return float(cost(fmt, m, n, k)) / float(cost("bf16", m, n, k))


def gains(cost: CostFn, fmt: str, m: int, n: int, k: int, min_gain: float = 0.0) -> bool:
    """Whether ``fmt`` saves more than ``min_gain`` of the layer's bf16 GEMM time (the planner's and
    :func:`auto_filter`'s one test of "too small to gain")."""
    return relative_cost(cost, fmt, m, n, k) < 1.0 - min_gain


def auto_filter(
    recipe: str,
    *,
    tokens_per_step: int,
    target: str | CostFn = "b200",
    min_gain: float = 0.0,
    filter_fqns: Sequence[str] = (),
    quantize: str | None = None,
    compiled: bool = False,
) -> Callable[[nn.Module, str], bool]:
    """A ``module_filter_fn(module, fqn) -> bool`` that converts only the layers that gain from ``recipe``.

    True for an ``nn.Linear`` (or subclass) whose ``fqn`` contains none of ``filter_fqns``, whose
    ``in_features`` and ``out_features`` are multiples of 16 (the tensor-core kernels' requirement,
    ``mixprec.lowbit.kernels.select_kernel``), and whose three training GEMMs at ``tokens_per_step``
    rows cost, in ``target``'s roofline, less than ``1 - min_gain`` times bf16's: what
    :func:`mixprec.plan.plan_precision` (same target, same ``tokens_per_step``) counts as a gain.

    Args:
        recipe: a :data:`mixprec.lowbit.RECIPES` name (or a recipe string :func:`get_recipe` reads).
        tokens_per_step: the rows M of each layer's GEMMs in one training step (batch x sequence).
        target: a name of :data:`mixprec.plan.TARGETS` or ``cost(format, m, n, k) -> float``.
        min_gain: the least share in [0, 1) of the bf16 time the format must save (0: any saving). The
            roofline leaves out kernel efficiency and launch overhead, so it is optimistic: torchao's
            H100 thresholds (``_auto_filter_for_recipe``, fitted to measured speedups) hold on its test
            shapes with ``target="h100", tokens_per_step=16384, min_gain=0.28``, and no smaller gain
            does (tensorwise 4096 x 1024 prices at 0.734x bf16; tests/lowbit/test_auto_filter.py).
        filter_fqns: substrings of qualified names never converted (torchao's ``filter_fqns``).
        quantize: the quantization path a roofline target prices
            (:data:`~mixprec.lowbit.cost.QUANTIZE_PATHS`); None: the one
            :func:`~mixprec.lowbit.cost.quantize_path` picks (``"fused"`` if ``compiled``, else
            ``"unfused"`` under ``MIXPREC_FUSED_QUANTIZE=0``, else ``"triton"``).
        compiled: the model runs under ``torch.compile`` (only read when ``quantize`` is None).

    Raises:
        ValueError: for an unknown recipe or target, a ``tokens_per_step`` that is not a positive int,
            a ``min_gain`` outside [0, 1), a ``quantize`` outside
            :data:`~mixprec.lowbit.cost.QUANTIZE_PATHS` or a non-bool ``compiled``; TypeError: for a
            ``filter_fqns`` that is a string or holds a non-string.
    """
    get_recipe(recipe)  # an unknown recipe raises here, naming the known ones
    name = recipe if recipe in RECIPES else str(get_recipe(recipe))
    rows = check_tokens_per_step(tokens_per_step)
    if not isinstance(compiled, bool):
        raise ValueError(f"compiled must be True or False, got {compiled!r}")
    _, cost = resolve_target(target, quantize_path(quantize, compiled=compiled))
    if isinstance(min_gain, bool) or not isinstance(min_gain, (int, float)) or not 0 <= min_gain < 1:
        raise ValueError(f"min_gain must be a share in [0, 1), got {min_gain!r}")
    if isinstance(filter_fqns, str) or not all(isinstance(f, str) for f in filter_fqns):
        raise TypeError(f"filter_fqns must be a sequence of strings, got {filter_fqns!r}")
    skip = tuple(filter_fqns)
    verdicts: dict[tuple[int, int], bool] = {}  # one roofline evaluation per (N, K)

    def module_filter_fn(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear) or any(s in fqn for s in skip):
            return False
        n, k = module.out_features, module.in_features
        if n % 16 or k % 16:
            return False
        if (n, k) not in verdicts:
            verdicts[(n, k)] = gains(cost, name, rows, n, k, float(min_gain))
        return verdicts[(n, k)]

    return module_filter_fn
