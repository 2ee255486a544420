"""Long runs with a stretch of huge-but-finite gradients, on every guarded master-weight path.

Ten steps whose loss is multiplied by 1e30 (by 1e3 where the model is fp16, whose largest finite value is
65504) sit between clean steps. torch's Adam takes them: ``exp_avg_sq`` becomes inf and the weights never
move again (checked below, so the stretch is a real hazard). On a guarded path each such step is skipped
and counted, the optimizer state stays finite, and the run ends where torch's fp32 Adam ends when it is
given only the clean steps (the oracle, in this run). The paths are data (``paths.PATHS``); the
Kahan/stochastic ones are left out until their update pass checks the gradients itself. fp16 models
(``O2-fp16``, ``16-true``) get a stretch of 1e3 times the loss: their gradients are finite in fp16, their
squares fit the fp32 state, and training must simply go on.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from .paths import PATHS, Path, model, train_step

STEPS, STRETCH = 60, range(20, 30)
GUARDED = [pytest.param(p, id=p.name) for p in PATHS if p.guarded]


def _factor(path: Path) -> float:
    return 1e3 if path.grad_dtype == torch.float16 else 1e30


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randn(32, 8), torch.randn(32, 1)


def _torch_run(factor: float, skip_stretch: bool) -> tuple[torch.nn.Module, torch.optim.Adam, float]:
    net = model()
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    x, y = _data()
    loss = 0.0
    for step in range(STEPS):
        if step in STRETCH and skip_stretch:
            continue
        opt.zero_grad()
        out = (net(x) - y).pow(2).mean()
        (out * (factor if step in STRETCH else 1.0)).backward()
        opt.step()
        loss = float(out.detach())
    return net, opt, loss


def _state_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.is_floating_point()]


def test_the_stretch_freezes_torch_adam():
    net, opt, _ = _torch_run(1e30, skip_stretch=False)
    assert any(torch.isinf(t).any() for t in _state_tensors(opt))
    before = [p.detach().clone() for p in net.parameters()]
    x, y = _data()
    opt.zero_grad()
    (net(x) - y).pow(2).mean().backward()
    opt.step()
    assert all(torch.equal(b, p) for b, p in zip(before, net.parameters(), strict=True))


@pytest.mark.parametrize("path", GUARDED)
def test_a_stretch_of_huge_gradients_is_skipped_and_training_goes_on(path):
    net = model()
    net, opt = path.build(net, torch.optim.Adam(net.parameters(), lr=1e-2))
    x, y = _data()
    factor = _factor(path)
    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            losses.append(train_step(net, opt, x, y, factor if step in STRETCH else 1.0))
            if step == STRETCH[-1]:
                assert all(torch.isfinite(t).all() for t in _state_tensors(opt)), "state poisoned"
                after_stretch = [p.detach().clone() for p in net.parameters()]
    assert all(torch.isfinite(t).all() for t in _state_tensors(opt))
    assert all(torch.isfinite(p).all() for p in net.parameters())
    assert any(not torch.equal(a, p) for a, p in zip(after_stretch, net.parameters(), strict=True))
    if factor < 1e20:  # fp16: the square of its largest gradient fits the fp32 state; nothing to skip
        assert losses[-1] < losses[STRETCH[0]]  # the scaler backs off as usual, and training goes on
        return
    _, _, oracle = _torch_run(factor, skip_stretch=True)
    assert losses[-1] == pytest.approx(oracle, rel=0.1, abs=5e-3), (losses[-1], oracle)
    assert opt.skipped_steps == len(STRETCH)  # every huge step skipped, counted and reported
    assert sum("skipped an optimizer step" in str(w.message) for w in caught) == len(STRETCH)


@pytest.mark.parametrize("path", GUARDED)
def test_the_guard_skips_nothing_in_a_clean_run(path):
    net = model()
    net, opt = path.build(net, torch.optim.Adam(net.parameters(), lr=1e-2))
    x, y = _data()
    large = 1.0 if path.grad_dtype == torch.float16 else 1e15  # its square fits fp32: stepped
    for _ in range(5):
        train_step(net, opt, x, y, large)
    assert opt.skipped_steps == 0 and not opt.last_step_skipped


def test_loss_scale_none_opts_out_of_the_guard_as_of_the_inf_check():
    import mixprec

    net = model()
    net, opt = mixprec.initialize(net, torch.optim.Adam(net.parameters(), lr=1e-2), "O2", loss_scale=None)
    x, y = _data()
    train_step(net, opt, x, y, 1e30)
    assert opt.skipped_steps == 0
    assert any(torch.isinf(t).any() for t in _state_tensors(opt))  # as torch: the user opted out
