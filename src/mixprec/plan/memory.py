"""The training memory a plan needs, by component, and the state/activation formats that fit a bound.

Per parameter tensor ``p`` of the model and per planned linear layer (``K`` inputs, ``M`` rows per step)::

    weights       = bytes(p)                         (+ 4 numel(p) for an fp32 master, optimizer="masters")
    gradients     = bytes(p)                         (the model's .grad; masters' fp32 gradients live during
                                                      step() only, mixprec.MixedPrecisionOptimizer)
    optimizer     = Adam's two moments in the state format + a 4-byte fp32 step counter per tensor
                    (+ one Kahan buffer of bytes(p) for a low-precision p, optimizer="kahan")
    activations   = the layer's GEMM input saved for the weight gradient, an (M, K) tensor in the
                    layer's dtype, or its quantized form for "fp8" / "mxfp8"

The moment bytes are those :func:`mixprec.optim.state_formats.new_moments` allocates (codes and block
scales); the fp32 moments of ``state_format=None`` are torch Adam's own. The activation bytes are those of
:func:`mixprec.lowbit.quantize` with the layout :class:`mixprec.lowbit.save_activations` stores (fp8 rows
with one fp32 scale each, or mxfp8 in 32-blocks padded along K); tensors under its ``MIN_NUMEL`` stay as
they are. Everything is computed on meta tensors, so nothing is allocated, at any ``M``.

Only the planned linears' inputs are counted as activations: the tensors other operations save (a
nonlinearity's output, attention's scores) depend on the model's code, which the planner does not see.

The GEMM format of a layer does not change any of these (a :class:`~mixprec.lowbit.LowbitLinear` keeps its
weight and saves its input in their own precision), so the memory choice is independent of the GEMM one:
:func:`fit_memory` enumerates every (state format, activation format) pair and returns the one that keeps
the most bytes (quantizes the least) within the bound, exactly. The state format is one for the whole
model because the optimizers take ``state_format=`` per optimizer, not per parameter group; the activation
format is one for the whole forward because a tensor that a linear saves is often also saved by the
operation before it (a ReLU's output): quantizing it in the linear alone would add a copy, not save one.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mixprec.lowbit.activations import ACTIVATION_FORMATS, MIN_NUMEL
from mixprec.lowbit.formats import get_format
from mixprec.lowbit.quantize import quantize
from mixprec.optim.state_formats import STATE_FORMATS, new_moments

__all__ = [
    "COMPONENTS",
    "OPTIMIZERS",
    "MemoryModel",
    "activation_bytes",
    "fit_memory",
    "parse_bytes",
    "state_bytes",
]

#: How the model is stepped: Kahan-compensated or stochastically rounded low-precision weights
#: (:class:`mixprec.CompensatedOptimizer`), or fp32 masters (:class:`mixprec.MixedPrecisionOptimizer`).
OPTIMIZERS = ("kahan", "stochastic", "masters")
COMPONENTS = ("weights", "gradients", "optimizer_state", "activations")
_LOW = (torch.bfloat16, torch.float16)
_STEP_BYTES = 4  # torch Adam's step counter: an fp32 scalar tensor per parameter
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: Any, name: str = "max_memory") -> int:
    """Bytes from an int (``2**31``) or a string with a unit (``"2GiB"``, ``"512MB"``, ``"1.5 GB"``).

    Raises:
        ValueError: for anything else or a value <= 0, naming the value and the accepted forms.
    """
    accepted = "an int number of bytes > 0 or a string like '2GiB', '512MB', '1.5 GB' (B, kB..TB, KiB..TiB)"
    if isinstance(value, bool):
        raise ValueError(f"{name} must be {accepted}, got {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"{name} must be {accepted}, got {value!r}")
        return value
    match = _SIZE.match(value) if isinstance(value, str) else None
    if match is None or match.group(2).lower() not in _UNITS:
        raise ValueError(f"{name} must be {accepted}, got {value!r}")
    out = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if out <= 0:
        raise ValueError(f"{name} must be {accepted}, got {value!r}")
    return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def state_bytes(fmt: str | None, param: torch.Tensor) -> int:
    """Adam's state for ``param`` in ``fmt`` (None: fp32 moments): both moments, their scales, the step."""
    meta = torch.empty(param.shape, dtype=param.dtype, device="meta")
    if fmt is None:
        return 2 * 4 * meta.numel() + _STEP_BYTES
    return sum(_nbytes(t) for t in new_moments(fmt, meta).values()) + _STEP_BYTES


def activation_bytes(fmt: str | None, rows: int, features: int, dtype: torch.dtype) -> int:
    """The saved ``(rows, features)`` GEMM input in ``fmt`` (None: as it is, in ``dtype``)."""
    meta = torch.empty(rows, features, dtype=dtype, device="meta")
    if fmt is None or meta.numel() < MIN_NUMEL:
        return _nbytes(meta)
    q = quantize(meta, get_format(ACTIVATION_FORMATS[fmt]), axis=-1, pad=True)
    return sum(_nbytes(t) for t in (q.data, q.scale, q.tensor_scale) if t is not None)


@dataclass(frozen=True)
class MemoryModel:
    """The bytes a model's training step holds, for any state and activation format (module doc).

    ``params``: (shape, dtype) of every trainable parameter; ``linears``: fqn -> (features K, dtype) of the
    planned layers' inputs; ``rows``: fqn -> the rows M of its input per step.
    """

    params: tuple[tuple[tuple[int, ...], torch.dtype], ...]
    linears: Mapping[str, tuple[int, torch.dtype]]
    rows: Mapping[str, int]
    optimizer: str = "kahan"

    @classmethod
    def of(cls, model: nn.Module, rows: Mapping[str, int], optimizer: str = "kahan") -> MemoryModel:
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
        modules = dict(model.named_modules())
        params = tuple((tuple(p.shape), p.dtype) for p in model.parameters() if p.requires_grad)
        linears = {f: (modules[f].in_features, modules[f].weight.dtype) for f in rows}
        return cls(params, linears, dict(rows), optimizer)

    def components(self, state_format: str | None, activation_format: str | None) -> dict[str, int]:
        """Bytes per component (``COMPONENTS``) and their ``total``."""
        weights = grads = state = 0
        for shape, dtype in self.params:
            meta = torch.empty(shape, dtype=dtype, device="meta")
            weights += _nbytes(meta)
            grads += _nbytes(meta)
            state += state_bytes(state_format, meta)
            if dtype in _LOW and self.optimizer == "masters":
                weights += 4 * meta.numel()
            if dtype in _LOW and self.optimizer == "kahan":
                state += _nbytes(meta)
        acts = sum(
            activation_bytes(activation_format, self.rows[f], k, dtype)
            for f, (k, dtype) in self.linears.items()
        )
        out = {"weights": weights, "gradients": grads, "optimizer_state": state, "activations": acts}
        out["total"] = sum(out.values())
        return out


def fit_memory(
    memory: MemoryModel,
    max_memory: int | None,
    state_formats: Sequence[str | None],
    activation_formats: Sequence[str | None],
    counted: str = "weights, gradients, optimizer state and the planned linears' saved inputs",
) -> tuple[str | None, str | None, list[dict[str, Any]]]:
    """The (state format, activation format) whose total fits ``max_memory`` with the most bytes kept
    (it quantizes the least; ties: the earlier-listed formats), and every pair's totals, as records.

    Without a bound: the first-listed of each. Exact: every pair is evaluated.

    Raises:
        ValueError: when no pair fits, naming the least memory these formats reach and with which pair.
    """
    options: list[dict[str, Any]] = []
    for i, s in enumerate(state_formats):
        for j, a in enumerate(activation_formats):
            total = memory.components(s, a)["total"]
            options.append({"state_format": s, "activation_format": a, "total": total, "order": (i, j)})
    if max_memory is None:
        chosen = options[0]
    else:
        fits = [o for o in options if o["total"] <= max_memory]
        if not fits:
            least = min(options, key=lambda o: o["total"])
            raise ValueError(
                f"max_memory={max_memory} bytes ({_mib(max_memory)}) is below the least memory these formats "
                f"reach: {least['total']} bytes ({_mib(least['total'])}) with state_format="
                f"{least['state_format']!r}"
                + (f" and activation_format={least['activation_format']!r}" if memory.linears else "")
                + f" ({counted})"
            )
        chosen = max(fits, key=lambda o: (o["total"], [-k for k in o["order"]]))
    records = [{k: v for k, v in o.items() if k != "order"} for o in options]
    return chosen["state_format"], chosen["activation_format"], records


def check_formats(
    state_formats: Iterable[Any], activation_formats: Iterable[Any]
) -> tuple[list[str | None], list[str | None]]:
    """The candidate lists, checked: non-empty, each a known format or None."""
    states, acts = list(state_formats), list(activation_formats)
    for name, values, known in (
        ("state_formats", states, STATE_FORMATS),
        ("activation_formats", acts, tuple(ACTIVATION_FORMATS)),
    ):
        bad = [v for v in values if v is not None and v not in known]
        if not values or bad:
            raise ValueError(
                f"{name} must be a non-empty list of None and {', '.join(map(repr, known))}; "
                f"got {values!r}" + (f" (unknown: {bad!r})" if bad else "")
            )
    return list(dict.fromkeys(states)), list(dict.fromkeys(acts))


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB" if math.isfinite(n) else str(n)
