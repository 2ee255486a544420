"""The optimizer paths on a real GPU (``pytest -m cuda``, run by ``benchmarks/gpu.sh``; skipped without one).

Issue 39 item 1: with a host ``step`` counter torch's fused kernel refused every CompensatedOptimizer Adam
step (kahan, stochastic) and every low-bit state on the H200. What each test expects holds on any CUDA
device: the counters are where the kernels read them; torch's fused kernel is elementwise and
deterministic, so a fused step of the same fp32 inputs gives the same bits whatever the chunking, and a
run resumed from a state saved to the host repeats the uninterrupted one bit for bit.
"""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from mixprec.optim import METHODS, CompensatedOptimizer, MixedPrecisionOptimizer
from mixprec.optim.state_formats import STATE_FORMATS

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BF16 = torch.bfloat16
FLAGS = {
    "default": {},
    "foreach": {"foreach": True},
    "single-tensor": {"foreach": False},
    "fused": {"fused": True},
    "capturable": {"capturable": True},
}


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 8)).to("cuda", BF16)


def _backward(model: nn.Module, seed: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(seed)
    model.zero_grad()
    model(torch.randn(32, 64, device="cuda", generator=g).to(BF16)).float().square().mean().backward()


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, start: int = 0) -> None:
    for i in range(start, start + steps):
        _backward(model, i)
        opt.step()


@pytest.mark.parametrize("flags", FLAGS)
@pytest.mark.parametrize("method", METHODS)
def test_compensated_optimizer_steps_on_the_gpu_with_every_flag(method, flags):
    model = _model()
    opt = CompensatedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, **FLAGS[flags]), method)
    _train(model, opt, 2)
    on_device = method != "nearest" or flags == "capturable"  # the fused pass, or torch's capturable Adam
    for state in opt.state.values():
        assert state["step"].device.type == ("cuda" if on_device else "cpu")
        assert state["step"].item() == 2.0
    assert all(torch.isfinite(p).all() for p in model.parameters())


# the low-bit step is one fused pass whatever the flags say (bit for bit the same on the CPU, see
# test_the_inner_optimizers_flags_do_not_change_the_lowbit_step), so three of them suffice here
@pytest.mark.parametrize("flags", ["default", "fused", "capturable"])
@pytest.mark.parametrize("state_format", STATE_FORMATS)
@pytest.mark.parametrize("wrapper", ["compensated", "masters"])
def test_lowbit_states_step_on_the_gpu(wrapper, state_format, flags):
    model = _model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3, **FLAGS[flags])
    if wrapper == "compensated":
        opt = CompensatedOptimizer(inner, "kahan", state_format=state_format)
    else:
        opt = MixedPrecisionOptimizer(inner, scaler=None, state_format=state_format)
    _train(model, opt, 2)
    assert {(s["step"].device.type, s["step"].item()) for s in opt.state.values()} == {("cuda", 2.0)}


def test_first_kahan_step_on_the_gpu_is_torchs_fused_adamw_bit_for_bit():
    model = _model()
    _backward(model, 1)
    params = list(model.parameters())
    copies = [nn.Parameter(p.detach().float()) for p in params]
    for c, p in zip(copies, params, strict=True):
        c.grad = p.grad.float()
    oracle = torch.optim.AdamW(copies, lr=1e-3, weight_decay=0.1, fused=True)
    oracle.step()
    opt = CompensatedOptimizer(torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1), "kahan")
    opt.step()
    for p, c, kahan in zip(params, copies, opt.compensation, strict=True):
        assert torch.equal(p, c.detach().to(BF16))
        assert torch.equal(kahan, (c.detach() - p.float()).to(BF16))
        assert torch.equal(opt.state[p]["step"], oracle.state[c]["step"])


def _to_host(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, map_location="cpu", weights_only=False)


@pytest.mark.parametrize("state_format", [None, "int8"])
@pytest.mark.parametrize("flags", ["default", "fused"])
def test_a_run_resumed_from_a_host_checkpoint_repeats_the_uninterrupted_one(flags, state_format):
    model = _model()
    make = lambda m: CompensatedOptimizer(  # noqa: E731
        torch.optim.AdamW(m.parameters(), lr=1e-3, **FLAGS[flags]), "kahan", state_format=state_format
    )
    opt = make(model)
    _train(model, opt, 2)
    saved = _to_host({"model": model.state_dict(), "opt": opt.state_dict()})
    _train(model, opt, 2, start=2)
    fresh = _model(seed=5)
    fresh.load_state_dict(saved["model"])
    fresh_opt = make(fresh)
    fresh_opt.load_state_dict(saved["opt"])
    _train(fresh, fresh_opt, 2, start=2)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters(), strict=True))
    assert all(s["step"].device.type == "cuda" for s in fresh_opt.state.values())


def _master_run(state_format: str, switch: str, monkeypatch, steps: int = 3):
    """``MixedPrecisionOptimizer``'s fp32 masters with ``state_format``, the Triton pass on (``"1"``) or
    the chunked engine; the masters and the moments' codes and scales after each step."""
    monkeypatch.setenv("MIXPREC_FUSED_OPTIM", switch)
    model = _model()
    opt = MixedPrecisionOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1),
        scaler=None,
        state_format=state_format,
    )
    out = []
    for i in range(steps):
        _backward(model, i)
        opt.step()
        out.append([m.detach().clone() for m in opt.master_params])
        out[-1] += [
            v.clone() for m in opt.master_params for k, v in opt.optimizer.state[m].items() if k != "step"
        ]
    return out


@pytest.mark.parametrize("state_format", STATE_FORMATS)
def test_master_weights_with_a_state_format_take_the_one_pass_kernel_bit_for_bit(state_format, monkeypatch):
    """The fp32-weight variant of the Triton kernels against the chunked engine (torch's CUDA fused
    kernel on the same fp32 masters): masters, codes and scales bit for bit over three steps."""
    from mixprec.optim import _triton_adam

    calls = []
    real = _triton_adam.step_unit
    monkeypatch.setattr(_triton_adam, "step_unit", lambda unit, *a: calls.append(1) or real(unit, *a))
    fast = _master_run(state_format, "1", monkeypatch)
    assert calls, "the kernel did not run"
    calls.clear()
    slow = _master_run(state_format, "0", monkeypatch)
    assert not calls
    for step, (got, want) in enumerate(zip(fast, slow, strict=True), 1):
        bad = [i for i, (a, b) in enumerate(zip(got, want, strict=True)) if not torch.equal(a, b)]
        assert not bad, (state_format, step, bad)


def test_first_master_step_with_bf16_state_is_torchs_fused_adamw_bit_for_bit(monkeypatch):
    """From fresh (zero) bf16 moments the first step's masters are torch's fused AdamW on fp32 copies."""
    monkeypatch.setenv("MIXPREC_FUSED_OPTIM", "1")
    model = _model()
    _backward(model, 1)
    copies = [nn.Parameter(p.detach().float()) for p in model.parameters()]
    for c, p in zip(copies, model.parameters(), strict=True):
        c.grad = p.grad.float()
    torch.optim.AdamW(copies, lr=1e-3, weight_decay=0.1, fused=True).step()
    opt = MixedPrecisionOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1), scaler=None, state_format="bf16"
    )
    opt.step()
    for master, copy in zip(opt.master_params, copies, strict=True):
        assert torch.equal(master, copy.detach())
