"""Training steps on fake CUDA tensors, each counted by the active :class:`~fake_cuda.harness.Recorder`.

Autograd's engine does not run under fake CUDA, so a step sets ``.grad`` by hand (fake tensors of the
parameters' shapes) where ``backward`` would. Used by the tests and by ``report.py`` (the host-sync table).
Each function returns the per-step counts ``[(host_syncs, h2d), ...]`` of ``steps`` steps.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

import mixprec
from fake_cuda.harness import Ctx, Recorder

SHAPES = ((256, 128), (256,), (64, 256), (64,))
Counts = list[tuple[int, int]]


def params(dtype: torch.dtype = torch.float32) -> list[nn.Parameter]:
    return [nn.Parameter(torch.randn(shape, device="cuda", dtype=dtype)) for shape in SHAPES]


def _set_grads(ps: list[torch.Tensor], scaled_loss: torch.Tensor | None = None) -> None:
    for p in ps:  # what backward of a scaled loss would leave: gradients times the scale
        grad = torch.randn_like(p)
        p.grad = grad * scaled_loss.detach() if scaled_loss is not None else grad


def _counted(recorder: Recorder, steps: int, step: Callable[[], None]) -> Counts:
    counts = []
    for _ in range(steps):
        recorder.reset()
        step()
        counts.append((recorder.host_syncs(), recorder.count("h2d")))
    return counts


def scaler_loop(
    recorder: Recorder, scaler: object, fused: bool, unscale: bool, steps: int = 3, overflow: bool = False
) -> Counts:
    """``scale -> (grads) -> [unscale_] -> step -> update`` with AdamW, foreach or fused; with ``overflow``
    every step after the first reads as an inf step (found_inf set: skipped), see ``Recorder.overflow``."""
    ps = params()
    kind = {"fused": True} if fused else {"foreach": True}
    opt = torch.optim.AdamW(ps, lr=1e-3, **kind)

    def step() -> None:
        loss = sum(p.float().sum() for p in ps)
        _set_grads(ps, scaler.scale(loss))
        if unscale:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        recorder.overflow = overflow  # from the second step on: the first warms up on a finite one

    try:
        return _counted(recorder, steps, step)
    finally:
        recorder.overflow = False


def compensated_loop(recorder: Recorder, method: str, skip_nonfinite: bool = True, steps: int = 3) -> Counts:
    """A pure-bf16 AdamW step through :class:`mixprec.CompensatedOptimizer` (kahan / stochastic)."""
    ps = params(torch.bfloat16)
    inner = torch.optim.AdamW(ps, lr=1e-3)
    opt = mixprec.CompensatedOptimizer(inner, method=method, skip_nonfinite=skip_nonfinite)

    def step() -> None:
        _set_grads(ps)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return _counted(recorder, steps, step)


def master_loop(recorder: Recorder, scaler: object, steps: int = 3) -> Counts:
    """bf16 model params, fp32 masters: :class:`mixprec.MixedPrecisionOptimizer` over AdamW (foreach)."""
    ps = params(torch.bfloat16)
    opt = mixprec.MixedPrecisionOptimizer(torch.optim.AdamW(ps, lr=1e-3, foreach=True), scaler=scaler)

    def step() -> None:
        loss = sum(p.float().sum() for p in ps)
        if opt.scaler is not None:  # backward of the scaled loss, by hand
            _set_grads(ps, opt.scaler.scale(loss))
        else:
            _set_grads(ps)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return _counted(recorder, steps, step)


def torch_adamw_loop(recorder: Recorder, dtype: torch.dtype, steps: int = 3) -> Counts:
    """torch's own AdamW (foreach) stepping ``dtype`` params in place, nothing around it."""
    ps = params(dtype)
    opt = torch.optim.AdamW(ps, lr=1e-3, foreach=True)

    def step() -> None:
        _set_grads(ps)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return _counted(recorder, steps, step)


def torch_master_loop(recorder: Recorder, scaler: torch.amp.GradScaler | None, steps: int = 3) -> Counts:
    """What MixedPrecisionOptimizer replaces, by hand in torch: fp32 masters of bf16 params, AdamW
    (foreach) on the masters, bf16 grads copied in and the masters copied back each step, with
    ``torch.amp.GradScaler`` (or none)."""
    ps = params(torch.bfloat16)
    masters = [nn.Parameter(p.detach().float()) for p in ps]
    opt = torch.optim.AdamW(masters, lr=1e-3, foreach=True)

    def step() -> None:
        loss = sum(p.float().sum() for p in ps)
        _set_grads(ps, scaler.scale(loss) if scaler is not None else None)
        for p, m in zip(ps, masters, strict=True):
            m.grad = p.grad.float()
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        with torch.no_grad():
            torch._foreach_copy_(ps, masters)
        opt.zero_grad(set_to_none=True)

    return _counted(recorder, steps, step)


def function_loop(recorder: Recorder, function: type, args: tuple, needs: tuple, steps: int = 2) -> Counts:
    """An ``autograd.Function``'s forward then backward, called directly (``args[0]`` is the input)."""

    def step() -> None:
        ctx = Ctx(needs)
        out = function.forward(ctx, *args)
        function.backward(ctx, torch.randn_like(out))

    return _counted(recorder, steps, step)


def gpt_shapes(width: int = 2048, layers: int = 8) -> list[tuple[int, ...]]:
    """A GPT's weight shapes as ``benchmarks/optimizer_speed.py`` steps them (per block qkv, proj, the
    MLP's two and two norms); the defaults are its 403M parameters."""
    d = width
    return [(3 * d, d), (d, d), (4 * d, d), (d, 4 * d), (d,), (d,)] * layers


Launches = list[tuple[int, int]]


def optimizer_launches(
    recorder: Recorder,
    make: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    shapes: list[tuple[int, ...]],
    steps: int = 3,
) -> Launches:
    """``(host syncs, kernel launches)`` of each of ``steps`` steps of the optimizer ``make`` builds on bf16
    params of ``shapes`` (gradients set before the count, as backward leaves them: not counted)."""
    ps = [nn.Parameter(torch.randn(shape, device="cuda", dtype=torch.bfloat16)) for shape in shapes]
    opt = make(ps)
    counts = []
    for _ in range(steps):
        _set_grads(ps)
        recorder.reset()
        opt.step()
        counts.append((recorder.host_syncs(), recorder.launch_count()))
        opt.zero_grad(set_to_none=True)
    return counts
