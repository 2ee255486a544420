"""Which torch scaled-matmul kernel takes a pair of quantized operands, as data; and the scale swizzle.

The table :data:`KERNELS` lists the paths of torch's ``scaled_mm`` / ``_scaled_mm`` (CUDA, from
``aten/src/ATen/native/cuda/ScaledBlas.cpp``): which operand scalings each pairs, which element pairs and
compute capabilities it accepts, and which K it needs. An operand's scaling kind follows from its format::

    tensor    fp32 / pow2 scale, one per tensor           ScalingType.TensorWise
    row       fp32 / pow2 scale, one per row              ScalingType.RowWise
    1x128     fp32 / pow2 scale, 1x128 blocks             ScalingType.BlockWise1x128
    128x128   fp32 / pow2 scale, 128x128 blocks           ScalingType.BlockWise128x128
    mx        e8m0 scale, 1x32 blocks (MXFP8, MXFP4)      ScalingType.BlockWise1x32, swizzled
    nv16      e4m3 scale, 1x16 blocks (NVFP4)             ScalingType.BlockWise1x16, swizzled
              (16x16 blocks too: a 16x16 scale repeated on each of its 16 rows is the same product)

A tensorwise operand paired with a rowwise one is promoted to ``row`` (its one scale repeated on every
row: the same product), since torch has no mixed tensorwise x rowwise kernel. :func:`select_kernel` is the
pure decision (formats, shapes, capability -> kernel or None and why), so tests can ask it for any device.

:func:`to_blocked` is cuBLAS's block-scaling-factor layout ("1D block scaling factors layout" in the cuBLAS
docs), the same rearrangement as torchao's pure-PyTorch ``torchao.prototype.mx_formats.utils.to_blocked``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mixprec.lowbit.formats import LowbitFormat

__all__ = ["CPU_RULE", "KERNELS", "Kernel", "operand_kind", "select_kernel", "to_blocked"]

_FP8 = ("e4m3", "e5m2")
# AMD MI300's fp8: tensorwise GEMMs in a ROCm build only (select_kernel refuses them elsewhere).
_FNUZ = ("e4m3fnuz", "e5m2fnuz")


@dataclass(frozen=True)
class Kernel:
    """One scaled-matmul path of torch.

    Attributes:
        name: the path's name (what :func:`mixprec.lowbit.gemm.kernel_path` returns).
        kinds: the (a, b) operand scaling kinds it pairs (see the module doc).
        elements: the (a, b) element-format pairs it accepts.
        majors: the compute-capability majors it runs on (None: any at or above ``min_capability``).
        min_capability: the lowest (major, minor) it runs on.
        k_multiple: K (in values, unpacked for fp4) must be a multiple of this (and of 16 on CUDA, with N).
        legacy_api: use ``torch._scaled_mm`` even where ``torch.nn.functional.scaled_mm`` exists (see
            the table's comments for why).
        source: where torch states the constraint.
        device: ``"cuda"`` (capability-gated) or ``"cpu"`` (see :data:`CPU_RULE`).
    """

    name: str
    kinds: tuple[str, str]
    elements: frozenset[tuple[str, str]]
    majors: tuple[int, ...] | None
    min_capability: tuple[int, int]
    k_multiple: int
    legacy_api: bool
    source: str
    device: str = "cuda"

    def runs_on(self, capability: tuple[int, int] | str) -> bool:
        if capability == "cpu" or self.device == "cpu":
            return capability == self.device
        if isinstance(capability, str):
            raise TypeError(f"capability must be (major, minor) or 'cpu', got {capability!r}")
        if capability < self.min_capability:
            return False
        return self.majors is None or capability[0] in self.majors

    def where(self) -> str:
        if self.device == "cpu":
            return "the CPU"
        if self.majors is None:
            return f"sm{self.min_capability[0]}{self.min_capability[1]}+"
        return "/".join(f"sm{m}x" for m in self.majors)


def _pairs(a: tuple[str, ...], b: tuple[str, ...], no_e5m2_pair: bool = True) -> frozenset[tuple[str, str]]:
    # cuBLASLt has no e5m2 x e5m2 GEMM (ScaledBlas.cpp: "Multiplication of two Float8_e5m2 matrices").
    return frozenset((x, y) for x in a for y in b if not (no_e5m2_pair and x[:4] == y[:4] == "e5m2"))


_E4M3 = frozenset({("e4m3", "e4m3")})
_DEEPSEEK = "ScaledBlas.cpp _check_deepseek_support: 'only supported in CUDA for SM90', e4m3 only"

#: torch's scaled-matmul paths. Blockwise (DeepSeek) paths use ``torch._scaled_mm``: its scale layouts
#: (outer-dim-major 1x128, row-major 128x128) are the same in every release that has them, while
#: ``scaled_mm``'s v2 layouts for those recipes changed. MXFP4 too: v2 routes CUDA MXFP4 to MSLK/FBGEMM,
#: which a build may lack, v1 to cuBLASLt. Tensorwise fp8 too: it is torchao float8's call, so a
#: Float8Linear's GEMMs are torchao's on every torch. ``fp8_rowwise`` is called as such only with fast
#: accumulation: without it :mod:`mixprec.lowbit.gemm` runs the pair on ``fp8_tensorwise`` with unit
#: scales and applies the row and column scales to the bf16 output, as torchao's
#: ``float8_ops.addmm_float8_unwrapped`` does (the rowwise CUTLASS kernel is slow without fast accum).
KERNELS: tuple[Kernel, ...] = (
    Kernel("fp8_tensorwise", ("tensor", "tensor"), _pairs(_FP8, _FP8) | _pairs(_FNUZ, _FNUZ), None,
           (8, 9), 16, True, "scaled_mm_arch_allowed: compute capability >= 8.9; hipBLASLt for fnuz"),
    Kernel("fp8_rowwise", ("row", "row"), _E4M3, None, (8, 9), 16, False,
           "f8f8bf16_rowwise (CUTLASS) / cuBLAS 12.9: e4m3 x e4m3"),
    Kernel("fp8_blockwise_1x128_128x128", ("1x128", "128x128"), _E4M3, (9,), (9, 0), 128, True, _DEEPSEEK),
    Kernel("fp8_blockwise_1x128_1x128", ("1x128", "1x128"), _E4M3, (9,), (9, 0), 128, True, _DEEPSEEK),
    Kernel("fp8_blockwise_128x128_1x128", ("128x128", "1x128"), _E4M3, (9,), (9, 0), 128, True, _DEEPSEEK),
    Kernel("mxfp8", ("mx", "mx"), _pairs(_FP8, _FP8), (10,), (10, 0), 32, False,
           "cuBLASLt VEC32_UE8M0 block scaling, datacenter Blackwell (sm100/sm103)"),
    Kernel("mxfp4", ("mx", "mx"), frozenset({("e2m1", "e2m1")}), (10,), (10, 0), 32, True,
           "ScaledBlas.cpp _check_mxfp4_support: 'only supported in CUDA for B200/B300'"),
    Kernel("nvfp4", ("nv16", "nv16"), frozenset({("e2m1", "e2m1")}), (10,), (10, 0), 32, False,
           "cuBLASLt VEC16_UE4M3 block scaling, datacenter Blackwell (sm100/sm103)"),
)  # fmt: skip

#: The CPU rule, one for every layer: torch's only CPU scaled matmul is ``torch._scaled_mm``'s oneDNN
#: kernel (torch >= 2.13), tensorwise OCP fp8 of any size. A GEMM runs it when its options ask for torch's
#: kernels (``emulate=False``: torchao's float8 contract, which calls ``_scaled_mm`` on a CPU, so results
#: stay bitwise torchao's); by default (``emulate=None``) a CPU emulates, as torchao's low-bit prototypes
#: do. fnuz is never sent: oneDNN takes it on some CPUs and refuses it on others.
CPU_RULE = Kernel("fp8_tensorwise_cpu", ("tensor", "tensor"), _pairs(_FP8, _FP8, False), None, (0, 0), 1,
                  True, "aten/src/ATen/native/Blas.cpp _scaled_mm_cpu (oneDNN)", "cpu")  # fmt: skip


def operand_kind(fmt: LowbitFormat) -> str | None:
    """The scaling kind of ``fmt`` as a GEMM operand (see the module doc), or None where no kernel has it."""
    block = fmt.block
    if fmt.scale in ("fp32", "pow2"):
        kinds = {(-1, -1): "tensor", (1, -1): "row", (1, 128): "1x128", (128, 128): "128x128"}
        return kinds.get(block) if fmt.element in _FP8 + _FNUZ else None
    if fmt.scale == "e8m0":
        return "mx" if block == (1, 32) else None
    return "nv16" if block in ((1, 16), (16, 16)) and fmt.element == "e2m1" else None


def _promoted(kinds: tuple[str, str]) -> tuple[str, str]:
    """A tensorwise operand next to a rowwise one becomes rowwise (its scale repeated: the same product)."""
    if set(kinds) == {"tensor", "row"}:
        return ("row", "row")
    return kinds


def select_kernel(
    fmt_a: LowbitFormat,
    fmt_b: LowbitFormat,
    shape_a: tuple[int, int],
    shape_b: tuple[int, int],
    capability: tuple[int, int] | str | None,
) -> tuple[Kernel | None, str]:
    """The kernel for ``a @ b.T``, or None and why.

    Args:
        fmt_a, fmt_b: the operands' formats, each quantized along K.
        shape_a, shape_b: the stored (padded) matrices in values: (M, K) and (N, K), K unpacked for fp4.
        capability: the CUDA compute capability, ``"cpu"`` for the CPU's kernel (:data:`CPU_RULE`), or
            None for a device without scaled-matmul kernels (a CPU by default).
    """
    pair = f"{fmt_a.name} x {fmt_b.name}"
    if capability is None:
        return None, f"{pair}: no scaled-matmul kernels on this device (emulated)"
    if capability == "cpu" and "fnuz" in fmt_a.element + fmt_b.element:
        return None, f"{pair}: fnuz fp8 is emulated on every CPU (oneDNN takes it on some CPUs only)"
    if "fnuz" in fmt_a.element + fmt_b.element and torch.version.hip is None:
        return None, f"{pair}: fnuz fp8 GEMMs run only in a ROCm build of torch (cuBLASLt has none)"
    kinds = (operand_kind(fmt_a), operand_kind(fmt_b))
    if None in kinds:
        return None, f"{pair}: no torch kernel takes {fmt_a.block}/{fmt_b.block} blocks with these scales"
    elements = (fmt_a.element, fmt_b.element)
    table = (CPU_RULE,) if capability == "cpu" else KERNELS
    candidates = [k for k in table if k.kinds == _promoted(kinds)]  # type: ignore[arg-type]
    candidates = [k for k in candidates if elements in k.elements]
    if not candidates:
        return None, f"{pair}: no torch kernel pairs {kinds[0]} {elements[0]} with {kinds[1]} {elements[1]}"
    kernel = candidates[0]
    cap = "cpu" if capability == "cpu" else f"sm{capability[0]}{capability[1]}"
    if not kernel.runs_on(capability):
        return None, f"{pair}: the {kernel.name} kernel needs {kernel.where()}, this device is {cap}"
    (m, k), (n, kb) = shape_a, shape_b
    if k != kb:
        return None, f"{pair}: the operands' padded K differ ({k} vs {kb}; their blocks pad K differently)"
    if 0 in (m, n, k):
        return None, f"{pair}: an empty operand ({m}x{k} @ {k}x{n}), nothing for a kernel to do"
    if kernel.device == "cpu":
        return kernel, f"{pair}: {kernel.name} ({kernel.source})"
    if k % kernel.k_multiple or n % 16 or k % 16:
        return None, (
            f"{pair}: {kernel.name} needs K a multiple of {max(kernel.k_multiple, 16)} and N of 16 "
            f"(got M={m}, N={n}, K={k})"
        )
    return kernel, f"{pair}: {kernel.name} on {cap} ({kernel.source})"


def to_blocked(scale: torch.Tensor) -> torch.Tensor:
    """``scale`` (rows, cols) in cuBLAS's swizzled block-scale layout, flattened.

    Zero-pads to (ceil(rows / 128) * 128, ceil(cols / 4) * 4), cuts it into 128x4 tiles (row-block major,
    then column-block), and stores each tile as 32x16: element (r, c) of a tile goes to row ``r % 32``,
    column ``(r // 32) * 4 + c`` (cuBLAS "1D block scaling factors layout"; torchao's ``to_blocked``).
    Any dtype (e8m0 / e4m3 scales are handled as their bytes). Returns a contiguous 1-D tensor of
    ``32 * ceil(rows / 128) * 16 * ceil(cols / 4)`` elements.
    """
    rows, cols = scale.shape
    row_blocks, col_blocks = -(-rows // 128), -(-cols // 4)
    raw = scale.view(torch.uint8) if scale.element_size() == 1 else scale
    padded = torch.nn.functional.pad(raw, (0, col_blocks * 4 - cols, 0, row_blocks * 128 - rows))
    tiles = padded.reshape(row_blocks, 128, col_blocks, 4).permute(0, 2, 1, 3)
    swizzled = tiles.reshape(-1, 4, 32, 4).transpose(1, 2).reshape(-1).contiguous()
    return swizzled.view(scale.dtype) if raw is not scale else swizzled
