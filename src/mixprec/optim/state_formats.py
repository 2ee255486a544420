"""Low-bit formats for Adam's moments: how ``exp_avg`` and ``exp_avg_sq`` are stored between steps.

``state_format=`` on :class:`~mixprec.optim.compensated.CompensatedOptimizer` and
:class:`~mixprec.optim.masters.MixedPrecisionOptimizer` picks one; each moment is kept in the torch
optimizer's ``state`` under torch's key (the codes, shaped as the parameter) plus a ``<key>_scale`` tensor
of one fp32 scale per block of ``BLOCK`` consecutive values of the flattened parameter (the last block may
be shorter)::

    "bf16":  code = bf16(x)                                       2 + 2 bytes per parameter, no scales
    "int8":  s = absmax(block);  code = nearest(qmap, x / s)       1 + 1 bytes (+ 8 / BLOCK for the scales)
             qmap: bitsandbytes' dynamic tree map (signed for exp_avg, unsigned for exp_avg_sq), as
             torchao's AdamW8bit (Dettmers et al. 2022, "8-bit Optimizers via Block-wise Quantization")
    "fp8":   exp_avg:     s = absmax(block) / 448;  code = e4m3(x / s)
             exp_avg_sq:  r = sqrt(x);  s = absmax_r(block) / 448;  code = e4m3(r / s);  x = (code * s)**2

Storing the second moment in square-root space halves its exponent range, so a block whose values span
1e10 (e4m3 alone spans about 2e5 from its largest value to its smallest subnormal) keeps its small values
instead of flushing them to 0, where ``m / (sqrt(0) + eps)`` would blow the update up (the concern COAT,
arXiv 2410.19313, answers with dynamic range expansion; the square root is the simpler expansion ``x**0.5``).

Quantization rounds to nearest, so a state is a deterministic function of the step's inputs and a resumed
run repeats an uninterrupted one bit for bit. The functions work on flat segments that start at a block
boundary of their tensor (a chunk of ``mixprec.optim.fused_adam``), so no full-precision copy of a
whole moment exists.

What the one Adam step engine (:func:`mixprec.optim.fused_adam.adam_step`) reads of a format is data: a
:class:`TorchMoments` (torch's layout, the moments as tensors in bf16 or fp32, what ``CompensatedOptimizer``
keeps without ``state_format``) or a :class:`CodedMoments` (one of ``STATE_FORMATS`` on the block grid)
says where a tensor may be cut (``align``), whether the engine keeps its chunk views between steps
(``cached``), which moment the kernel steps where it lies (``in_place``), and how a chunk's moments are
made, decoded into fp32 and encoded back.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from mixprec.optim.rounding import ALIGN

__all__ = [
    "BLOCK",
    "ORIGINS",
    "STATE_FORMATS",
    "CodedMoments",
    "TorchMoments",
    "block_count",
    "check_origins",
    "code_tables",
    "dequantize_",
    "dynamic_map",
    "keep_moment_dtypes",
    "new_moments",
    "pieces",
    "quantize_",
    "scale_key",
    "state_nbytes",
]

STATE_FORMATS = ("bf16", "int8", "fp8")
BLOCK = 256  # values per scale, as torchao's and bitsandbytes' 8-bit optimizers
MOMENTS = ("exp_avg", "exp_avg_sq")
ORIGINS = "block_origins"  # a state key, present only where the grid restarts inside a tensor
_E4M3 = torch.float8_e4m3fn
_E4M3_MAX = torch.finfo(_E4M3).max
_TINY = 1e-12  # the smallest block absmax, as torchao: an all-zero block gets a finite scale
_CODE_DTYPES = {"bf16": torch.bfloat16, "int8": torch.uint8, "fp8": _E4M3}


def scale_key(key: str) -> str:
    return f"{key}_scale"


def dynamic_map(signed: bool) -> list[float]:
    """bitsandbytes' dynamic quantization map with 7 exponent bits, 256 sorted values in [-1, 1] (signed)
    or [0, 1]: a decimal exponent 10**-6 .. 10**0 and a linear fraction whose bits shrink as it grows
    (Dettmers 2016, arXiv 1511.04561; the map torchao's ``create_dynamic_map`` builds)."""
    data: list[float] = []
    exponents, non_sign_bits = 7, 7
    for i in range(exponents):
        items = 2 ** (i + non_sign_bits - exponents + (0 if signed else 1)) + 1
        bounds = torch.linspace(0.1, 1, items)
        means = ((bounds[:-1] + bounds[1:]) / 2.0) * 10 ** (-(exponents - 1) + i)
        data += means.tolist() + ((-means).tolist() if signed else [])
    data += [0.0, 1.0]
    return sorted(data)


def _map(signed: bool, device: torch.device, tables: dict[Any, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The map and the midpoints between its neighbours (fp32, on ``device``), made once per ``tables``
    (the caller's cache, e.g. a :class:`~mixprec.optim.rounding.Workspace`'s: nothing shared process-wide)."""
    key = ("qmap", signed, str(device))
    if key not in tables:
        qmap = torch.tensor(dynamic_map(signed), dtype=torch.float32).to(device)
        tables[key] = qmap, qmap[:-1] + (qmap[1:] - qmap[:-1]) * 0.5
    return tables[key]


def code_tables(
    fmt: str, second: bool, device: torch.device, tables: dict[Any, Any]
) -> tuple[torch.Tensor, torch.Tensor]:
    """What a kernel needs to decode and encode a moment in ``fmt`` (``"int8"`` or ``"fp8"``; ``second``:
    ``exp_avg_sq``): the fp32 value of each of the 256 codes, and the 255 midpoints between neighbouring
    int8 map values that :func:`quantize_` rounds at (fp8: the value table again, unused), on ``device``,
    made once per ``tables`` (the tensors :func:`quantize_` and :func:`dequantize_` use)."""
    if fmt == "int8":
        return _map(not second, device, tables)
    key = ("e4m3", str(device))
    if key not in tables:
        tables[key] = torch.arange(256, dtype=torch.uint8).view(_E4M3).float().to(device)
    return tables[key], tables[key]


def pieces(numel: int, origins: list[int] | None) -> list[tuple[int, int, int]]:
    """``(start, stop, first block)`` of each run of the block grid: blocks of ``BLOCK`` restart at every
    origin (default ``[0]``). A state resharded from several ranks keeps each shard's grid this way
    (``mixprec.optim.sharding``), so its blocks, and so its codes, are those the shards had."""
    starts = [0] if not origins else list(origins)
    out, block = [], 0
    for start, stop in zip(starts, [*starts[1:], numel], strict=True):
        out.append((start, stop, block))
        block += -(-(stop - start) // BLOCK)
    return out


def block_count(numel: int, origins: list[int] | None = None) -> int:
    """Scales a moment of ``numel`` values holds on the grid of ``origins``."""
    return sum(-(-(stop - start) // BLOCK) for start, stop, _ in pieces(numel, origins))


def check_origins(value: Any, numel: int) -> list[int]:
    """The origins a state's ``block_origins`` holds: a 1-D int64 tensor starting at 0, increasing, below
    ``numel``.

    Raises:
        ValueError: naming the value when it is anything else.
    """
    ok = torch.is_tensor(value) and value.dtype == torch.int64 and value.dim() == 1 and value.numel() > 0
    origins = value.tolist() if ok else []
    if (
        not ok
        or origins[0] != 0
        or any(b <= a for a, b in itertools.pairwise(origins))
        or origins[-1] >= max(numel, 1)
    ):
        raise ValueError(
            f"block_origins must be a 1-D int64 tensor [0, ...] increasing and below the parameter's {numel} "
            f"values, got {value!r:.120}"
        )
    return origins


def new_moments(fmt: str, param: torch.Tensor) -> dict[str, torch.Tensor]:
    """Zero ``exp_avg``/``exp_avg_sq`` codes (shaped as ``param``) and their block scales."""
    out: dict[str, torch.Tensor] = {}
    blocks = -(-param.numel() // BLOCK)
    for key in MOMENTS:
        out[key] = torch.zeros(param.shape, dtype=_CODE_DTYPES[fmt], device=param.device)
        if fmt != "bf16":
            out[scale_key(key)] = torch.zeros(blocks, dtype=torch.float32, device=param.device)
    return out


def expected_layout(
    fmt: str | None, param: torch.Tensor, origins: list[int] | None = None
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """What a moment state of ``param`` (its local shard, under FSDP2) holds in ``fmt`` on the block grid
    of ``origins``: key -> (shape, dtype); {} for None (torch's)."""
    if fmt is None:
        return {}
    blocks = block_count(param.numel(), origins)
    out = {key: (tuple(param.shape), _CODE_DTYPES[fmt]) for key in MOMENTS}
    if fmt != "bf16":
        out.update({scale_key(key): ((blocks,), torch.float32) for key in MOMENTS})
    return out


def _blocks(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``flat`` as (full blocks, BLOCK) and its tail (possibly empty)."""
    full = flat.numel() // BLOCK * BLOCK
    return flat[:full].view(-1, BLOCK), flat[full:]


def _absmax(values: torch.Tensor) -> torch.Tensor:
    """Per-block absmax of the flat ``values`` (clipped below at ``_TINY``), one per block."""
    body, tail = _blocks(values)
    amax = body.abs().amax(-1)
    if tail.numel():
        amax = torch.cat([amax, tail.abs().amax().reshape(1)])
    return amax.clamp_(min=_TINY)


def _scale_blocks_(values: torch.Tensor, scale: torch.Tensor, divide: bool) -> None:
    """Multiply (or divide) each block of the flat ``values`` by its scale, in place."""
    body, tail = _blocks(values)
    n = body.shape[0]
    op = body.div_ if divide else body.mul_
    op(scale[:n, None])
    if tail.numel():
        (tail.div_ if divide else tail.mul_)(scale[n])


def quantize_(
    fmt: str,
    second: bool,
    values: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor | None,
    tables: dict[Any, Any] | None = None,
) -> None:
    """Store the fp32 flat ``values`` (a segment starting at a block boundary) into ``codes`` and the
    matching ``scale`` slice; ``values`` is used as workspace. ``second``: it is ``exp_avg_sq``;
    ``tables``: where the int8 map is cached per device (None: made for this call)."""
    if fmt == "bf16":
        codes.copy_(values)
        return
    assert scale is not None
    if fmt == "fp8" and second:
        values.sqrt_()  # square-root space: see the module docstring
    amax = _absmax(values)
    scale.copy_(_fp8_scale(amax) if fmt == "fp8" else amax)
    _scale_blocks_(values, scale, divide=True)
    if fmt == "fp8":
        codes.copy_(values)
        return
    _, mids = _map(not second, values.device, {} if tables is None else tables)
    codes.copy_(torch.bucketize(values, mids, right=True))  # nearest map entry; a tie rounds up


def _fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    """``amax / 448`` as torch computes it on ``amax``'s device (a CUDA tensor divided by a Python number is
    multiplied by the number's fp32 reciprocal, a CPU one divided): what the fp8 Triton kernel copies."""
    return amax / _E4M3_MAX


def dequantize_(
    fmt: str,
    second: bool,
    codes: torch.Tensor,
    scale: torch.Tensor | None,
    out: torch.Tensor,
    tables: dict[Any, Any] | None = None,
) -> None:
    """The fp32 values of the flat ``codes`` segment (and its ``scale`` slice), written into ``out``."""
    if fmt == "bf16":
        out.copy_(codes)
        return
    assert scale is not None
    if fmt == "fp8":
        out.copy_(codes)
    else:
        qmap, _ = _map(not second, codes.device, {} if tables is None else tables)
        torch.index_select(qmap, 0, codes.int(), out=out)
    _scale_blocks_(out, scale, divide=False)
    if fmt == "fp8" and second:
        out.square_()


def keep_moment_dtypes(states: list[dict[str, Any]], dtypes: tuple[torch.dtype, ...]) -> None:
    """Cast ``exp_avg`` / ``exp_avg_sq`` held in another dtype (a state loaded from elsewhere) to the dtypes
    this path keeps them in, so the run continues in those."""
    for state in states:
        for key, dtype in zip(MOMENTS, dtypes, strict=True):
            if key in state and state[key].dtype != dtype:
                state[key] = state[key].to(dtype)


@dataclass(frozen=True)
class TorchMoments:
    """Adam's moments in torch's layout: ``exp_avg`` and ``exp_avg_sq`` shaped as the param, in ``dtypes``
    (``updates.moment_dtypes``: bf16 where the average can move in bf16, else fp32), no scales.

    A tensor may be cut every ``ALIGN`` values; the chunk views are kept between steps; an fp32 moment is
    stepped where it lies, a bf16 one through an fp32 copy.
    """

    dtypes: tuple[torch.dtype, ...]
    align: ClassVar[int] = ALIGN
    cached: ClassVar[bool] = True

    @property
    def second_dtype(self) -> torch.dtype:
        """The dtype whose range bounds ``exp_avg_sq`` (the guard's limit)."""
        return self.dtypes[1]

    def new(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        return {
            key: torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format)
            for key, dtype in zip(MOMENTS, self.dtypes, strict=True)
        }

    def keep(self, states: list[dict[str, Any]]) -> None:
        keep_moment_dtypes(states, self.dtypes)

    def runs(self, numel: int, state: dict[str, Any]) -> list[tuple[int, int, int]]:
        return [(0, numel, 0)]

    def in_place(self, second: bool) -> bool:
        return self.dtypes[int(second)] == torch.float32

    def view(self, state: dict[str, Any], key: str, start: int, stop: int, block: int):
        return state[key].view(-1)[start:stop], None

    def decode(self, second: bool, codes, scales, out: list[torch.Tensor], tables: dict[Any, Any]) -> None:
        torch._foreach_copy_(out, codes)

    def encode(self, second: bool, values: list[torch.Tensor], codes, scales, tables: dict[Any, Any]) -> None:
        torch._foreach_copy_(codes, values)


@dataclass(frozen=True)
class CodedMoments:
    """Adam's moments in the state format ``fmt`` (one of ``STATE_FORMATS``): codes shaped as the param and
    one scale per block of a grid that survives resharding (:func:`pieces`).

    A tensor is cut only at its blocks' boundaries (``align = BLOCK``); the chunk views are made each step
    (the grid is read from the state); both moments are decoded into fp32 and encoded back, block by block.
    """

    fmt: str
    align: ClassVar[int] = BLOCK
    cached: ClassVar[bool] = False
    second_dtype: ClassVar[torch.dtype] = torch.float32  # the step's fp32 copy and the fp32 scales

    def new(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        return new_moments(self.fmt, param)  # one block grid, from the start

    def keep(self, states: list[dict[str, Any]]) -> None:
        del states  # a loaded state's layout is checked at load (``state.check_saved_format``)

    def runs(self, numel: int, state: dict[str, Any]) -> list[tuple[int, int, int]]:
        origins = state.get(ORIGINS)
        return pieces(numel, None if origins is None else origins.tolist())

    def in_place(self, second: bool) -> bool:
        return False

    def view(self, state: dict[str, Any], key: str, start: int, stop: int, block: int):
        """The flat codes of ``state[key]`` from ``start`` to ``stop`` (one run of the grid, from its block
        ``block``) and the scales of their blocks."""
        codes = state[key].view(-1)[start:stop]
        if self.fmt == "bf16":
            return codes, None
        return codes, state[scale_key(key)][block : block + -(-(stop - start) // BLOCK)]

    def decode(self, second: bool, codes, scales, out: list[torch.Tensor], tables: dict[Any, Any]) -> None:
        for code, scale, values in zip(codes, scales, out, strict=True):
            dequantize_(self.fmt, second, code, scale, values, tables)

    def encode(self, second: bool, values: list[torch.Tensor], codes, scales, tables: dict[Any, Any]) -> None:
        for value, code, scale in zip(values, codes, scales, strict=True):
            quantize_(self.fmt, second, value, code, scale, tables)


def state_nbytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in ``optimizer.state`` (moments, scales, step counters)."""
    return sum(
        v.numel() * v.element_size()
        for s in optimizer.state.values()
        for v in s.values()
        if torch.is_tensor(v)
    )
