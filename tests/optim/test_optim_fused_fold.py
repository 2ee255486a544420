"""The non-finite check folded into the fused Adam pass: the same steps bit for bit as the separate check,
and a skipped step writes nothing (weights, Kahan buffers, state, step counters, random-bit generators)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from mixprec.optim import CompensatedOptimizer, fused_adam
from mixprec.optim.rounding import FOLD, Workspace

BF16 = torch.bfloat16


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 48), nn.Tanh(), nn.Linear(48, 24), nn.Tanh(), nn.Linear(24, 4)).to(BF16)


def backward(model, seed):
    g = torch.Generator().manual_seed(seed)
    model.zero_grad()
    model(torch.randn(16, 8, generator=g).to(BF16)).float().square().mean().backward()


def make(model, method, betas, fold, chunk):
    """Two groups (two fused units); ``fold``: check in the workspace (else the separate norm pass);
    ``chunk``: workspace buffer size, small enough to cut tensors into several chunks."""
    params = list(model.parameters())
    groups = [{"params": params[:3]}, {"params": params[3:], "weight_decay": 0.0}]
    opt = CompensatedOptimizer(torch.optim.AdamW(groups, lr=1e-2, betas=betas), method, seed=3)
    opt.workspace = Workspace(chunk, FOLD if fold else 0)
    return opt


def snapshot(model, opt):
    """Everything a step may write, copied."""
    return copy.deepcopy(
        {
            "params": [p.detach() for p in model.parameters()],
            "kahan": opt.compensation,
            "state": opt.optimizer.state_dict()["state"],
            "generators": opt.generators.state_dict(),
        }
    )


def same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a.dtype == b.dtype and torch.equal(a, b)


def count_separate_checks(monkeypatch) -> list[int]:
    calls = [0]
    separate = fused_adam.grads_fit

    def counted(*args):
        calls[0] += 1
        return separate(*args)

    monkeypatch.setattr(fused_adam, "grads_fit", counted)
    return calls


@pytest.mark.parametrize("method", ["kahan", "stochastic"])
@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.9, 0.99)])
@pytest.mark.parametrize("chunk", [2**18, 200])
def test_folded_check_steps_bit_for_bit_as_the_separate_check(monkeypatch, method, betas, chunk):
    calls = count_separate_checks(monkeypatch)
    runs = []
    for fold in (True, False):
        model = mlp()
        opt = make(model, method, betas, fold, chunk)
        before = calls[0]
        for step in range(6):
            backward(model, step)
            opt.step()
        runs.append(snapshot(model, opt))
        assert calls[0] - before == (0 if fold else 6)  # folded: no separate read of the gradients
        assert not opt.skipped_steps
    assert same(*runs)
    assert not same(runs[0]["params"], [p.detach() for p in mlp().parameters()])  # it trained


@pytest.mark.parametrize("method", ["kahan", "stochastic"])
@pytest.mark.parametrize("fold", [True, False])
@pytest.mark.parametrize("bad", ["inf", "nan", "huge", "huge-one"])
@pytest.mark.parametrize("at_step", [0, 3])
def test_a_skipped_step_writes_nothing(monkeypatch, method, fold, bad, at_step):
    """inf, nan, every gradient x1e30, or one value of 1e30: skipped on the first step (no state created)
    and on a later one (state, Kahan buffers, weights, step counters and generators unchanged)."""
    calls = count_separate_checks(monkeypatch)
    model = mlp()
    opt = make(model, method, (0.9, 0.999), fold, 200)
    for step in range(at_step):
        backward(model, step)
        opt.step()
    backward(model, at_step)
    if bad == "huge":
        for p in model.parameters():
            p.grad.mul_(1e30)
    else:
        model[2].weight.grad[1, 2] = {"inf": float("inf"), "nan": float("nan"), "huge-one": 1e30}[bad]
    before, checks = snapshot(model, opt), calls[0]
    with pytest.warns(RuntimeWarning, match="skipped an optimizer step"):
        opt.step()
    assert opt.last_step_skipped and opt.skipped_steps == 1
    assert calls[0] - checks == (0 if fold else 1)
    after = snapshot(model, opt)
    for key in after["generators"].keys() - before["generators"].keys():  # made on first use, no bits drawn
        assert torch.equal(after["generators"].pop(key), torch.Generator().manual_seed(3).get_state())
    assert same(before, after)
    assert len(opt.optimizer.state) == (0 if at_step == 0 else len(list(model.parameters())))
    backward(model, at_step + 1)
    opt.step()  # the next clean step goes on from the state before the skip
    assert not opt.last_step_skipped
    assert all(s["step"] == at_step + 1 for s in opt.optimizer.state.values())


def test_a_skip_then_the_same_clean_steps_match_a_run_that_never_saw_the_bad_step():
    runs = []
    for spike in (False, True):
        model = mlp()
        opt = make(model, "kahan", (0.9, 0.999), True, 2**18)
        for step in range(5):
            if spike and step == 2:
                backward(model, 99)
                model[0].bias.grad[0] = float("nan")
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)
                    opt.step()
            backward(model, step)
            opt.step()
        runs.append(snapshot(model, opt))
    assert same(*runs)


def test_the_fold_is_bounded_and_larger_steps_check_separately(monkeypatch):
    """Above ``fold_numel`` gradient values the step reads the gradients once first (grads_fit); the
    workspace's "grad" buffer never grows past the bound."""
    calls = count_separate_checks(monkeypatch)
    model = mlp()
    total = sum(p.numel() for p in model.parameters())
    opt = CompensatedOptimizer(torch.optim.AdamW(model.parameters()), "kahan", scratch_numel=total - 1)
    assert opt.workspace.fold_numel == total - 1
    backward(model, 0)
    opt.step()
    assert calls[0] == 1
    assert all(b.numel() <= total - 1 for b in opt.workspace.buffers.values())
    opt.workspace.fold_numel = total
    backward(model, 1)
    opt.step()
    assert calls[0] == 1
    assert opt.workspace.buffers[("cpu", torch.float32, "grad")].numel() == total


@pytest.mark.parametrize("bad_in", ["fused", "unfused"])
def test_a_first_step_skipped_by_either_check_creates_no_state(bad_in):
    """bf16 params step fused, an fp32 param unfused; a nan in either skips the step, no state left."""
    model = mlp()
    model[4].bias.data = model[4].bias.data.float()  # one fp32 param: the unfused path
    opt = CompensatedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), "kahan")
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-2
    target = model[4].bias if bad_in == "unfused" else model[0].weight
    target.grad.view(-1)[0] = float("nan")
    with pytest.warns(RuntimeWarning, match="skipped an optimizer step"):
        opt.step()
    assert opt.last_step_skipped and len(opt.optimizer.state) == 0
    target.grad.view(-1)[0] = 0.0
    opt.step()
    assert len(opt.optimizer.state) == len(list(model.parameters()))
