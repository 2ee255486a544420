"""Relative GEMM cost of a linear layer per format: a roofline model of a named GPU.

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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["TARGETS", "CostFn", "Target", "format_class", "gemm_cost", "resolve_cost"]

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
    return total


def resolve_cost(cost: str | CostFn | None) -> tuple[str, CostFn]:
    """``(name, cost function)`` for a target name, a user function or None (``"b200"``).

    Raises:
        ValueError: for an unknown target name; TypeError: for anything else that is not callable.
    """
    if cost is None:
        cost = "b200"
    if isinstance(cost, str):
        if cost not in TARGETS:
            raise ValueError(f"unknown cost target {cost!r}; known: {', '.join(TARGETS)} (or a callable)")
        target = TARGETS[cost]
        return cost, lambda fmt, m, n, k: gemm_cost(target, fmt, m, n, k)
    if not callable(cost):
        raise TypeError(f"cost must be a target name, a callable cost(format, m, n, k) or None, got {cost!r}")
    return getattr(cost, "__name__", "custom"), cost
