"""The planner's measured cost on fake CUDA: which GEMMs it times, in which dtypes, at what host cost.

:class:`mixprec.plan.cost.MeasuredCost` times a layer's forward and ``torch.autograd.grad`` per
format. Under fake CUDA the times mean nothing and autograd's engine cannot run, so the timer is
scripted (it runs the step and records what the :class:`~fake_cuda.harness.Recorder` saw during it) and
``torch.autograd.grad`` calls the layer's autograd function's backward directly
(:func:`~fake_cuda.harness.direct_autograd`). The checks: a low-bit format is timed on the tensor-core
GEMM the training step takes at that capability (not the emulation), with the layer's dtype, and a timed
call neither waits for the device nor copies from the host. The CUDA timer itself is checked with
``torch.cuda.Event`` / ``synchronize`` scripted: events around the launch, read after a synchronize.
"""

from __future__ import annotations

import warnings
from typing import ClassVar
from unittest import mock

import pytest
import torch
from torch import nn

from fake_cuda.harness import Event, direct_autograd
from mixprec.lowbit import RECIPES
from mixprec.lowbit.gemm import LowbitLinearFunction
from mixprec.plan import cost as plan_cost
from mixprec.plan.cost import MeasuredCost, resolve_cost

pytestmark = pytest.mark.skipif(torch.version.cuda is None, reason="needs a CUDA build of torch (fake tier)")

M, N, K = 256, 1024, 512  # every dim above 128: the shape gates of every kernel are met
# The formats timed, and the capabilities where each one's three GEMMs have a tensor-core kernel
# (ScaledBlas.cpp; tests/fake_cuda/test_lowbit_kernels.py checks the same table on the training path).
KERNEL_AT = {
    "fp8_tensorwise": {(8, 9), (9, 0), (10, 0), (12, 0)},
    "fp8_rowwise": {(8, 9), (9, 0), (10, 0), (12, 0)},
    "mxfp8": {(10, 0)},
    "nvfp4": {(10, 0)},
}
FORMATS = [*KERNEL_AT, "bf16", "fp32"]


def _engine_free_grad(calls: list):
    """``torch.autograd.grad(out, (x, weight), grad_out)`` without the engine: the recorded function's
    backward, or for a plain (high-precision) linear the two matmuls its engine backward runs."""

    def grad(outputs, inputs, grad_outputs, **kwargs):
        mine = [c for c in calls if c.output is outputs]
        if mine:
            grad_x, grad_w, *_ = mine[-1].backward(grad_outputs)
            return grad_x, grad_w
        x, weight = inputs
        return grad_outputs @ weight.to(grad_outputs.dtype), grad_outputs.t() @ x.to(grad_outputs.dtype)

    return mock.patch.object(torch.autograd, "grad", grad)


def _k(gemm: dict) -> int:
    """A scaled GEMM's reduction size in values (``float4_e2m1fn_x2`` holds two per byte)."""
    packed = gemm["self"]["dtype"] == torch.float4_e2m1fn_x2
    return gemm["self"]["shape"][1] * (2 if packed else 1)


def _timed(recorder):
    """A timer that runs the step once and keeps, per format, the events recorded during each call."""
    seen: dict[str, list[list[Event]]] = {}

    def timer(fmt, shape, run):
        start = len(recorder.events)
        run()
        seen.setdefault(fmt, []).append(recorder.events[start:])
        return 1.0

    return timer, seen


def test_measured_cost_times_each_format_on_the_kernel_training_takes(fake, capability) -> None:
    with direct_autograd(LowbitLinearFunction) as calls, _engine_free_grad(calls), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the emulation's once-per-process warning is tested on the CPU
        timer, seen = _timed(fake)
        cost = MeasuredCost("cuda", torch.bfloat16, FORMATS, warmup=1, repeats=2, _timer=timer)
        costs = {fmt: cost(fmt, M, N, K) for fmt in FORMATS}
    assert costs == dict.fromkeys(FORMATS, 1.0) and set(seen) == set(FORMATS)
    assert fake.count("bad_generator") == 0
    for fmt, rounds in seen.items():
        assert len(rounds) == 2, fmt  # repeats timed calls per format; warmup ones untimed
        for events in rounds:
            assert [e for e in events if e.kind in ("sync", "d2h", "h2d")] == [], (fmt, events)
            gemms = [e.detail for e in events if e.kind == "scaled_mm"]
            assert [g.get("error") for g in gemms] == [None] * len(gemms), (fmt, gemms)
            kernel = capability in KERNEL_AT.get(fmt, set())
            assert len(gemms) == (3 if kernel else 0), (fmt, capability, gemms)
            for g in gemms:  # low-bit operands, written in the layer's dtype (bf16)
                assert g["self"]["dtype"] not in (torch.bfloat16, torch.float32), g
                assert g["out_dtype"] in (torch.bfloat16, torch.float32), g
                assert g["self"]["device"] == "cuda" and g["mat2"]["device"] == "cuda"
            shapes = [tuple(sorted((*g["self"]["shape"][:1], g["mat2"]["shape"][1], _k(g)))) for g in gemms]
            assert all(s == tuple(sorted((M, N, K))) for s in shapes), shapes  # fprop, dgrad, wgrad
    # the layer's own dtype: the low-bit outputs (bf16 or fp32 to fold a tensor scale) end in bf16
    lowbit = [c for c in calls if c.fn is LowbitLinearFunction]
    assert lowbit and all(c.output.dtype == torch.bfloat16 for c in lowbit)


def test_resolve_cost_measures_a_cuda_model_in_its_own_dtype(fake_hopper) -> None:
    model = nn.Sequential(nn.Linear(64, 32, device="cuda", dtype=torch.bfloat16))
    name, fn = resolve_cost(None, model, ["fp8_tensorwise"])
    assert isinstance(fn, MeasuredCost) and name == "measured:cuda:fake sm90"
    assert fn.device.type == "cuda" and fn.dtype == torch.bfloat16
    assert fn.formats == ["fp8_tensorwise", "bf16", "fp32"] and fn.timer is plan_cost._cuda_timer


class _ScriptedEvent:
    """``torch.cuda.Event`` on a machine without a driver: records what is asked of it, in order."""

    log: ClassVar[list[str]] = []
    made = 0

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.name = ("start", "end")[_ScriptedEvent.made % 2]  # the timer makes start, then end
        _ScriptedEvent.made += 1

    def record(self) -> None:
        self.log.append(f"{self.name}.record")

    def synchronize(self) -> None:
        self.log.append(f"{self.name}.synchronize")

    def elapsed_time(self, end: _ScriptedEvent) -> float:
        self.log.append("elapsed_time")
        return 2.5


def test_the_cuda_timer_reads_events_after_the_launch_completes() -> None:
    """Not ``time.perf_counter`` around an asynchronous launch: device events around it, read only after
    the end event has completed, and the queue drained before the start (earlier work not counted)."""
    log = _ScriptedEvent.log = []
    _ScriptedEvent.made = 0
    with (
        mock.patch.object(torch.cuda, "Event", _ScriptedEvent),
        mock.patch.object(torch.cuda, "synchronize", lambda device=None: log.append("synchronize")),
    ):
        seconds = plan_cost._cuda_timer("bf16", (M, N, K), lambda: log.append("run"))
    assert seconds == pytest.approx(2.5e-3)  # elapsed_time is in milliseconds
    assert log == ["synchronize", "start.record", "run", "end.record", "end.synchronize", "elapsed_time"]


def test_every_timed_format_is_a_recipe_or_a_float_dtype() -> None:
    """The table above names real formats (a renamed recipe fails here, not silently)."""
    assert set(KERNEL_AT) <= set(RECIPES)
