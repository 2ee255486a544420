"""Training steps on fake CUDA: GradScaler, CompensatedOptimizer, MixedPrecisionOptimizer.

Host syncs per step are counted by the recorder for mixprec and for torch's same loop in the same run
(torch is the bound); no step after the first copies anything from the host.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import mixprec
from fake_cuda import loops
from mixprec.optim import METHODS
from mixprec.optim.guard import largest_norms


def _syncs(counts: loops.Counts) -> list[int]:
    return [s for s, _ in counts]


def _no_copies_after_first(counts: loops.Counts) -> None:
    assert [h2d for _, h2d in counts[1:]] == [0] * (len(counts) - 1)


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
@pytest.mark.parametrize("unscale", [False, True], ids=["step", "unscale-step"])
def test_grad_scaler_syncs_no_more_than_torch(fake_hopper, fused: bool, unscale: bool) -> None:
    theirs = loops.scaler_loop(fake_hopper, torch.amp.GradScaler("cuda"), fused, unscale)
    ours = loops.scaler_loop(fake_hopper, mixprec.GradScaler("cuda"), fused, unscale)
    assert _syncs(theirs) == ([0, 0, 0] if fused else [1, 1, 1])  # torch: the skip decision's .item()
    assert all(m <= t for m, t in zip(_syncs(ours), _syncs(theirs), strict=True)), (ours, theirs)
    _no_copies_after_first(ours)


def test_a_fused_step_hands_the_scale_to_the_kernel(fake_hopper) -> None:
    scaler = mixprec.GradScaler("cuda")
    ps = loops.params()
    opt = torch.optim.AdamW(ps, fused=True)
    calls = []
    real = torch._fused_adamw_

    def spy(*args, **kwargs):
        calls.append((kwargs["grad_scale"], kwargs["found_inf"]))
        return real(*args, **kwargs)

    loops._set_grads(ps, scaler.scale(torch.ones((), device="cuda")))
    torch._fused_adamw_ = spy
    try:
        scaler.step(opt)
    finally:
        torch._fused_adamw_ = real
    ((grad_scale, found_inf),) = calls
    assert grad_scale.device.type == found_inf.device.type == "cuda"
    assert fake_hopper.host_syncs() == 0


def test_the_scaler_on_cuda_is_enabled_with_cuda_available(fake_hopper) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "cuda is not available, disabling" here
        assert mixprec.GradScaler("cuda").is_enabled()


@pytest.mark.parametrize("method", list(METHODS))
def test_compensated_optimizer_steps_bf16_on_cuda(fake_hopper, method: str) -> None:
    counts = loops.compensated_loop(fake_hopper, method, skip_nonfinite=False)
    torch_counts = loops.torch_adamw_loop(fake_hopper, torch.bfloat16)
    assert _syncs(counts) == _syncs(torch_counts) == [0, 0, 0]  # torch's own bf16 AdamW: no sync either
    _no_copies_after_first(counts)
    assert fake_hopper.count("bad_generator") == 0


@pytest.mark.parametrize("method", list(METHODS))
def test_compensated_skip_check_costs_one_sync(fake_hopper, method: str) -> None:
    # skip_nonfinite must read whether the gradients are finite: one host read per step, no more.
    counts = loops.compensated_loop(fake_hopper, method, skip_nonfinite=True)
    assert _syncs(counts) == [1, 1, 1]
    _no_copies_after_first(counts)


def test_stochastic_rounding_draws_from_a_cuda_generator(fake_hopper) -> None:
    ps = loops.params(torch.bfloat16)
    opt = mixprec.CompensatedOptimizer(torch.optim.AdamW(ps), method="stochastic", skip_nonfinite=False)
    loops._set_grads(ps)
    opt.step()
    assert [torch.device(k).type for k in opt.generators.state_dict()] == ["cuda"]
    assert fake_hopper.count("bad_generator") == 0


def test_mixed_precision_optimizer_without_scaler_matches_torch(fake_hopper) -> None:
    ours = loops.master_loop(fake_hopper, None)
    theirs = loops.torch_master_loop(fake_hopper, None)
    assert _syncs(ours) == _syncs(theirs) == [0, 0, 0]
    _no_copies_after_first(ours)


def test_mixed_precision_optimizer_with_scaler_adds_only_the_overflow_guard(fake_hopper) -> None:
    theirs = loops.torch_master_loop(fake_hopper, torch.amp.GradScaler("cuda"))
    ours = loops.master_loop(fake_hopper, "dynamic")
    # the scaler's skip decision (torch's one), plus the guard's read of the largest gradient norm
    assert _syncs(ours) == [t + 1 for t in _syncs(theirs)] == [2, 2, 2]
    _no_copies_after_first(ours)


def test_the_overflow_guard_reads_the_host_once_per_step(fake_hopper) -> None:
    # largest_norms documents "one host read for all of them": gradients of two dtypes are two groups.
    grads = [torch.randn(64, device="cuda", dtype=d) for d in (torch.bfloat16, torch.float32)]
    norms = largest_norms(grads)
    assert len(norms) == 2
    assert fake_hopper.host_syncs() == 1
