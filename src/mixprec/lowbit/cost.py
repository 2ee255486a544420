"""The roofline cost of a linear layer's training GEMMs per format, and the filter that uses it.

A linear layer with ``M`` rows of input (tokens), ``K`` inputs and ``N`` outputs runs three GEMMs per
training step (forward ``M x K x N``, input gradient ``M x N x K``, weight gradient ``N x M x K``), each of
``2 M N K`` FLOPs. On a target with dense tensor-core rate ``R[class]`` (FLOP/s) and memory bandwidth ``B``
(byte/s), one GEMM takes ``max(2 M N K / R, bytes moved / B)`` (the roofline model: Williams, Waterman and
Patterson, "Roofline", CACM 2009), and a low-bit format also pays a memory-bound cast of each of its six
operands (read in bf16, write the low-bit values plus their scales). So a 4-bit GEMM is up to 4x cheaper
than bf16 on a large matrix and the gain shrinks on a small one, where the casts and the memory traffic
dominate (the effect torchtitan's ``auto_filter_small_kn`` encodes in a size threshold).

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

A rowwise fp8 cast (``fp8_rowwise``, ``fp8_rowwise_gw_hp``) pays one more bf16 write and read per operand
than a tensorwise or block-scaled one: its second axis is cast from a transposed copy, the kernels torchao
models in ``torchao/testing/training/roofline_utils.py`` (``get_tensor_memory_traffic_ovhd_s``).

:func:`auto_filter` is torchao's ``_auto_filter_for_recipe`` / torchtitan's ``auto_filter_small_kn``
(a ``module_filter_fn(module, fqn) -> bool``) decided by this cost model at the run's ``tokens_per_step``
instead of fixed size thresholds; :func:`mixprec.plan.plan_precision` prices its formats with the same
:func:`relative_cost`, so the two agree on which layers are too small to gain.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import nn

from mixprec.lowbit.recipes import RECIPES, get_recipe

__all__ = ["TARGETS", "CostFn", "Target", "auto_filter", "format_class", "gemm_cost", "relative_cost"]

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


def gemm_cost(target: Target, fmt: str, m: int, n: int, k: int) -> float:
    """Seconds for the three training GEMMs of an ``(m, k) x (k, n)`` layer in ``fmt`` on ``target``."""
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
        scale_bytes = 1.0 / 16 if _block_scaled(fmt) else 0.0
        operands = 2 * (m * k + n * k + m * n)  # x, w and the output gradient, each cast along two axes
        total += operands * (2.0 + elem + scale_bytes) / bandwidth
        if "rowwise" in fmt:  # the second axis casts from a transposed bf16 copy: written, then read
            total += (m * k + n * k + m * n) * 2.0 / bandwidth
    return total


def check_tokens_per_step(tokens_per_step: object) -> int:
    """``tokens_per_step`` if it is a positive int, else a ValueError naming it."""
    if isinstance(tokens_per_step, bool) or not isinstance(tokens_per_step, int) or tokens_per_step < 1:
        raise ValueError(
            "tokens_per_step must be a positive int (the rows M of each linear layer's GEMMs in one "
            f"training step: batch x sequence length per rank), got {tokens_per_step!r}"
        )
    return tokens_per_step


def resolve_target(target: str | CostFn) -> tuple[str, CostFn]:
    """``(name, cost(format, m, n, k))`` for a target name of :data:`TARGETS` or a callable."""
    if isinstance(target, str):
        if target not in TARGETS:
            raise ValueError(f"unknown cost target {target!r}; known: {', '.join(TARGETS)} (or a callable)")
        spec = TARGETS[target]
        return target, lambda fmt, m, n, k: gemm_cost(spec, fmt, m, n, k)
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

    Raises:
        ValueError: for an unknown recipe or target, a ``tokens_per_step`` that is not a positive int,
            a ``min_gain`` outside [0, 1); TypeError: for a ``filter_fqns`` that is a string or holds
            a non-string.
    """
    get_recipe(recipe)  # an unknown recipe raises here, naming the known ones
    name = recipe if recipe in RECIPES else str(get_recipe(recipe))
    rows = check_tokens_per_step(tokens_per_step)
    _, cost = resolve_target(target)
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
