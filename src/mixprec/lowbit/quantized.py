"""The :class:`Quantized` value: a tensor in a block-scaled low-bit format, with its scales.

Its own module so that the quantizers that make one (:mod:`mixprec.lowbit.quantize`'s pure-torch path and
:mod:`mixprec.lowbit.triton_quantize`'s fused kernels) both import it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mixprec.lowbit import block_scales
from mixprec.lowbit.formats import LowbitFormat

__all__ = ["Quantized", "e2m1_values"]


def e2m1_values(device: torch.device | str) -> torch.Tensor:
    """float32 (16,): the value of each e2m1 code 0..15 (sign bit 3; magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6).

    Built on ``device`` from ``torch.arange`` with integer ops on the float32 bits, so there is no
    host-to-device copy (none per fp4 dequantize, and CUDA-graph capture is not blocked) and no cache:
    exponent field ``e = (c >> 1) & 3`` and mantissa bit ``m = c & 1`` give ``2**(e - 1) * (1 + m / 2)``
    for ``e > 0`` and ``m / 2`` for ``e == 0``; code 8 is -0.0.
    """
    c = torch.arange(16, dtype=torch.int32, device=device)
    exp, mant = (c >> 1) & 3, c & 1
    normal = torch.bitwise_left_shift(exp + 126, 23) | torch.bitwise_left_shift(mant, 22)
    magnitude = torch.where(exp > 0, normal, mant * 0x3F000000)  # 0x3F000000: the bits of 0.5
    return (magnitude | torch.bitwise_left_shift(c & 8, 28)).view(torch.float32)


@dataclass(frozen=True, eq=False)
class Quantized:
    """A tensor in a block-scaled format.

    Attributes:
        data: (M, Kp) float8 values, or (M, Kp // 2) uint8 holding two e2m1 codes each, where M is the
            product of the dims other than ``axis`` (padded to the block) and Kp the ``axis`` size (padded).
        scale: one per block, (M // rows, Kp // cols): float32 multipliers (fp32/pow2: ``x ~ data / scale``),
            ``torch.float8_e8m0fnu`` exponents (e8m0: ``x ~ data * 2**(e-127)``) or float8_e4m3fn descales
            (e4m3: ``x ~ data * scale * tensor_scale``).
        tensor_scale: NVFP4's float32 per-tensor scale (a 0-dim tensor), or None.
        fmt: the :class:`LowbitFormat`; shape, dtype: the original tensor's; axis: the quantized axis.
        descale: ``scale``'s float32 reciprocal (its shape) where the quantizer computed it with the
            scale (the fused per-tensor casts), which :meth:`block_descale` then returns instead of
            computing it again for each GEMM; None otherwise.
    """

    data: torch.Tensor
    scale: torch.Tensor
    tensor_scale: torch.Tensor | None
    fmt: LowbitFormat
    shape: torch.Size
    dtype: torch.dtype
    axis: int
    descale: torch.Tensor | None = None

    def values(self) -> torch.Tensor:
        """The stored element values as float32 (M, Kp), before the scales."""
        if self.fmt.element != "e2m1":
            return self.data.to(torch.float32)
        lut = e2m1_values(self.data.device)
        codes = torch.stack([self.data & 0xF, self.data >> 4], dim=-1).reshape(self.data.shape[0], -1)
        return lut[codes.to(torch.long)]

    def block_descale(self) -> torch.Tensor:
        """float32 (M // rows, Kp // cols): the factor a block's stored values are multiplied by."""
        if self.fmt.scale in ("fp32", "pow2"):
            return self.scale.reciprocal() if self.descale is None else self.descale
        if self.fmt.scale == "e8m0":
            return block_scales.e8m0_to_float(self.scale.view(torch.uint8))
        scale = self.scale.to(torch.float32)
        return scale if self.tensor_scale is None else self.tensor_scale * scale

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The tensor the stored values stand for, in the original shape, as ``dtype``.

        Computed in float32 as torchao's references do (``data / scale`` for float32 multipliers,
        ``data * descale`` otherwise), then cast to ``dtype``.
        """
        values = self.values()
        mb, kb = self.scale.shape
        blocks = values.reshape(mb, values.shape[0] // mb, kb, values.shape[1] // kb)
        if self.fmt.scale in ("fp32", "pow2"):
            out = blocks / self.scale[:, None, :, None]
        else:
            out = blocks * self.block_descale()[:, None, :, None]
        moved = _moved_shape(self.shape, self.axis)
        m, k = moved[:-1].numel(), moved[-1]
        out = out.reshape(values.shape)[:m, :k].reshape(moved)
        return out.movedim(-1, self.axis).to(dtype)


def _moved_shape(shape: torch.Size, axis: int) -> torch.Size:
    dims = list(shape)
    dims.append(dims.pop(axis))
    return torch.Size(dims)
