"""The three GEMMs of a low-bit linear layer, each operand quantized as its recipe says.

Every GEMM is ``C = A @ B.T`` with both operands quantized along their last (reduction) axis, so one
function serves all three (see :mod:`mixprec.lowbit.recipes` for which tensor is A and B). On CUDA,
:func:`lowbit_mm` runs the pair on the tensor-core kernel :mod:`mixprec.lowbit.kernels`' table names for
the device's compute capability: fp8 tensorwise / rowwise (sm89+), fp8 blockwise 1x128 / 128x128 (sm90),
MXFP8, MXFP4 and NVFP4 with swizzled block scales (sm100), through ``torch.nn.functional.scaled_mm``'s
aten op where torch has it and ``torch._scaled_mm`` otherwise. Everywhere else (a CPU, sm89 / sm120 for
block formats, sizes the kernels refuse) the GEMM is emulated exactly as torchao emulates: dequantize both
operands to float32, ``torch.mm``, cast to the output dtype (:func:`emulated_mm`), with one warning per
process for each pair of formats, device and reason. :func:`kernel_path` says which path a pair takes.

A rowwise x rowwise fp8 GEMM on CUDA without fast accumulation (``GemmOptions.use_fast_accum`` False:
float8's dgrad and wgrad by default) runs as torchao's ``float8_ops.addmm_float8_unwrapped`` runs it,
since torch's rowwise CUTLASS kernel is slow without fast accumulation: cuBLAS's tensorwise kernel with
unit scales, written in bf16 (for an fp16 / fp32 output too, cast at the end), then
``out *= scale_a * scale_b`` with the (M, 1) and (1, N) float32 descales (in eager mode on a CUDA tensor
one Triton pass, :func:`mixprec.lowbit.triton_quantize.post_scale_`, bit for bit torch's expression
without its (M, N) float32 product). So ``mixprec.float8``'s rowwise GEMMs are torchao's bit for bit on a
GPU. With fast accumulation the rowwise kernel runs, as in torchao.

The random Hadamard transform (NVFP4's wgrad recipe) multiplies each run of 16 rows along M by
``H16 @ diag(signs) / 4``, an orthogonal matrix, on both wgrad operands, so ``(Q go).T (Q x) = go.T x``
exactly before quantization; it spreads an outlier over 16 values. The signs are fixed (drawn once from a
``torch.Generator`` seeded with 0), as Transformer Engine fixes its sign vector.
"""

from __future__ import annotations

import os
import threading
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from mixprec._triton import interpreting
from mixprec.lowbit import history as tensor_history
from mixprec.lowbit.formats import LowbitFormat, get_format
from mixprec.lowbit.history import GRAD_OUTPUT, INPUT, WEIGHT
from mixprec.lowbit.kernels import KERNELS, Kernel, select_kernel, to_blocked
from mixprec.lowbit.quantize import Quantized, quantize, quantize_pair
from mixprec.lowbit.recipes import HP, Recipe

__all__ = [
    "GemmOptions",
    "LowbitLinearFunction",
    "device_capability",
    "emulated_mm",
    "gemm_kernel_paths",
    "gemm_operands",
    "hadamard_16",
    "kernel_path",
    "lowbit_mm",
    "scaled_mm",
]

_HADAMARD_SIZE = 16
# torch.randint(0, 2, (16,), generator=torch.Generator().manual_seed(0)) as bits (bit i set: sign i is +1),
# so the signs are made on the matrix's device from a Python int, with no host tensor to copy.
_HADAMARD_SIGN_BITS = 10230
_HADAMARD: dict[torch.device, torch.Tensor] = {}
_LOCK = threading.Lock()

_F = torch.nn.functional


def _aten_scaled_mm_v2(
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_recipe_a: Any,
    scale_b: torch.Tensor,
    scale_recipe_b: Any,
    *,
    swizzle_a: Any,
    swizzle_b: Any,
    output_dtype: torch.dtype,
    use_fast_accum: bool,
) -> torch.Tensor:
    """``torch.nn.functional.scaled_mm`` with one scale per operand, as the aten op it calls (the same
    arguments, enums as their ints). torch.compile traces the op; torch 2.11's Dynamo cannot trace the
    ``torch._scaled_mm_v2`` binding that ``F.scaled_mm`` calls (a graph break, an error under fullgraph)."""
    return torch.ops.aten._scaled_mm_v2(
        mat_a, mat_b, [scale_a], [scale_recipe_a.value], [swizzle_a.value],
        [scale_b], [scale_recipe_b.value], [swizzle_b.value], None, output_dtype, [], use_fast_accum,
    )  # fmt: skip


# torch's v2 scaled matmul where this torch has it (2.10+), else torch._scaled_mm.
_HAS_V2 = hasattr(_F, "scaled_mm") and hasattr(_F, "ScalingType") and hasattr(torch.ops.aten, "_scaled_mm_v2")
_SCALED_MM_V2 = _aten_scaled_mm_v2 if _HAS_V2 else None
_KERNEL_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_V2_RECIPE = {
    "tensor": "TensorWise",
    "row": "RowWise",
    "1x128": "BlockWise1x128",
    "128x128": "BlockWise128x128",
    "mx": "BlockWise1x32",
    "nv16": "BlockWise1x16",
}


#: How a rowwise x rowwise fp8 GEMM runs on CUDA without fast accumulation (kernel_path's reason says it).
_ROWWISE_WITHOUT_FAST_ACCUM = (
    "use_fast_accum=False runs it on fp8_tensorwise with unit scales, then out *= scale_a * scale_b on the "
    "bf16 output (torchao float8_ops.addmm_float8_unwrapped)"
)


@dataclass(frozen=True)
class GemmOptions:
    """One GEMM's settings (torchao's ``ScaledMMConfig``).

    Attributes:
        emulate: True emulates everywhere; False runs torch's kernel wherever the kernel table has one,
            the CPU's included (``mixprec.lowbit.kernels.CPU_RULE``, torchao's ``emulate=False``); None
            (the default) runs the CUDA kernels and emulates on a CPU.
        use_fast_accum: passed to the kernel (fp8's faster, less exact accumulation); emulation ignores it.
        pad_inner_dim: zero-pad K of tensorwise / rowwise operands to a multiple of 16 after quantization
            (the scales are the unpadded tensor's), which CUDA's kernels need; zeros add nothing.
    """

    emulate: bool | None = None
    use_fast_accum: bool = False
    pad_inner_dim: bool = False


_DEFAULT_OPTIONS = GemmOptions()
_DEFAULT_GEMMS = (_DEFAULT_OPTIONS,) * 3
# A CUDA tensor of a build without CUDA (FakeTensorMode on a CPU build) has no device to ask; it is taken
# as the capability torch's meta kernels model (Hopper), so shape-only runs decide as a GPU would.
SHAPES_ONLY_CAPABILITY = (9, 0)


def hadamard_16(device: torch.device | str = "cpu") -> torch.Tensor:
    """The float32 (16, 16) orthogonal matrix ``H16 @ diag(signs) / 4`` of the random Hadamard transform.

    Built on ``device`` from torch ops alone (no host-to-device copy) and cached per device, so a backward
    pass reuses it; do not modify it in place. Under an active FakeTensorMode it is built fresh and not
    cached, so no FakeTensor outlives its mode.
    """
    device = torch.device(device)
    # Traced (torch.compile) or fake: build in the graph / in the fake mode, keeping the cache real.
    if torch.compiler.is_compiling() or torch._guards.detect_fake_mode() is not None:
        return _build_hadamard(device)
    with _LOCK:
        h = _HADAMARD.get(device)
        if h is None:
            h = _HADAMARD[device] = _build_hadamard(device)
    return h


def _build_hadamard(device: torch.device) -> torch.Tensor:
    h = torch.ones(1, 1, device=device)
    while h.shape[0] < _HADAMARD_SIZE:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    bits = torch.bitwise_right_shift(_HADAMARD_SIGN_BITS, torch.arange(_HADAMARD_SIZE, device=device)) & 1
    return h * (bits * 2 - 1).to(h.dtype) / 4.0


def _rotate_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` (M, C) with each run of 16 rows multiplied by the Hadamard matrix (M zero-padded to 16)."""
    m = t.shape[0]
    pad = -m % _HADAMARD_SIZE
    t = torch.nn.functional.pad(t.to(torch.float32), (0, 0, 0, pad))
    h = hadamard_16(t.device)
    return torch.einsum("ij,bjc->bic", h, t.reshape(-1, _HADAMARD_SIZE, t.shape[1])).reshape(-1, t.shape[1])


def device_capability(device: torch.device | str) -> tuple[int, int] | None:
    """``(major, minor)`` of a CUDA device (``torch.cuda.get_device_capability``); None for other devices."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    try:
        major, minor = torch.cuda.get_device_capability(device)
    except (AssertionError, RuntimeError):  # no CUDA in this build: only a fake tensor gets this far
        if torch.cuda.is_available() or torch._guards.detect_fake_mode() is None:
            raise
        return SHAPES_ONLY_CAPABILITY
    return int(major), int(minor)


def _select(
    a: Quantized, b: Quantized, capability: tuple[int, int] | None = None, emulate: bool | None = None
) -> tuple[Kernel | None, str]:
    if a.data.device != b.data.device:
        return None, f"{a.fmt.name} x {b.fmt.name}: operands on {a.data.device} and {b.data.device}"
    if emulate:
        return None, f"{a.fmt.name} x {b.fmt.name}: emulate=True"
    cap: tuple[int, int] | str | None = device_capability(a.data.device) if capability is None else capability
    if cap is None and emulate is False and a.data.device.type == "cpu":
        cap = "cpu"  # the CPU rule (kernels.CPU_RULE): torch's kernels asked for explicitly
    return select_kernel(a.fmt, b.fmt, _value_shape(a), _value_shape(b), cap)


def kernel_path(
    a: Quantized, b: Quantized, capability: tuple[int, int] | None = None
) -> tuple[str | None, str]:
    """``(kernel name or None, why)`` for ``a @ b.T`` of two (rows, K) matrices quantized along K.

    The name is a :data:`mixprec.lowbit.kernels.KERNELS` entry (``"fp8_rowwise"``, ``"mxfp8"``, ...) or
    None when :func:`lowbit_mm` emulates; the string names the formats, the device and the reason.
    ``capability``: decide for this CUDA compute capability instead of the operands' device's (a table
    for GPUs this machine lacks; the operands may be CPU or meta tensors). For ``fp8_rowwise`` the reason
    adds how :func:`lowbit_mm` runs it without fast accumulation (torchao's tensorwise kernel with unit
    scales and the scales applied to its bf16 output; see the module doc).
    """
    kernel, reason = _select(a, b, capability)
    if kernel is not None and kernel.kinds == ("row", "row"):
        reason += f"; {_ROWWISE_WITHOUT_FAST_ACCUM}"
    return (kernel.name if kernel is not None else None), reason


def lowbit_mm(
    a: Quantized, b: Quantized, out_dtype: torch.dtype, options: GemmOptions | None = None
) -> torch.Tensor:
    """``a @ b.T`` of two quantized (rows, K) matrices (quantized along K), (rows_a, rows_b) ``out_dtype``.

    On the kernel ``kernel_path`` names (with ``options``, ``GemmOptions``), else
    ``emulated_mm`` (warning once per process for each pair of formats, device and reason, unless
    ``options.emulate`` asked for it).
    """
    options = options or _DEFAULT_OPTIONS
    if options.pad_inner_dim:
        a, b = _pad_inner(a), _pad_inner(b)
    kernel, reason = _select(a, b, emulate=options.emulate)
    if kernel is not None and out_dtype not in _KERNEL_OUT_DTYPES:
        kernel, reason = None, f"{reason}; but the kernels write bf16/fp16/fp32, not {out_dtype}"
    if kernel is None:
        if not options.emulate:
            _warn_once(a, b, reason)
        return emulated_mm(a, b, out_dtype)
    return _scaled(kernel, a, b, out_dtype, options.use_fast_accum)


def scaled_mm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    *,
    emulate: bool = False,
    use_fast_accum: bool = False,
    pad_inner_dim: bool = False,
) -> torch.Tensor:
    """``(a / a_scale) @ (b / b_scale)`` in ``out_dtype`` for tensorwise fp8 ``a`` (M, K) and ``b`` (K, N)
    with float32 scalar scales (multipliers, as torchao's): :func:`~mixprec.lowbit.lowbit_mm` of the two,
    torch's kernel wherever it has one (``emulate=False``, the CPU's included), torchao's emulation
    otherwise."""
    qa, qb = _tensorwise(a, a_scale, a.dtype), _tensorwise(b.t(), b_scale, b.dtype)
    return lowbit_mm(qa, qb, out_dtype, GemmOptions(emulate, use_fast_accum, pad_inner_dim))


def scaled_mm_accepts(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether :func:`scaled_mm` of fp8 ``a`` (M, K) @ ``b`` (K, N) runs torch's kernel (not emulated)."""
    qa, qb = _tensorwise(a, torch.ones((), device=a.device), a.dtype), _tensorwise(b.t(), None, b.dtype)
    return _select(qa, qb, emulate=False)[0] is not None


_ELEMENT_FORMAT = {
    torch.float8_e4m3fn: "fp8_tensorwise",
    torch.float8_e5m2: "fp8_tensorwise_e5m2",
    torch.float8_e4m3fnuz: "fp8_tensorwise_fnuz",
    torch.float8_e5m2fnuz: "fp8_tensorwise_e5m2fnuz",
}


def _tensorwise(
    data: torch.Tensor,
    scale: torch.Tensor | None,
    dtype: torch.dtype,
    fmt: str = "",
    descale: torch.Tensor | None = None,
) -> Quantized:
    """fp8 ``data`` (rows, K) with one float32 multiplier as a tensorwise :class:`Quantized` (along K),
    with the multiplier's reciprocal where the cast computed it."""
    scale = torch.ones((), device=data.device) if scale is None else scale
    fmt_ = get_format(fmt or _ELEMENT_FORMAT[data.dtype])
    inverse = None if descale is None else descale.reshape(1, 1)
    return Quantized(data, scale.reshape(1, 1), None, fmt_, data.shape, dtype, -1, inverse)


def _pad_inner(q: Quantized) -> Quantized:
    """``q`` with K zero-padded to a multiple of 16, for a scale that does not depend on K's blocks."""
    pad = -q.data.shape[1] % 16
    if not pad or q.scale.shape[1] != 1:
        return q
    data = torch.nn.functional.pad(q.data.contiguous(), (0, pad))
    return Quantized(data, q.scale, q.tensor_scale, q.fmt, data.shape, q.dtype, -1)


def emulated_mm(a: Quantized, b: Quantized, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b.T`` emulated: both operands dequantized to float32, ``torch.mm``, cast to ``out_dtype``."""
    return torch.mm(_matrix(a), _matrix(b).t()).to(out_dtype)


# Warned (formats, device, reason) keys: a set, not the warnings registry, since that registry is per call
# site and reset by warnings filters / catch_warnings, which would repeat the warning every step.
_WARNED: set[tuple[str, str, str, str]] = set()


def _warn_once(a: Quantized, b: Quantized, reason: str) -> None:
    if torch.compiler.is_compiling():  # a warning (and the lock) would break the graph; eager warns
        return
    cap = device_capability(a.data.device)
    where = f"{a.data.device}" + (f" (compute capability {cap[0]}.{cap[1]})" if cap else "")
    key = (a.fmt.name, b.fmt.name, where, reason)
    with _LOCK:
        if key in _WARNED:
            return
        _WARNED.add(key)
    warnings.warn(f"mixprec.lowbit: emulating the GEMM on {where}: {reason}", stacklevel=3)


def _value_shape(q: Quantized) -> tuple[int, int]:
    """The stored (rows, K) matrix's shape in values (two e2m1 values per byte)."""
    rows, k = q.data.shape
    return rows, k * (2 if q.fmt.element == "e2m1" else 1)


def _rows(q: Quantized) -> int:
    """The rows of the matrix ``q`` quantized, before padding."""
    axis, rows = q.axis % len(q.shape), 1
    for i, size in enumerate(q.shape):  # a loop, not a generator: torch.compile traces this (fullgraph)
        if i != axis:
            rows *= size
    return rows  # K == 0 keeps its rows


def _matrix(q: Quantized) -> torch.Tensor:
    """The (rows, K) matrix ``q`` quantized, dequantized to float32."""
    if q.scale.shape == (1, 1) and q.fmt.scale in ("fp32", "pow2"):
        # One multiplier: the same division as dequantize's, without its block indexing, which a
        # shape-only (fake) CUDA tensor refuses on a build without CUDA.
        return (q.values() / q.scale).narrow(0, 0, _rows(q)).narrow(1, 0, q.shape[q.axis])
    return q.dequantize(torch.float32).movedim(q.axis, -1).reshape(-1, q.shape[q.axis])


def _operand_scale(q: Quantized, kind: str, rhs: bool, rows: int) -> torch.Tensor:
    """``q``'s scales in the layout torch's kernel takes for ``kind`` (ScaledBlas.cpp is_desired_scaling).

    ``rhs``: ``q`` is B of ``A @ B.T`` (torch sees ``B.T`` and checks ``scale_b.T``). ``rows``: the stored
    rows, to which a tensorwise scale promoted to rowwise is repeated.
    """
    if kind in ("mx", "nv16"):
        scale = q.scale
        if q.fmt.block[0] > 1:  # 16x16 NVFP4 blocks: each block's scale on each of its rows, the same product
            scale = scale.repeat_interleave(q.fmt.block[0], dim=0)
        return to_blocked(scale)
    descale = q.block_descale()
    if kind == "tensor":
        return descale
    if kind == "row":  # (M, 1) for A, (1, N) for B; a tensorwise scale repeated (contiguous, as torch checks)
        descale = descale.expand(rows, 1).contiguous()
        return descale.reshape(1, rows) if rhs else descale
    if kind == "1x128":  # outer-dim-major: (M, K/128) with strides (1, M); B's as (K/128, N) row-major
        return descale.t().contiguous() if rhs else descale.t().contiguous().t()
    return descale.contiguous().t() if rhs else descale.contiguous()  # 128x128: row-major (M/128, K/128)


def _scaled(
    kernel: Kernel, a: Quantized, b: Quantized, out_dtype: torch.dtype, fast_accum: bool = False
) -> torch.Tensor:
    """``a @ b.T`` on ``kernel``; the result trimmed to the operands' unpadded rows.

    The one entry to torch's scaled matmul in mixprec (through :func:`_call`): A row-major, B.T
    column-major (cuBLASLt's layout; a transposed view, as a tensorwise operand reused by another GEMM
    is, is copied). A rowwise pair without fast accumulation on CUDA runs as
    :func:`_rowwise_post_scaled` (torchao's path, see the module doc).
    """
    kind_a, kind_b = kernel.kinds
    scale_a = _operand_scale(a, kind_a, False, a.data.shape[0])
    scale_b = _operand_scale(b, kind_b, True, b.data.shape[0])
    data_a, data_b = _kernel_data(a).contiguous(), _kernel_data(b).contiguous()
    if _post_scaled(kernel, a, b, fast_accum):
        out = _rowwise_post_scaled(data_a, data_b.t(), scale_a, scale_b, out_dtype)
        return out.narrow(0, 0, _rows(a)).narrow(1, 0, _rows(b))
    two_level = a.tensor_scale is not None or b.tensor_scale is not None
    dtype = torch.float32 if two_level else out_dtype
    if kernel.kinds == ("row", "row") and a.data.device.type == "cuda" and dtype != torch.bfloat16:
        # torch's rowwise kernels write bf16 only outside sm90's cuBLAS (ScaledBlas.cpp); torchao asks
        # for bf16 and casts (addmm_float8_unwrapped, pytorch#156771), as here
        dtype = torch.bfloat16
    out = _call(kernel, data_a, data_b.t(), scale_a, scale_b, dtype, fast_accum)
    if two_level:  # NVFP4's per-tensor scales, folded into the output: out * (t_a * t_b)
        scales = [t for t in (a.tensor_scale, b.tensor_scale) if t is not None]
        out = out * (scales[0] * scales[1] if len(scales) == 2 else scales[0])
    return out.narrow(0, 0, _rows(a)).narrow(1, 0, _rows(b)).to(out_dtype)


def _call(
    kernel: Kernel,
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    dtype: torch.dtype,
    fast_accum: bool,
) -> torch.Tensor:
    """torch's scaled matmul of ``mat_a`` (M, K) @ ``mat_b`` (K, N) as ``kernel`` takes it: the aten
    ``_scaled_mm_v2`` where this torch has it and the kernel's table entry allows, else
    ``torch._scaled_mm``."""
    kind_a, kind_b = kernel.kinds
    if _SCALED_MM_V2 is not None and not kernel.legacy_api:
        return _SCALED_MM_V2(
            mat_a, mat_b, scale_a, _v2_recipe(kind_a), scale_b, _v2_recipe(kind_b),
            swizzle_a=_v2_swizzle(kind_a), swizzle_b=_v2_swizzle(kind_b), output_dtype=dtype,
            use_fast_accum=fast_accum,
        )  # fmt: skip
    accum: dict[str, Any] = {"use_fast_accum": True} if fast_accum else {}  # torch's default is False
    return torch._scaled_mm(mat_a, mat_b, scale_a=scale_a, scale_b=scale_b, out_dtype=dtype, **accum)


_TENSORWISE_KERNEL = next(k for k in KERNELS if k.name == "fp8_tensorwise")
_OCP_FP8 = ("e4m3", "e5m2")


def _post_scaled(kernel: Kernel, a: Quantized, b: Quantized, fast_accum: bool) -> bool:
    """Whether a GEMM on ``kernel`` runs as :func:`_rowwise_post_scaled`: on a CUDA tensor (a fake one
    included) where :func:`_post_scale_rule` says so."""
    return a.data.device.type == "cuda" and _post_scale_rule(kernel, a, b, fast_accum)


def _post_scale_rule(kernel: Kernel, a: Quantized, b: Quantized, fast_accum: bool) -> bool:
    """Rowwise x rowwise OCP fp8 without fast accumulation: where torchao's ``addmm_float8_unwrapped``
    takes the tensorwise kernel (the device aside: the tests force the path on a CPU with this)."""
    return (
        kernel.kinds == ("row", "row")
        and not fast_accum
        and a.fmt.element in _OCP_FP8
        and b.fmt.element in _OCP_FP8
    )


def _rowwise_post_scaled(
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    descale_a: torch.Tensor,
    descale_b: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """A rowwise fp8 GEMM on the tensorwise kernel: torchao's ``float8_ops.addmm_float8_unwrapped``
    without fast accumulation, bit for bit.

    ``mat_a`` (M, K) @ ``mat_b`` (K, N) on the ``fp8_tensorwise`` kernel with unit scales, written in
    bfloat16 (whatever ``out_dtype``), then ``out *= descale_a * descale_b`` (float32 (M, 1) and (1, N):
    the product and the multiply in float32, one rounding to bfloat16; on a CUDA tensor in eager mode one
    Triton pass, :func:`mixprec.lowbit.triton_quantize.post_scale_`, without the (M, N) float32 product),
    then cast to ``out_dtype`` (bf16, fp16 or fp32). torchao's reason: torch's rowwise CUTLASS kernel is
    much slower than cuBLAS's tensorwise one without fast accumulation.
    """
    one = descale_a.new_ones(())
    out = _call(_TENSORWISE_KERNEL, mat_a, mat_b, one, one, torch.bfloat16, False)
    _post_scale_(out, descale_a, descale_b)
    return out.to(out_dtype)


def _post_scale_(out: torch.Tensor, descale_a: torch.Tensor, descale_b: torch.Tensor) -> None:
    """``out *= descale_a * descale_b`` in place: the fused Triton pass where it is eligible, else torch's
    expression (compiled, where inductor fuses it; a CPU, a fake tensor, no Triton,
    ``MIXPREC_FUSED_QUANTIZE=0``)."""
    if not torch.compiler.is_compiling() and (
        out.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    ):
        from mixprec.lowbit import triton_quantize  # imported here: Triton only when a kernel may run

        if triton_quantize.post_scale_eligible(out):
            triton_quantize.post_scale_(out, descale_a, descale_b)
            return
    out.mul_(descale_a * descale_b)


def _kernel_data(q: Quantized) -> torch.Tensor:
    """``q.data`` as the kernel reads it: fp8 as is, two e2m1 codes per byte as ``torch.float4_e2m1fn_x2``.

    mixprec packs the first value in the low nibble, as torchao's ``pack_uint4``, which is torch's fp4x2.
    """
    return q.data.view(torch.float4_e2m1fn_x2) if q.fmt.element == "e2m1" else q.data


def _v2_recipe(kind: str) -> Any:
    return getattr(_F.ScalingType, _V2_RECIPE[kind])


def _v2_swizzle(kind: str) -> Any:
    return _F.SwizzleType.SWIZZLE_32_4_4 if kind in ("mx", "nv16") else _F.SwizzleType.NO_SWIZZLE


def _gemm(a, a_fmt, b, b_fmt, out_dtype, sr_a=False, generator=None, options=None) -> torch.Tensor:
    """``a @ b.T`` for (rows, K) matrices, each operand quantized along K unless its format is hp."""
    if a_fmt == HP and b_fmt == HP:
        return torch.mm(a.to(out_dtype), b.to(out_dtype).t())
    qa = _quantize_operand(a, a_fmt, sr_a, generator) if a_fmt != HP else a
    qb = _quantize_operand(b, b_fmt) if b_fmt != HP else b
    return _mm(qa, qb, out_dtype, options)


def _quantize_operand(x, fmt, stochastic=False, generator=None) -> Quantized:
    """One GEMM operand (rows, K) quantized along K (the per-use quantization)."""
    return quantize(x, fmt, stochastic=stochastic, generator=generator, pad=True)


def _quantize_both(x, fmt) -> tuple[Quantized, Quantized]:
    """``x`` (rows, K) quantized for both its GEMMs, along K and (as ``x.T``) along rows, from one read."""
    return quantize_pair(x, fmt)


def _mm(a, b, out_dtype, options=None) -> torch.Tensor:
    """``a @ b.T`` of two (rows, K) operands, each a :class:`Quantized` or a high-precision tensor."""
    qa, qb = isinstance(a, Quantized), isinstance(b, Quantized)
    if qa and qb:  # (three arguments where there are no options: lowbit's own)
        return lowbit_mm(a, b, out_dtype) if options is None else lowbit_mm(a, b, out_dtype, options)
    if not qa and not qb:
        return torch.mm(a.to(out_dtype), b.to(out_dtype).t())
    # a high-precision operand enters in the output dtype (a float32 master weight as a bf16 GEMM sees it)
    a32 = _matrix(a) if qa else a.to(out_dtype).to(torch.float32)
    b32 = _matrix(b) if qb else b.to(out_dtype).to(torch.float32)
    return torch.mm(a32, b32.t()).to(out_dtype)


#: Whether an operand with one format in both its GEMMs is quantized once for both (the transposed copy
#: saved for backward); False quantizes it per use, as before (the tests' reference path).
SHARE_CASTS = True


def shared_operands(recipe: Recipe) -> tuple[bool, bool, bool]:
    """Whether input, weight and grad_output are each quantized once for both GEMMs they enter.

    An operand is shared when both its uses quantize it to one (not hp) format, and no Hadamard rotation
    (``rht``, the wgrad operands) or stochastic rounding (``sr``, grad_output) makes the two differ:
    input for fprop and wgrad, weight for fprop and dgrad, grad_output for dgrad and wgrad.
    """
    if not SHARE_CASTS:
        return False, False, False

    def same(a: str, b: str) -> bool:
        return a == b and a != HP

    return (
        same(recipe.fprop_x, recipe.wgrad_x) and not recipe.rht,
        same(recipe.fprop_w, recipe.dgrad_w),
        same(recipe.dgrad_go, recipe.wgrad_go) and not recipe.rht and not recipe.sr,
    )


def _scale_cast(
    role, x, fmt_name, scaling, history, stats, update, transpose=False
) -> tuple[Quantized, torch.Tensor, Quantized | None]:
    """``x`` (rows, K) cast to the tensorwise format ``fmt_name`` with ``scaling``'s scale for ``role``,
    that scalar scale and, with ``transpose``, ``x.T`` cast with the same scale (the other GEMM's operand)."""
    fmt = get_format(fmt_name)
    if not fmt.is_tensorwise:
        raise ValueError(f"a TensorScaling layer needs tensorwise formats, got {fmt_name!r}")
    fused = _fused_per_tensor(x, fmt, scaling, history)
    if fused is not None:  # the scale computed and recorded on the device between the amax and the cast
        in_kernel = stats.dtype == torch.float32 and stats.device == x.device
        slots = {"amax_out": stats[0, role], "scale_out": stats[1, role]} if in_kernel else {}
        if history is None:
            cast = fused.dynamic_cast(x, fmt, transpose=transpose, **slots)
        else:
            cast = fused.delayed_cast(
                x, fmt, history[role], amax_compute_algo=scaling.amax_compute_algo, margin=scaling.margin,
                update=update, transpose=transpose, **slots,
            )  # fmt: skip
        if not in_kernel:  # a stats buffer moved to another dtype: torch's copy converts
            stats[0, role], stats[1, role] = cast.amax, cast.scale
        scale, descale = cast.scale, cast.descale
        q_t = _tensorwise(cast.data_t, scale, x.dtype, fmt_name, descale) if cast.data_t is not None else None
        return _tensorwise(cast.data, scale, x.dtype, fmt_name, descale), scale, q_t
    scale = scaling.scale(role, x, fmt.elem, fmt.scale == "pow2", history, stats, update)
    data, data_t = _to_float8(x, scale, fmt, transpose)
    q_t = _tensorwise(data_t, scale, x.dtype, fmt_name) if transpose else None
    return _tensorwise(data, scale, x.dtype, fmt_name), scale, q_t


def _to_float8(
    x: torch.Tensor, scale: torch.Tensor, fmt: LowbitFormat, transpose: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``history.to_float8`` and its transpose: on CUDA in eager mode one fused Triton pass writes both
    (with ``transpose``; the same bits, the transpose contiguous), else torch ops and a transposed view."""
    if _fused(x, fmt):
        from mixprec.lowbit import triton_quantize

        data, data_t = triton_quantize.scaled_cast(x, scale, fmt, transpose=transpose)
        return data, (data_t if data_t is not None else data.t())
    data = tensor_history.to_float8(x, scale, fmt.elem)
    return data, data.t()


def _fused_per_tensor(x: torch.Tensor, fmt: LowbitFormat, scaling: Any, history: torch.Tensor | None) -> Any:
    """The fused module when a per-tensor layer's operand takes ``dynamic_cast`` (no margin) or
    ``delayed_cast`` (a float32 history, a margin up to its ``MAX_MARGIN``), else None."""
    if not _fused(x, fmt):
        return None
    from mixprec.lowbit import triton_quantize

    if history is None:
        return triton_quantize if scaling.margin == 0 else None
    usable = history.dtype == torch.float32 and history.device == x.device and history.is_contiguous()
    return triton_quantize if usable and scaling.margin <= triton_quantize.MAX_MARGIN else None


def _fused(x: torch.Tensor, fmt: LowbitFormat) -> bool:
    """Whether a per-tensor layer casts the 2-D ``x`` with the Triton kernels: eager CUDA (or the CPU
    under Triton's interpreter, the tests) and :func:`~mixprec.lowbit.triton_quantize.fused_eligible`."""
    if x.dim() != 2 or torch.compiler.is_compiling() or not (x.device.type == "cuda" or interpreting()):
        return False
    from mixprec.lowbit import triton_quantize

    return triton_quantize.fused_eligible(x, fmt)


def _weight_cast(
    weight, fmt_name, scaling, history, stats, update, transpose=False
) -> tuple[Quantized, torch.Tensor, Quantized | None]:
    """The weight (N, K) cast once for fprop and dgrad (with ``transpose`` also its (K, N) transpose). A
    weight that arrives cast (FSDP2's fp8 all-gather: ``tensorwise_cast()`` -> data, scale, amax) is used
    as it is, one that wraps the tensor it stands for (``cast_source``) is cast from that."""
    if hasattr(weight, "tensorwise_cast"):
        data, scale, amax = weight.tensorwise_cast()
        stats[0, WEIGHT], stats[1, WEIGHT] = amax, scale
        q_t = _tensorwise(data.t(), scale, weight.dtype, fmt_name) if transpose else None
        return _tensorwise(data, scale, weight.dtype, fmt_name), scale, q_t
    source = getattr(weight, "cast_source", weight)
    return _scale_cast(WEIGHT, source, fmt_name, scaling, history, stats, update, transpose)


def gemm_operands(
    x2: torch.Tensor, weight: torch.Tensor, grad_out: torch.Tensor, recipe: Recipe
) -> dict[str, tuple[torch.Tensor, str]]:
    """Operand name -> ``(matrix, format name)``, each (rows, K) matrix quantized along K by its GEMM.

    ``x2`` (M, K) is the flattened input, ``weight`` (N, K), ``grad_out`` (M, N); the wgrad operands are
    Hadamard-rotated along M when the recipe says so. The layouts the backward pass uses, for diagnostics.
    """
    go_w, x_w = (_rotate_rows(grad_out), _rotate_rows(x2)) if recipe.rht else (grad_out, x2)
    return {
        "fprop_x": (x2, recipe.fprop_x),
        "fprop_w": (weight, recipe.fprop_w),
        "dgrad_go": (grad_out, recipe.dgrad_go),
        "dgrad_w": (weight.t(), recipe.dgrad_w),
        "wgrad_go": (go_w.t(), recipe.wgrad_go),
        "wgrad_x": (x_w.t(), recipe.wgrad_x),
    }


_GEMM_OPERANDS = {
    "fprop": ("fprop_x", "fprop_w"),
    "dgrad": ("dgrad_go", "dgrad_w"),
    "wgrad": ("wgrad_go", "wgrad_x"),
}


def gemm_kernel_paths(
    x2: torch.Tensor,
    weight: torch.Tensor,
    grad_out: torch.Tensor,
    recipe: Recipe,
    capability: tuple[int, int] | None = None,
) -> dict[str, tuple[str | None, str]]:
    """GEMM (``"fprop"``, ``"dgrad"``, ``"wgrad"``) -> :func:`kernel_path` of its operands as quantized.

    Shapes as :func:`gemm_operands`. A GEMM with a high-precision operand runs ``torch.mm``:
    ``(None, "... hp ...")``. For tables and benchmarks: ``capability`` as :func:`kernel_path` (with
    ``device="meta"`` tensors nothing is computed), or FakeTensorMode on a CUDA build.
    """
    ops = gemm_operands(x2, weight, grad_out, recipe)
    paths: dict[str, tuple[str | None, str]] = {}
    for gemm, (name_a, name_b) in _GEMM_OPERANDS.items():
        (a, fmt_a), (b, fmt_b) = ops[name_a], ops[name_b]
        if HP in (fmt_a, fmt_b):
            paths[gemm] = None, f"{fmt_a} x {fmt_b}: a high-precision operand, torch.mm"
        else:
            paths[gemm] = kernel_path(quantize(a, fmt_a, pad=True), quantize(b, fmt_b, pad=True), capability)
    return paths


class LowbitLinearFunction(torch.autograd.Function):
    """``x @ weight.T`` with the three GEMMs quantized by ``recipe``; bias is added by the caller.

    Per operand (``recipe.scaling`` None, :func:`_per_operand_forward`): each GEMM quantizes its operands
    along its own reduction axis (a rowwise or block format needs a different quantization per GEMM). An
    operand that :func:`shared_operands` names (one format in both its GEMMs, no ``rht`` / ``sr`` in the
    way) is quantized once with its transposed copy (:func:`~mixprec.lowbit.quantize.quantize_pair`,
    Transformer Engine's cast-transpose; bit for bit the per-use quantization), and backward keeps the
    copy: the fp8 ``x.T`` in place of ``x``, the weight's beside it. Any other operand is saved in its
    own precision and quantized by backward; nothing is kept for a gradient not asked for (a frozen
    weight's layer keeps no input). A quantized weight is cast from its own dtype (an fp32
    master under bf16 autocast is rounded once, to the low-bit format, as torchao's float8 and Transformer
    Engine round it); a high-precision operand enters its GEMM in the output dtype.

    Per tensor (``recipe.scaling`` a :class:`~mixprec.lowbit.history.TensorScaling`, tensorwise formats
    only, :func:`_per_tensor_forward`): input, weight and grad_output are each cast once, from their own
    dtypes, with the recipe's scale (dynamic, or delayed from ``history`` float32[3, L], pushed when
    ``update``), the cast writing the transpose too; a tensorwise cast serves both GEMMs a tensor is in, so
    the fp8 ``x.T`` and ``w.T`` are what backward keeps. ``stats`` float32[2, 3] receives each role's
    last amax and scale.

    Args:
        x: (..., K) floating point.
        weight: (N, K).
        recipe: the :class:`~mixprec.lowbit.Recipe` (its ``scaling`` picks the algorithm above).
        generator: feeds stochastic rounding (None: torch's global generator).
        gemms: the fprop, dgrad, wgrad :class:`GemmOptions`; None: the defaults.
        history: the float32[3, L] amax history of delayed scaling; None otherwise.
        stats: the float32[2, 3] stats buffer; required with ``recipe.scaling``.
        update: push the amax history (training).

    Autocast is off inside; the output has ``x``'s dtype, the gradients ``x``'s and ``weight``'s.

    Raises:
        ValueError: for a per-tensor recipe without ``stats``, or a delayed one without ``history``.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        recipe: Recipe,
        generator: torch.Generator | None = None,
        gemms: tuple[GemmOptions, GemmOptions, GemmOptions] | None = None,
        history: torch.Tensor | None = None,
        stats: torch.Tensor | None = None,
        update: bool = True,
    ) -> torch.Tensor:
        ctx.recipe, ctx.generator, ctx.gemms = recipe, generator, gemms
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        with torch.autocast(x.device.type, enabled=False):
            x2 = x.reshape(-1, x.shape[-1])
            if recipe.scaling is None:
                out = _per_operand_forward(ctx, x2, weight, recipe, gemms)
            else:
                out = _per_tensor_forward(ctx, x2, weight, recipe, gemms, history, stats, update)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        with torch.autocast(grad_out.device.type, enabled=False):
            if ctx.recipe.scaling is None:
                grad_x, grad_w = _recipe_backward(ctx, grad_out)
            else:
                grad_x, grad_w = _tensorwise_backward(ctx, grad_out)
        # One gradient per forward argument; autograd drops the trailing Nones of arguments not given.
        return grad_x, grad_w, None, None, None, None, None, None


def _per_operand_forward(
    ctx: Any,
    x2: torch.Tensor,
    weight: torch.Tensor,
    recipe: Recipe,
    gemms: tuple[GemmOptions, GemmOptions, GemmOptions] | None,
) -> torch.Tensor:
    """The fprop GEMM of a per-operand recipe. An operand :func:`shared_operands` names is quantized once
    for both its GEMMs and its transposed copy saved (fp8 in place of the input, see the class doc);
    any other is saved in its own precision for backward to quantize."""
    share_x, share_w, _ = shared_operands(recipe)
    share_x = share_x and ctx.needs_input_grad[1]  # the saved copy feeds wgrad only
    share_w = share_w and ctx.needs_input_grad[0]  # ... and dgrad only
    # The weight is quantized from its own dtype, as torchao and TE do.
    qx: Quantized | torch.Tensor = x2
    qw: Quantized | torch.Tensor = weight
    # Only what a needed gradient reads is kept: x for wgrad, the weight for dgrad (a frozen weight's
    # layer keeps no input, a first layer's no weight).
    saved_x: Quantized | torch.Tensor | None = x2 if ctx.needs_input_grad[1] else None
    saved_w: Quantized | torch.Tensor | None = weight if ctx.needs_input_grad[0] else None
    if share_x:
        qx, saved_x = _quantize_both(x2, recipe.fprop_x)
    elif recipe.fprop_x != HP:
        qx = _quantize_operand(x2, recipe.fprop_x)
    if share_w:
        qw, saved_w = _quantize_both(weight, recipe.fprop_w)
    elif recipe.fprop_w != HP:
        qw = _quantize_operand(weight, recipe.fprop_w)
    out = _mm(qx, qw, x2.dtype, gemms and gemms[0])
    ctx.shared = (share_x, share_w)
    ctx.saved_meta = [_meta(saved_x), _meta(saved_w)]
    ctx.save_for_backward(*_tensors(saved_x), *_tensors(saved_w))
    return out


def _meta(t: Quantized | torch.Tensor | None) -> tuple[Any, ...] | None:
    """What a saved :class:`Quantized` needs besides its tensors (None: a plain tensor or nothing)."""
    return (t.fmt, t.shape, t.dtype, t.axis) if isinstance(t, Quantized) else None


def _tensors(t: Quantized | torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    return (t.data, t.scale, t.tensor_scale) if isinstance(t, Quantized) else (t, None, None)


def _restore(tensors: tuple[Any, ...], meta: tuple[Any, ...] | None) -> Quantized | torch.Tensor:
    return tensors[0] if meta is None else Quantized(tensors[0], tensors[1], tensors[2], *meta)


def _per_tensor_forward(
    ctx: Any,
    x2: torch.Tensor,
    weight: torch.Tensor,
    recipe: Recipe,
    gemms: tuple[GemmOptions, GemmOptions, GemmOptions] | None,
    history: torch.Tensor | None,
    stats: torch.Tensor | None,
    update: bool,
) -> torch.Tensor:
    """The fprop GEMM of a per-tensor recipe; saves the fp8 input and weight with their scales."""
    scaling = recipe.scaling
    if stats is None:
        raise ValueError("a recipe with per-tensor scaling needs a float32[2, 3] stats buffer, got None")
    if scaling is not None and scaling.delayed and history is None:
        raise ValueError("a recipe with scaling=delayed needs its float32[3, L] amax history, got None")
    history = history if scaling is not None and scaling.delayed else None
    # Each tensor cast once with its transpose (Transformer Engine's cast-transpose): backward keeps only
    # the transposed copies, x.T for wgrad and w.T for dgrad, contiguous as the kernels read them.
    tx, tw = ctx.needs_input_grad[1], ctx.needs_input_grad[0]
    qx, x_scale, qx_t = _scale_cast(INPUT, x2, recipe.fprop_x, scaling, history, stats, update, tx)
    qw, w_scale, qw_t = _weight_cast(weight, recipe.fprop_w, scaling, history, stats, update, tw)
    out = lowbit_mm(qx, qw, x2.dtype, (gemms or _DEFAULT_GEMMS)[0])
    x8_t = qx_t.data if qx_t is not None else None
    w8_t = qw_t.data if qw_t is not None else None
    # a gathered weight's own cast; the descales where the casts computed them (None otherwise)
    ctx.save_for_backward(x8_t, x_scale, qx.descale, w8_t, w_scale, qw.descale)
    ctx.history, ctx.stats, ctx.update = history, stats, update
    return out


def _recipe_backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    saved = ctx.saved_tensors
    x_saved, w_saved = _restore(saved[:3], ctx.saved_meta[0]), _restore(saved[3:], ctx.saved_meta[1])
    recipe, gen, (_, dgrad, wgrad) = ctx.recipe, ctx.generator, ctx.gemms or (None, None, None)
    grad_x = grad_w = None
    dtype = ctx.x_dtype
    go = grad_out.reshape(-1, grad_out.shape[-1]).to(dtype)
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    qgo = qgo_t = None
    if shared_operands(recipe)[2] and need_x and need_w:
        qgo, qgo_t = _quantize_both(go, recipe.dgrad_go)
    if need_x:
        if isinstance(w_saved, Quantized):  # weight's transposed copy from forward
            a = qgo if qgo is not None else _operand(go, recipe.dgrad_go, recipe.sr, gen)
            grad_x = _mm(a, w_saved, dtype, dgrad)
        elif qgo is not None:
            b = _operand(w_saved.t(), recipe.dgrad_w)
            grad_x = _mm(qgo, b, dtype, dgrad)
        else:
            grad_x = _gemm(go, recipe.dgrad_go, w_saved.t(), recipe.dgrad_w, dtype, recipe.sr, gen, dgrad)
        grad_x = grad_x.reshape(ctx.x_shape)
    if need_w:
        if isinstance(x_saved, Quantized) or qgo_t is not None:
            a = qgo_t if qgo_t is not None else _operand(go.t(), recipe.wgrad_go, recipe.sr, gen)
            b = x_saved if isinstance(x_saved, Quantized) else _operand(x_saved.t(), recipe.wgrad_x)
            grad_w = _mm(a, b, dtype, wgrad).to(ctx.w_dtype)
        else:  # nothing shared (as gemm_operands lays the wgrad operands out, Hadamard-rotated or not)
            go_w, x_w = (_rotate_rows(go), _rotate_rows(x_saved)) if recipe.rht else (go, x_saved)
            grad_w = _gemm(go_w.t(), recipe.wgrad_go, x_w.t(), recipe.wgrad_x, dtype, recipe.sr, gen, wgrad)
            grad_w = grad_w.to(ctx.w_dtype)
    return grad_x, grad_w


def _operand(x: torch.Tensor, fmt: str, stochastic: bool = False, generator=None) -> Quantized | torch.Tensor:
    """``x`` (rows, K) as its GEMM takes it: quantized along K, or itself for hp."""
    return x if fmt == HP else _quantize_operand(x, fmt, stochastic, generator)


def _tensorwise_backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    x8_t, x_scale, x_descale, w8_t, w_scale, w_descale = ctx.saved_tensors
    recipe, (_, dgrad, wgrad) = ctx.recipe, ctx.gemms or _DEFAULT_GEMMS
    grad_x = grad_w = None
    go2 = grad_out.reshape(-1, grad_out.shape[-1])
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    qgo, _, qgo_t = _scale_cast(
        GRAD_OUTPUT, go2, recipe.dgrad_go, recipe.scaling, ctx.history, ctx.stats, ctx.update, need_w
    )
    if need_x:
        qw_t = _tensorwise(w8_t, w_scale, ctx.w_dtype, recipe.dgrad_w, w_descale)
        grad_x = lowbit_mm(qgo, qw_t, grad_out.dtype, dgrad).reshape(ctx.x_shape).to(ctx.x_dtype)
    if need_w:
        assert qgo_t is not None
        qgo_t = _tensorwise(qgo_t.data, qgo.scale, grad_out.dtype, recipe.wgrad_go, qgo.descale)
        qx_t = _tensorwise(x8_t, x_scale, ctx.x_dtype, recipe.wgrad_x, x_descale)
        grad_w = lowbit_mm(qgo_t, qx_t, grad_out.dtype, wgrad).to(ctx.w_dtype)
    return grad_x, grad_w
