"""Relative GEMM cost of a linear layer per format: the roofline of a named GPU, or timed here.

The roofline (targets, :func:`gemm_cost`) lives in :mod:`mixprec.lowbit.cost`, where
:func:`mixprec.lowbit.auto_filter` prices layers with it too: one cost model for the planner and the filter.
It prices each operand's quantization on the path the run takes (``quantize``: ``"fused"`` compiled,
``"triton"`` CUDA eager, ``"unfused"`` pure torch; :func:`mixprec.lowbit.cost.quantize_path`).

``"measured"`` times the three GEMMs instead, on the model's own device, as the planner would run them
(:class:`MeasuredCost`): the cost on this machine, low-bit formats that have no hardware path here
(every one on a CPU) included at their emulated speed. It is what ``cost=None`` uses on a CUDA model.
With ``compiled=True`` it times the layer under ``torch.compile`` (the path a compiled run takes, where
inductor fuses each operand's amax, scale and cast), kept apart from the eager figures.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from mixprec.formats import as_dtype
from mixprec.lowbit.cost import (
    TARGETS,
    CostFn,
    Target,
    format_class,
    gemm_cost,
    quantize_path,
    resolve_target,
)
from mixprec.plan.measure import swapped_in

__all__ = ["TARGETS", "CostFn", "MeasuredCost", "Target", "format_class", "gemm_cost", "resolve_cost"]

#: ``timer(fmt, (m, n, k), run) -> seconds``: the time of one call of ``run`` (the layer's forward and
#: backward in ``fmt``); injectable so that tests can script the times.
Timer = Callable[[str, tuple[int, int, int], Callable[[], object]], float]


class MeasuredCost:
    """``cost(format, m, n, k)``: the median measured seconds of a layer's three training GEMMs.

    For a shape it has not seen, it builds an ``nn.Linear(k, n)`` on ``device`` in ``dtype``, the module
    the planner swaps in for each format (``mixprec.plan.measure.swapped_in``), a random ``(m, k)`` input
    and a random ``(m, n)`` output gradient, and times forward plus ``torch.autograd.grad`` of the input
    and weight (fprop, dgrad, wgrad): ``warmup`` untimed calls per format, then ``repeats`` rounds, each
    timing every format once in turn (so drift on the machine hits all formats alike); the cost is the
    median of a format's rounds. Results are kept per ``(device, format, m, n, k)`` (``samples`` holds
    every timed round), so layers of one shape are measured once; ``compiled=True`` times
    ``torch.compile(layer)`` (with ``backend``) instead, kept under its own keys, and its name ends in
    ``":compiled"``. CUDA times with ``torch.cuda.Event`` pairs after a synchronize, a CPU with
    ``time.perf_counter`` (wall time: a busy machine adds noise, the interleaving spreads it evenly).
    Random values come from a generator of its own; torch's global RNG is not touched.

    Args:
        device: where to time (the model's device); dtype: the layer's parameter dtype (a dtype or a
            name such as "bf16").
        formats: the formats timed together when a new shape is asked for (a format asked for later
            that is not among them is timed alone).
        warmup: untimed calls per format (>= 0; a compiled layer compiles on its first call, so give
            at least 1 there); repeats: timed rounds (>= 1).
        compiled: time the path of a ``torch.compile``-d model; backend: its ``torch.compile`` backend.

    Raises:
        ValueError: for a warmup < 0 or repeats < 1, a compiled warmup of 0, a non-bool ``compiled``.
    """

    def __init__(
        self,
        device: torch.device | str,
        dtype: torch.dtype | str = torch.float32,
        formats: Sequence[str] = ("bf16",),
        *,
        warmup: int = 2,
        repeats: int = 5,
        compiled: bool = False,
        backend: str = "inductor",
        _timer: Timer | None = None,
    ) -> None:
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
            raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
        if not isinstance(compiled, bool):
            raise ValueError(f"compiled must be True or False, got {compiled!r}")
        if compiled and warmup < 1:  # the first call compiles: timing it would price the compiler
            raise ValueError(
                f"a compiled MeasuredCost needs warmup >= 1 (the first call compiles), got {warmup}"
            )
        self.compiled, self.backend = compiled, backend
        self.device, self.dtype = torch.device(device), as_dtype(dtype, "dtype")
        self.formats = list(dict.fromkeys(formats))
        self.warmup, self.repeats = warmup, repeats
        self.timer = _timer or (_cuda_timer if self.device.type == "cuda" else _cpu_timer)
        self.samples: dict[tuple[str, str, int, int, int], list[float]] = {}
        self.__name__ = measured_name(self.device) + (":compiled" if compiled else "")

    @property
    def _place(self) -> str:
        """The samples' device key: the device, and ``":compiled"`` for the compiled path."""
        return str(self.device) + (":compiled" if self.compiled else "")

    def __call__(self, fmt: str, m: int, n: int, k: int) -> float:
        key = (self._place, fmt, m, n, k)
        if key not in self.samples:
            todo = [f for f in self.formats if (self._place, f, m, n, k) not in self.samples]
            self._measure(todo if fmt in todo else [fmt], (m, n, k))
        return statistics.median(self.samples[key])

    def _measure(self, formats: list[str], shape: tuple[int, int, int]) -> None:
        m, n, k = shape
        gen = torch.Generator(device=self.device).manual_seed(0)
        device, dtype = self.device, self.dtype
        with torch.device("meta"):  # no draw from torch's global RNG, and no to_empty() swap
            linear = nn.Linear(k, n, bias=False)
        linear.weight = nn.Parameter(torch.randn(n, k, generator=gen, device=device, dtype=dtype) / k**0.5)
        x = torch.randn(m, k, generator=gen, device=device, dtype=dtype).requires_grad_(True)
        grad_out = torch.randn(m, n, generator=gen, device=device, dtype=dtype)
        # every swapped-in module shares linear's weight: its gradient is the one the module computes
        runs = {
            fmt: _step(self._path(swapped_in(linear, fmt, gen)), linear.weight, x, grad_out)
            for fmt in formats
        }
        for fmt in formats:
            for _ in range(self.warmup):
                runs[fmt]()
        times: dict[str, list[float]] = {fmt: [] for fmt in formats}
        for _ in range(self.repeats):
            for fmt in formats:
                times[fmt].append(float(self.timer(fmt, shape, runs[fmt])))
        for fmt, values in times.items():
            self.samples[(self._place, fmt, m, n, k)] = values

    def _path(self, module: nn.Module) -> nn.Module:
        """The module as the run calls it: itself, or compiled (a fresh compile per format and shape)."""
        if not self.compiled:
            return module
        return torch.compile(module, backend=self.backend, dynamic=False)  # type: ignore[return-value]


def _step(
    module: nn.Module, weight: torch.Tensor, x: torch.Tensor, grad_out: torch.Tensor
) -> Callable[[], object]:
    def run() -> object:
        with torch.enable_grad():
            out = module(x)
            return torch.autograd.grad(out, (x, weight), grad_out)

    return run


def _cpu_timer(fmt: str, shape: tuple[int, int, int], run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def _cuda_timer(fmt: str, shape: tuple[int, int, int], run: Callable[[], object]) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3  # ms -> s


def measured_name(device: torch.device) -> str:
    """``"measured:cpu"`` or ``"measured:cuda:<device name>"``: the plan's record of a measured cost."""
    if device.type == "cuda":
        return f"measured:cuda:{torch.cuda.get_device_name(device)}"
    return f"measured:{device.type}"


def _model_place(model: nn.Module | None) -> tuple[torch.device, torch.dtype]:
    """The device and dtype of the model's first linear weight (else first parameter; else CPU fp32)."""
    if model is None:
        return torch.device("cpu"), torch.float32
    weights = [m.weight for m in model.modules() if isinstance(m, nn.Linear)]
    params = weights or [p for p in model.parameters() if p.is_floating_point()]
    return (params[0].device, params[0].dtype) if params else (torch.device("cpu"), torch.float32)


def resolve_cost(
    cost: str | CostFn | None,
    model: nn.Module | None = None,
    formats: Sequence[str] = (),
    *,
    compiled: bool = False,
    quantize: str | None = None,
) -> tuple[str, CostFn]:
    """``(name, cost function)`` for a target name, ``"measured"``, a user function or None.

    None is ``"measured"`` when ``model``'s linear weights are on a CUDA device, else ``"b200"``.
    ``"measured"`` is a :class:`MeasuredCost` on the model's device and dtype timing ``formats`` (plus
    bf16 and fp32) together; its name is ``"measured:cpu"`` or ``"measured:cuda:<device name>"``, with
    ``":compiled"`` appended when ``compiled`` (the layers timed under ``torch.compile``). A target name is
    its roofline with the quantization priced on ``quantize_path(quantize, compiled=compiled)``'s path
    (:func:`mixprec.lowbit.cost.quantize_path`; its name stays the target's). A callable has one figure
    per format: neither argument changes it.

    Raises:
        ValueError: for an unknown target name or a ``quantize`` outside ``QUANTIZE_PATHS``; TypeError:
            for anything else that is not callable.
    """
    path = quantize_path(quantize, compiled=compiled)
    device, dtype = _model_place(model)
    if cost is None:
        cost = "measured" if device.type == "cuda" else "b200"
    if isinstance(cost, str):
        if cost == "measured":
            fn = MeasuredCost(device, dtype, [*formats, "bf16", "fp32"], compiled=compiled)
            return fn.__name__, fn
        if cost not in TARGETS:
            known = ", ".join([*TARGETS, "measured"])
            raise ValueError(f"unknown cost target {cost!r}; known: {known} (or a callable)")
        return resolve_target(cost, path)
    if not callable(cost):
        raise TypeError(f"cost must be a target name, a callable cost(format, m, n, k) or None, got {cost!r}")
    return getattr(cost, "__name__", "custom"), cost
