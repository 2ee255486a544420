"""Saved activations in a low-bit format: the tensors autograd keeps for backward, quantized while they wait.

``with save_activations("fp8"):`` installs ``torch.autograd.graph.saved_tensors_hooks`` around the forward::

    pack(t):   if t is a plain strided fp32 / fp16 / bf16 tensor with numel >= min_numel, and neither a
                   parameter (an nn.Parameter, a view of one, or a leaf that requires grad) nor a
                   parameter or buffer of ``module`` (by storage): the owner holds those anyway, so a
                   quantized copy would add memory, not save it:
                   return quantize(t, fmt, axis=-1) (+ t's shape, strides, dtype)
               else: return t unchanged
    unpack(p): p.dequantize(t's dtype), laid out with t's strides; or the unchanged tensor

The encodings come from :func:`mixprec.lowbit.quantize`:

* ``"fp8"``: e4m3 with one float32 scale per row of the last dimension (``fp8_rowwise_fp32``): a row
  (one token's features) with an outlier does not crush every other row's values into e4m3's subnormals,
  as one per-tensor scale would; the cost is 4 bytes per row.
* ``"mxfp8"``: e4m3 in 32-value blocks along the last dimension with an e8m0 exponent each (OCP MX),
  rounded up as the ``"mxfp8"`` recipe rounds (``mxfp8_rceil``), so no block's largest value saturates;
  the last dimension zero-padded to a multiple of 32.

Composition: around a ``torch.utils.checkpoint`` (or :func:`mixprec.checkpoint`) call, the checkpointed
part saves only its inputs and is recomputed in full precision; the rest is quantized. Inside a
checkpointed function the hooks take over from checkpoint's own (torch's innermost hooks win), so that part
is quantized, not recomputed. Around a ``torch.compile``'d module the compiled graph's saved tensors go
through the hooks like any others; entering ``save_activations`` inside a compiled function is refused
(dynamo cannot trace the hooks' Python).

Non-finite values are not preserved: an inf makes its row (fp8) or block (mxfp8) nan, so the backward is
non-finite and a loss scaler skips the step, as it would have without the hook.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mixprec.lowbit.formats import LowbitFormat, get_format
from mixprec.lowbit.quantize import Quantized, quantize

__all__ = ["ACTIVATION_FORMATS", "MIN_NUMEL", "save_activations"]

#: Accepted names -> the lowbit format each one stores in.
ACTIVATION_FORMATS: dict[str, str] = {"fp8": "fp8_rowwise_fp32", "mxfp8": "mxfp8_rceil"}
#: Tensors with fewer elements stay as they are: the scales and bookkeeping would eat what they save.
MIN_NUMEL = 1024
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True, eq=False)
class _Packed:
    q: Quantized
    size: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype


class save_activations:  # lower case: a context manager, spelled like torch's saved_tensors_hooks
    """Keep the tensors autograd saves for backward in ``fmt`` while the block runs (see the module doc).

    Example::

        with mixprec.lowbit.save_activations("fp8") as saved:
            loss = model(x).square().mean()
        loss.backward()                       # dequantized here, to each tensor's dtype and shape
        saved.packed_bytes, saved.original_bytes

    Nesting is allowed (the innermost format applies, as torch's hooks do), and an instance may be entered
    again once it has exited; the counters then keep adding up.

    Args:
        fmt: ``"fp8"`` or ``"mxfp8"``.
        min_numel: tensors with fewer elements are kept as they are (default ``MIN_NUMEL``, 1024).
        module: a module whose parameters and buffers (matched by storage) are kept as they are; without
            it only parameters are recognised, and a buffer saved for backward (a rotary cos/sin table)
            is quantized.

    Attributes:
        quantized, kept: how many saved tensors were quantized / kept as they are.
        original_bytes: the bytes the quantized tensors had; packed_bytes: what their quantized form
            holds (data and scales); kept_bytes: the bytes of the tensors kept as they are (a parameter
            saved twice counts twice).

    Raises:
        ValueError: for another ``fmt`` or a ``min_numel`` that is not an int >= 1, or on entering an
            instance that is already active.
        TypeError: for a ``module`` that is not an ``nn.Module``.
        RuntimeError: on entering it inside a function ``torch.compile`` is tracing.
    """

    def __init__(
        self, fmt: str = "fp8", *, min_numel: int = MIN_NUMEL, module: torch.nn.Module | None = None
    ) -> None:
        if not isinstance(fmt, str) or fmt not in ACTIVATION_FORMATS:
            raise ValueError(
                f"saved activation format must be one of {sorted(ACTIVATION_FORMATS)}, got {fmt!r}"
            )
        if isinstance(min_numel, bool) or not isinstance(min_numel, int) or min_numel < 1:
            raise ValueError(f"min_numel must be an int >= 1, got {min_numel!r}")
        if module is not None and not isinstance(module, torch.nn.Module):
            raise TypeError(f"module must be an nn.Module or None, got {type(module).__name__}")
        self.module = module
        self.fmt = fmt
        self.min_numel = min_numel
        self.lowbit_format: LowbitFormat = get_format(ACTIVATION_FORMATS[fmt])
        self.quantized = 0
        self.kept = 0
        self.original_bytes = 0
        self.packed_bytes = 0
        self.kept_bytes = 0
        self._hooks: Any = None
        self._owned: frozenset[int] = frozenset()

    def __enter__(self) -> save_activations:
        if torch.compiler.is_compiling():
            raise RuntimeError(
                "save_activations cannot be entered inside a function torch.compile traces; enter it around "
                "the call of the compiled module instead (its saved tensors then go through the hooks)"
            )
        if self._hooks is not None:
            raise ValueError("this save_activations is already active; use a new instance to nest")
        if self.module is not None:  # read at entry: a .to() between uses moves the storages
            owned = [*self.module.parameters(), *self.module.buffers()]
            self._owned = frozenset(t.untyped_storage().data_ptr() for t in owned)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        hooks, self._hooks = self._hooks, None
        hooks.__exit__(*exc)

    def _pack(self, t: torch.Tensor) -> torch.Tensor | _Packed:
        if not self._quantizes(t):
            self.kept += 1
            self.kept_bytes += t.numel() * t.element_size()
            return t
        q = quantize(t.detach(), self.lowbit_format, axis=-1, pad=True)
        self.quantized += 1
        self.original_bytes += t.numel() * t.element_size()
        self.packed_bytes += _nbytes(q)
        return _Packed(q, t.shape, t.stride(), t.dtype)

    def _quantizes(self, t: torch.Tensor) -> bool:
        if type(t) is not torch.Tensor or t.layout != torch.strided or t.dtype not in _DTYPES:
            return False  # parameters, subclasses (DTensor, fake tensors), sparse and integer tensors
        if t.dim() == 0 or t.numel() < self.min_numel:
            return False
        root = t._base if t._base is not None else t
        if isinstance(root, torch.nn.Parameter) or (root.is_leaf and root.requires_grad):
            return False
        return not self._owned or t.untyped_storage().data_ptr() not in self._owned

    def __repr__(self) -> str:
        return f"save_activations({self.fmt!r}, min_numel={self.min_numel})"


def _nbytes(q: Quantized) -> int:
    parts = [q.data, q.scale] + ([] if q.tensor_scale is None else [q.tensor_scale])
    return sum(p.numel() * p.element_size() for p in parts)


def _unpack(packed: torch.Tensor | _Packed) -> torch.Tensor:
    if not isinstance(packed, _Packed):
        return packed
    dense = packed.q.dequantize(packed.dtype)
    if dense.stride() == packed.stride:
        return dense
    # Backward formulas may rely on the saved layout (a transposed view in attention), so restore it.
    out = torch.empty_strided(packed.size, packed.stride, dtype=packed.dtype, device=dense.device)
    return out.copy_(dense)
