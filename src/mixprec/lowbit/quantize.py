"""`quantize`: a tensor to a block-scaled low-bit format, and the :class:`Quantized` value it returns.

The tensor is seen as a 2-D (M, K) matrix whose K runs along ``axis`` (the GEMM's reduction dimension:
``axis=-1`` for ``x`` of ``x @ w.T``, ``axis=0`` for the operands of the weight-gradient GEMM); blocks are
(rows, cols) tiles of that matrix. Per block: amax, scale (:mod:`mixprec.lowbit.block_scales`), multiply into
the element range, saturate to ``±elem.max``, round (nearest-even, or stochastic), store. e4m3 / e5m2 are
stored as torch's float8 dtypes, e2m1 as two 4-bit codes per uint8 (first value in the low nibble, as
torchao's ``pack_uint4``). Without ``stochastic`` the results are bit for bit torchao 0.18's pure-PyTorch
references: ``MXTensor.to_mx``, ``NVFP4Tensor.to_nvfp4`` and the float8 ``hp_tensor_to_float8_dynamic``.

Stochastic rounding rounds ``|v|`` to one of its two neighbours on the element grid with probability
proportional to closeness, ``floor(|v| / ulp + u) * ulp`` with ``u ~ U[0, 1)`` drawn from ``generator``
(computed in float64, so it is exact for every fp32 input), which makes ``E[q] = v`` within the range.
To keep every value within the range, a stochastic ``quantize`` gives each block whose largest value the
nearest scale puts above ``elem.max`` the next coarser scale (:func:`block_scales.coarser_scale`: the e4m3
descale rounded up for NVFP4, with a per-tensor scale ``TENSOR_HEADROOM`` larger; ``ceil(log2(amax /
elem_max))`` for MX), so nothing saturates and ``E[dequantize(q)] = x`` on every element: a saturated value
has no round-up to balance it. Values beyond a given ``tensor_amax`` still saturate, as asked.
"""

from __future__ import annotations

import os
from typing import TypeGuard

import torch

from mixprec import formats
from mixprec.lowbit import block_scales
from mixprec.lowbit.formats import LowbitFormat, get_format
from mixprec.lowbit.quantized import Quantized, e2m1_values

__all__ = [
    "Quantized",
    "e2m1_values",
    "hold_generator",
    "quantize",
    "quantize_pair",
    "round_to_element",
    "uniform_noise",
]


def quantize(
    x: torch.Tensor,
    fmt: LowbitFormat | str,
    *,
    axis: int = -1,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
    pad: bool = False,
    tensor_amax: torch.Tensor | None = None,
) -> Quantized:
    """Quantize ``x`` to ``fmt`` with blocks along ``axis`` (see the module doc).

    Args:
        x: a floating tensor of any shape with at least one dimension (fp32, bf16, fp16).
        fmt: a :class:`LowbitFormat` or a name in :data:`mixprec.lowbit.FORMATS`.
        axis: the dimension blocks run along (the GEMM's reduction dimension).
        stochastic: stochastic rounding of the elements instead of nearest-even.
        generator: the ``torch.Generator`` stochastic rounding draws from (default: torch's global one).
        pad: zero-pad sizes that are not a multiple of the block; otherwise they are refused.
        tensor_amax: a two-level format's per-tensor amax (default: ``max|x|``), e.g. from calibration.

    Returns:
        A :class:`Quantized`.

    Raises:
        TypeError: for a non-tensor or non-floating ``x``, or a bad ``generator``.
        ValueError: for an unknown format, an ``axis`` out of range, sizes that are not a multiple of
            the block without ``pad``, or a ``tensor_amax`` that is not one finite number > 0 or is given
            to a format without a per-tensor scale.
    """
    fmt = get_format(fmt)
    axis = _check(x, axis, stochastic, generator, pad)
    if tensor_amax is not None:
        _check_tensor_amax(tensor_amax, fmt)
    x2 = _as_matrix(x, axis)
    rows, cols = _block_of(fmt, x2.shape)
    if not stochastic and tensor_amax is None and (pad or not (x2.shape[0] % rows or x2.shape[1] % cols)):
        fused = _fused(x2, fmt)
        if fused is not None:  # the same bits from one or two Triton kernels (CUDA, eager)
            return Quantized(fused[0].data, fused[0].scale, None, fmt, x.shape, x.dtype, axis)
    x2 = _pad(x2, rows, cols, pad, fmt, x.shape, axis)
    x2 = x2.to(torch.float32)
    amax = block_scales.block_amax(x2, rows, cols)
    tensor_scale = None
    if fmt.two_level:
        full = (
            block_scales.block_amax(x2, x2.shape[0], x2.shape[1])[0, 0]
            if tensor_amax is None
            else tensor_amax
        )
        full = _on_device(full, x.device)
        tensor_scale = block_scales.nvfp4_tensor_scale(full, headroom=stochastic)
    scaled, scale = _scale(x2, amax, fmt, rows, cols, tensor_scale, unsaturated=stochastic)
    scaled = torch.clamp(scaled, min=-fmt.elem.max, max=fmt.elem.max)
    if stochastic:
        scaled = round_to_element(scaled, fmt.elem, stochastic=True, generator=generator)
    data = _store(scaled, fmt)
    return Quantized(data, scale, tensor_scale, fmt, x.shape, x.dtype, axis)


def quantize_pair(x: torch.Tensor, fmt: LowbitFormat | str) -> tuple[Quantized, Quantized]:
    """``x`` (M, K) quantized along K and ``x.T`` (K, M) along M, from one read of ``x`` on CUDA.

    Bit for bit ``(quantize(x, fmt, pad=True), quantize(x.t(), fmt, pad=True))``, the pair a linear
    layer's two GEMMs of one operand need (Transformer Engine's cast-transpose). On CUDA in eager mode, for a
    format ``mixprec.lowbit.triton_quantize.format_supported`` accepts, one fused Triton pass writes
    both (``mixprec.lowbit.triton_quantize.quantize`` with ``transpose=True``). Elsewhere (a CPU,
    ``torch.compile``, other formats, ``MIXPREC_FUSED_QUANTIZE=0``) a tensorwise format takes one amax
    and one scale, the transposed copy a view of the same fp8 data (casting is elementwise, so the bits
    are the same); any other format is quantized along each axis by :func:`~mixprec.lowbit.quantize`.

    Args:
        x: a floating (M, K) tensor (fp32, bf16, fp16).
        fmt: a :class:`~mixprec.lowbit.LowbitFormat` or a name in :data:`mixprec.lowbit.FORMATS`.

    Returns:
        ``(q, q_t)``: two :class:`~mixprec.lowbit.Quantized`, ``q_t.shape == (K, M)`` with ``axis=1``.

    Raises:
        TypeError: for a non-tensor or non-floating ``x``.
        ValueError: for an ``x`` that is not 2-D, or an unknown format.
    """
    fmt = get_format(fmt)
    _check(x, -1, False, None, True)
    if x.dim() != 2:
        raise ValueError(f"quantize_pair takes a 2-D (M, K) tensor, got shape {tuple(x.shape)}")
    fused = _fused(x, fmt, transpose=True)
    if fused is not None:
        q, q_t = fused
        assert q_t is not None
        return q, q_t
    q = quantize(x, fmt, pad=True)
    if fmt.is_tensorwise:  # one scale for both: the transposed copy is the same bits, seen transposed
        shape_t = torch.Size((x.shape[1], x.shape[0]))
        return q, Quantized(q.data.t(), q.scale, q.tensor_scale, fmt, shape_t, x.dtype, 1)
    return q, quantize(x.t(), fmt, pad=True)


def _fused(
    x2: torch.Tensor, fmt: LowbitFormat, transpose: bool = False
) -> tuple[Quantized, Quantized | None] | None:
    """``x2`` (and with ``transpose`` its transposed copy) quantized by
    :mod:`mixprec.lowbit.triton_quantize` where it is eligible, else None."""
    if torch.compiler.is_compiling() or (
        x2.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1"
    ):
        return None  # compiled: inductor fuses the pure-torch ops; a CPU tensor: not without the interpreter
    from mixprec.lowbit import triton_quantize

    if not triton_quantize.fused_eligible(x2, fmt):
        return None
    return triton_quantize.quantize(x2, fmt, transpose=transpose)


def _on_device(value: torch.Tensor | float, device: torch.device) -> torch.Tensor:
    """A float32 0-dim tensor on ``device``: a Python number is filled there (a kernel argument, not a
    pageable host-to-device copy as ``torch.as_tensor(value, device=...)`` makes)."""
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=torch.float32).reshape(())
    return torch.full((), float(value), dtype=torch.float32, device=device)


def _check(x: object, axis: object, stochastic: object, generator: object, pad: object) -> int:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() == 0:
        raise TypeError(f"x must be a floating torch.Tensor with at least one dim, got {_describe(x)}")
    if isinstance(axis, bool) or not isinstance(axis, int) or not -x.dim() <= axis < x.dim():
        raise ValueError(f"axis must be an int in [{-x.dim()}, {x.dim() - 1}] for shape {tuple(x.shape)}")
    for name, flag in (("stochastic", stochastic), ("pad", pad)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {flag!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    return axis % x.dim()


def _check_tensor_amax(tensor_amax: object, fmt: LowbitFormat) -> None:
    if not fmt.two_level:
        raise ValueError(f"tensor_amax is for two-level formats (nvfp4, nvfp4_2d); {fmt.name} has none")
    if not _one_number(tensor_amax) or not 0 < float(tensor_amax) < float("inf"):
        raise ValueError(f"tensor_amax must be one finite number > 0, got {tensor_amax!r}")


def _one_number(x: object) -> TypeGuard[int | float | torch.Tensor]:
    """A number (not a bool) or a one-element tensor: what float() reads as one value."""
    if isinstance(x, torch.Tensor):
        return x.numel() == 1
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _describe(x: object) -> str:
    return f"{x.dtype} of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__


def _as_matrix(x: torch.Tensor, axis: int) -> torch.Tensor:
    moved = x.movedim(axis, -1)
    return moved.reshape(-1, moved.shape[-1])


def _block_of(fmt: LowbitFormat, shape: torch.Size) -> tuple[int, int]:
    rows, cols = fmt.block
    return (shape[0] if rows == -1 else rows), (shape[1] if cols == -1 else cols)


def _pad(x2, rows, cols, pad, fmt, shape, axis) -> torch.Tensor:
    m, k = x2.shape
    cols = cols + cols % 2 if fmt.element == "e2m1" else cols  # two e2m1 codes per byte
    pad_m, pad_k = -m % rows, -k % cols
    if pad_m or pad_k:
        if not pad:
            raise ValueError(
                f"{fmt.name} needs the {m}x{k} matrix of shape {tuple(shape)} (axis {axis} last) to be a "
                f"multiple of its {rows}x{cols} block; pass pad=True to zero-pad it"
            )
        x2 = torch.nn.functional.pad(x2, (0, pad_k, 0, pad_m))
    return x2.contiguous()


def _scale(x2, amax, fmt, rows, cols, tensor_scale, unsaturated) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x2 scaled into the element range, the stored scale)``.

    With ``unsaturated`` (stochastic rounding), each block whose amax the nearest scale puts above
    ``elem.max`` takes the next coarser scale instead, so no value is clamped: a clamp has no round-up to
    balance it under stochastic rounding and would shrink each block's largest value on average.
    """
    mb, kb = amax.shape
    blocks = x2.reshape(mb, rows, kb, cols)
    scale = _nearest_scale(amax, fmt, tensor_scale)
    factor, divide = _factor(scale, fmt, tensor_scale)
    if unsaturated:
        top = amax / factor if divide else amax * factor  # the block's largest value, scaled as the others
        over = (top > fmt.elem.max) & torch.isfinite(amax)
        scale = block_scales.coarser_scale(scale, fmt.scale, over)
        factor, divide = _factor(scale, fmt, tensor_scale)
    factor = factor[:, None, :, None]
    scaled = (blocks / factor if divide else blocks * factor).reshape(x2.shape)
    return scaled, (scale.view(torch.float8_e8m0fnu) if fmt.scale == "e8m0" else scale)


def _nearest_scale(amax, fmt, tensor_scale) -> torch.Tensor:
    """The per-block scale torchao's references store: fp32 multipliers, uint8 exponents, e4m3 descales."""
    if fmt.scale in ("fp32", "pow2"):
        return block_scales.fp32_scale(amax, fmt.elem, fmt.scale == "pow2")
    if fmt.scale == "e8m0":
        return block_scales.e8m0_exponent(amax, fmt.elem, fmt.rule)
    return block_scales.e4m3_descale(amax, tensor_scale)


def _factor(scale, fmt, tensor_scale) -> tuple[torch.Tensor, bool]:
    """``(factor, divide)``: the scaled values are ``x / factor`` if ``divide`` else ``x * factor``."""
    if fmt.scale in ("fp32", "pow2"):
        return scale, False
    if fmt.scale == "e8m0":
        return block_scales.e8m0_quantize_factor(scale, fmt.rule)
    d32 = scale.to(torch.float32)
    return (1.0 / d32 if tensor_scale is None else (1.0 / tensor_scale) / d32), False


def _store(scaled: torch.Tensor, fmt: LowbitFormat) -> torch.Tensor:
    if fmt.element != "e2m1":
        return scaled.to(fmt.elem.dtype)
    mag = round_to_element(scaled, fmt.elem).abs()
    code = torch.where(mag < 2, mag * 2, torch.where(mag < 4, mag + 2, mag / 2 + 4))
    code = torch.where(torch.isnan(mag), 7.0, code).to(torch.uint8) | (
        torch.signbit(scaled).to(torch.uint8) << 3
    )
    return code[:, 0::2] | (code[:, 1::2] << 4)


def round_to_element(
    v: torch.Tensor,
    elem: formats.Format,
    *,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``v`` (float32, already within ``±elem.max``) rounded onto ``elem``'s grid, as float32.

    Nearest-even (``torch.round`` of ``|v| / ulp``) or stochastic (see the module doc). The ulp of ``|v|``
    is ``2**(max(floor(log2|v|), 1 - bias) - mantissa_bits)``, the subnormal spacing below the normals
    (float32 subnormal inputs are far below every element format's grid and take its smallest ulp).
    """
    mag = v.abs().to(torch.float32)
    # The ulp from the float32 exponent bits: 2**(max(e, 1 - bias) - mantissa_bits), exact and cheap.
    exp = torch.clamp((torch.bitwise_right_shift(mag.view(torch.int32), 23) & 0xFF) - 127, min=1 - elem.bias)
    ulp = torch.bitwise_left_shift(exp - elem.mantissa_bits + 127, 23).view(torch.float32)
    if stochastic:
        noise = uniform_noise(mag, generator)
        ulp64 = ulp.to(torch.float64)
        q = torch.floor(mag.to(torch.float64) / ulp64 + noise) * ulp64
    else:
        q = torch.round(mag / ulp) * ulp
    return torch.clamp(q, max=elem.max).to(torch.float32).copysign(v)


def uniform_noise(like: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """float64 ``U[0, 1)`` of ``like``'s shape on its device, ``torch.rand`` from ``generator`` (None: torch's
    global generator).

    Under ``torch.compile`` an explicit generator is drawn from through the custom op
    ``mixprec::uniform_from_generator`` (Dynamo cannot put a ``torch.Generator`` into a graph), which finds
    it by id among those :func:`hold_generator` keeps: the same ``torch.rand`` call on the same generator,
    so a compiled step draws the numbers an eager one draws.
    """
    if generator is not None and torch.compiler.is_compiling():
        return torch.ops.mixprec.uniform_from_generator(like, id(generator))
    if generator is not None:
        hold_generator(generator)  # an eager draw makes the generator reachable for a compiled one
    return torch.rand(like.shape, dtype=torch.float64, device=like.device, generator=generator)


class _HeldGenerators:
    """The generators compiled graphs draw from, each an attribute named by its id (see hold_generator)."""


_HELD = _HeldGenerators()


def hold_generator(generator: torch.Generator | None) -> None:
    """Keep ``generator`` where a compiled graph's :func:`uniform_noise` finds it by ``id`` (None: nothing).

    :class:`~mixprec.lowbit.LowbitLinear` and :class:`~mixprec.lowbit.LowbitConv1D` call it in forward, so
    a compiled forward replays it before its backward draws; call it before a compiled function that
    draws stochastic rounding from ``generator`` by itself. The generator is kept for the life of the
    process (a held id is never reused by another object), as an attribute store, which Dynamo replays
    without guarding on how many generators are held (a dict store would recompile every compiled layer
    whenever another generator is held).
    """
    if generator is not None:
        setattr(_HELD, f"g{id(generator)}", generator)


@torch.library.custom_op(
    "mixprec::uniform_from_generator", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,)
)
def _uniform_from_generator(like: torch.Tensor, generator_id: int) -> torch.Tensor:
    generator = getattr(_HELD, f"g{generator_id}", None)
    if generator is None:
        raise RuntimeError(
            f"a compiled stochastic rounding draws from generator id {generator_id}, which "
            "mixprec.lowbit.quantize.hold_generator has not been given; call it with that generator before "
            "the compiled call (LowbitLinear and LowbitConv1D do it in forward)"
        )
    return torch.rand(like.shape, dtype=torch.float64, device=like.device, generator=generator)


@_uniform_from_generator.register_fake
def _(like: torch.Tensor, generator_id: int) -> torch.Tensor:
    return like.new_empty(like.shape, dtype=torch.float64)
