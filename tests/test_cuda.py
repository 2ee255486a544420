"""CUDA checks, skipped without a GPU: the default CUDA policy and GradScaler against torch on a device.

The same code paths run on the CPU in the rest of the suite; these differential checks need a GPU and run
when one is present (benchmarks/gpu.sh is the matching benchmark recipe).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import mixprec
from tests.autocast.test_differential_models import CASES, run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_model_matches_torch_autocast_on_cuda(case: str, dtype: torch.dtype) -> None:
    build, make_input, make_target = CASES[case]
    torch.manual_seed(0)
    model = build().cuda()
    twin = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    inputs, target = make_input(g).cuda(), make_target(g).cuda()
    out_t, loss_t, grads_t = run(model, inputs, target, torch.autocast("cuda", dtype=dtype))
    out_m, loss_m, grads_m = run(twin, inputs, target, mixprec.autocast("cuda", dtype=dtype))
    assert out_m.dtype == out_t.dtype == dtype
    torch.testing.assert_close(loss_m, loss_t, rtol=1e-3, atol=1e-3)  # cuBLAS may pick other algorithms
    for name in grads_t:
        assert grads_m[name].dtype == grads_t[name].dtype, name
        torch.testing.assert_close(grads_m[name], grads_t[name], rtol=2e-2, atol=2e-3, msg=name)


@pytest.mark.parametrize(
    "call, expected",
    [
        (lambda x: torch.mm(x, x), torch.float16),
        (lambda x: torch.softmax(x, -1), torch.float32),  # fp32_set_opt_dtype
        (lambda x: torch.softmax(x, -1, dtype=torch.float16), torch.float16),  # an explicit dtype wins
        (lambda x: torch.norm(x), torch.float32),  # fp32_append_dtype
        (lambda x: torch.exp(x), torch.float32),
        (lambda x: torch.cat([x, x.float()]), torch.float32),
    ],
)
def test_cuda_categories_match_torch(call, expected: torch.dtype) -> None:
    x = torch.randn(8, 8, device="cuda", dtype=torch.float16)
    with torch.autocast("cuda", dtype=torch.float16):
        want = call(x)
    with mixprec.autocast("cuda", dtype=torch.float16):
        got = call(x)
    assert got.dtype == want.dtype == expected
    torch.testing.assert_close(got, want)


def test_binary_cross_entropy_is_banned_as_in_torch() -> None:
    p, y = torch.rand(4, device="cuda"), torch.rand(4, device="cuda")
    with pytest.raises(RuntimeError, match="unsafe to autocast"), mixprec.autocast("cuda"):
        F.binary_cross_entropy(p, y)


def _adam_steps(optimizer: torch.optim.Optimizer) -> int:
    """How many times ``optimizer.step()`` ran: Adam's own per-parameter step count (0 before the first)."""
    states = [optimizer.state[p] for group in optimizer.param_groups for p in group["params"]]
    counts = {int(float(state["step"])) if "step" in state else 0 for state in states}
    assert len(counts) == 1, counts  # every parameter had a gradient at every step
    return counts.pop()


def test_grad_scaler_matches_torch_on_cuda() -> None:
    # Which steps skip is the device's business: the inputs made inf at steps 4 and 7 overflow anywhere, and
    # a scale grown every 3 clean steps can overflow the fp16 gradients too (it did on an H200). So the
    # expected skips are the ones torch's own scaler made in the same run, read from torch's optimizer: its
    # step count does not advance on a skipped step. mixprec must skip exactly those, step by step.
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4).cuda()
    twin = copy.deepcopy(model)
    opt_t = torch.optim.Adam(model.parameters(), lr=1e-2)
    opt_m = torch.optim.Adam(twin.parameters(), lr=1e-2)
    ref, ours = torch.amp.GradScaler("cuda", growth_interval=3), mixprec.GradScaler("cuda", growth_interval=3)
    torch_skipped = []
    for step in range(12):
        x = torch.randn(8, 16, device="cuda")
        if step in (4, 7):
            x[0, 0] = float("inf")
        for mdl, opt, scaler in ((model, opt_t, ref), (twin, opt_m, ours)):
            before = _adam_steps(opt)
            opt.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = mdl(x).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            if scaler is ref and _adam_steps(opt) == before:
                torch_skipped.append(step)
            elif scaler is ours:
                assert (_adam_steps(opt) == before) == ours.last_step_skipped, step
        assert ours.get_scale() == ref.get_scale(), step
        assert ours.last_step_skipped == (torch_skipped[-1:] == [step]), (step, torch_skipped)
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert {4, 7} <= set(torch_skipped)  # an inf input overflows on any device
    assert ours.skipped_steps == len(torch_skipped)
