"""Low-bit optimizer states on fake CUDA: every tensor they create lives on the device, and a step syncs
with the host only for the non-finite check (as the bf16-state path), copying nothing after the first."""

from __future__ import annotations

import pytest
import torch

import mixprec
from fake_cuda import loops
from mixprec.optim.state_formats import STATE_FORMATS


def _counted_steps(recorder, opt, ps, steps: int = 3) -> list[tuple[int, int]]:
    counts = []
    for _ in range(steps):
        recorder.reset()
        loops._set_grads(ps)
        opt.step()
        opt.zero_grad(set_to_none=True)
        counts.append((recorder.host_syncs(), recorder.count("h2d")))
    return counts


@pytest.mark.parametrize("fmt", STATE_FORMATS)
@pytest.mark.parametrize("method", ["kahan", "stochastic"])
def test_lowbit_compensated_step_stays_on_the_device(fake_hopper, fmt: str, method: str) -> None:
    ps = loops.params(torch.bfloat16)
    opt = mixprec.CompensatedOptimizer(torch.optim.AdamW(ps, lr=1e-3), method, state_format=fmt)
    counts = _counted_steps(fake_hopper, opt, ps)
    assert [s for s, _ in counts] == [1, 1, 1]  # skip_nonfinite's one read, nothing else
    assert [h2d for _, h2d in counts[1:]] == [0, 0]
    devices = {v.device.type for s in opt.state.values() for k, v in s.items() if k != "step"}
    assert devices == {"cuda"}
    assert {b.device.type for b in opt.workspace.buffers.values()} == {"cuda"}


@pytest.mark.parametrize("fmt", STATE_FORMATS)
def test_lowbit_masters_step_adds_no_sync(fake_hopper, fmt: str) -> None:
    ps = loops.params(torch.bfloat16)
    opt = mixprec.MixedPrecisionOptimizer(torch.optim.AdamW(ps, lr=1e-3), scaler=None, state_format=fmt)
    counts = _counted_steps(fake_hopper, opt, ps)
    assert [s for s, _ in counts] == [0, 0, 0]
    assert [h2d for _, h2d in counts[1:]] == [0, 0]
    codes = {s["exp_avg"].dtype for s in opt.state.values()}
    assert len(codes) == 1 and next(iter(codes)).itemsize <= 2
