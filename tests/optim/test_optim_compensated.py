"""CompensatedOptimizer: pure bf16 weights with Kahan-compensated or stochastically rounded updates."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from mixprec.optim import CompensatedOptimizer

BF16, FP32 = torch.bfloat16, torch.float32


def small_updates(method, steps=200, size=4096, grad=1e-4):
    """``size`` bf16 weights at 1.0, each step moving them by -``grad``: returns the final weights."""
    weight = nn.Parameter(torch.ones(size, dtype=torch.bfloat16))
    inner = torch.optim.SGD([weight], lr=1.0)
    opt = inner if method is None else CompensatedOptimizer(inner, method, seed=0)
    for _ in range(steps):
        weight.grad = torch.full_like(weight, grad)
        opt.step()
    return weight, opt


def test_plain_bf16_stalls_while_kahan_and_stochastic_rounding_move():
    plain, _ = small_updates(None)
    assert torch.all(plain == 1.0)  # 1 - 1e-4 rounds back to 1 in bf16, every step
    movement = 200 * torch.tensor(1e-4, dtype=torch.bfloat16).item()
    kahan, opt = small_updates("kahan", size=4)
    tracked = kahan.float() + opt.compensation[0].float()  # what Kahan tracks: weight + carried error
    # The bf16 compensation buffer itself rounds: within 1% of the movement (plain bf16 misses all of it).
    assert torch.all((tracked - (1 - movement)).abs() < 0.01 * movement)
    assert torch.all((kahan.float() - (1 - movement)).abs() <= 2.0**-8)  # within one bf16 ulp
    rounded, _ = small_updates("stochastic", size=2**16)
    assert rounded.float().mean().item() == pytest.approx(1 - movement, abs=0.01 * movement)  # unbiased


def test_stochastic_rounding_rounds_up_with_the_dropped_fraction():
    weight = nn.Parameter(torch.ones(100_000, dtype=torch.bfloat16))
    opt = CompensatedOptimizer(torch.optim.SGD([weight], lr=1.0), "stochastic", seed=1)
    weight.grad = torch.full_like(weight, -(2.0**-9))  # a quarter of the bf16 gap above 1.0 (2**-7)
    opt.step()
    assert set(weight.unique().tolist()) == {1.0, 1.0 + 2.0**-7}
    assert (weight > 1).float().mean().item() == pytest.approx(0.25, abs=0.01)


def mlp(seed=0, dtype=torch.bfloat16):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(dtype)


def train(model, opt, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 8, generator=g).to(model[0].weight.dtype)
        opt.zero_grad()
        model(x).float().square().mean().backward()
        opt.step()


@pytest.mark.parametrize("method", ["kahan", "stochastic"])
def test_chunked_scratch_equals_one_chunk_bit_for_bit(method):
    results = []
    for scratch_numel in (None, 20):  # 20 elements: every chunk holds one small param or less
        model = mlp()
        opt = CompensatedOptimizer(
            torch.optim.Adam(model.parameters(), lr=1e-3), method, seed=3, scratch_numel=scratch_numel
        )
        train(model, opt, 5)
        results.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def test_fp32_params_step_once_per_step_whatever_the_chunking():
    model = mlp()
    model[2].float()
    reference = copy.deepcopy(model[2])
    opt = CompensatedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), scratch_numel=16)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        for p, r in zip(model[2].parameters(), reference.parameters(), strict=True):
            p.grad = torch.ones_like(p)
            r.grad = torch.ones_like(r)
        model[0].weight.grad = torch.ones_like(model[0].weight)
        opt.step()
        ref_opt.step()
    assert all(torch.equal(p, r) for p, r in zip(model[2].parameters(), reference.parameters(), strict=True))
    assert model[2].weight.grad is not None  # the caller's gradients are handed back


@pytest.mark.parametrize(
    ("make", "state_dtype"),
    [
        # beta2 0.999: 1e-3 is under half a bf16 ulp, so exp_avg_sq stays fp32; beta1 0.9 moves in bf16
        (lambda ps: torch.optim.Adam(ps, lr=1e-3), {"exp_avg": BF16, "exp_avg_sq": FP32}),
        (lambda ps: torch.optim.Adam(ps, lr=1e-3, betas=(0.9, 0.99)), {"exp_avg": BF16, "exp_avg_sq": BF16}),
        (lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9), {"momentum_buffer": BF16}),
        (lambda ps: torch.optim.RMSprop(ps, lr=1e-3), {"square_avg": FP32}),  # generic path: fp32 state
    ],
)
def test_groups_hold_the_model_weights_and_state_is_bf16_where_the_method_allows(make, state_dtype):
    model = mlp()
    opt = CompensatedOptimizer(make(model.parameters()))
    train(model, opt, 2)
    assert [p for g in opt.param_groups for p in g["params"]] == list(model.parameters())
    assert len(opt.state) == len(list(model.parameters()))
    for state in opt.state.values():
        assert {k: v.dtype for k, v in state.items() if k in state_dtype} == state_dtype


@pytest.mark.parametrize("method", ["kahan", "stochastic"])
def test_resume_from_state_dict_is_bit_identical(method):
    def make():
        model = mlp()
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return model, CompensatedOptimizer(inner, method, seed=7)

    model, opt = make()
    train(model, opt, 6, seed=0)
    straight = [p.detach().clone() for p in model.parameters()]

    model, opt = make()
    train(model, opt, 3, seed=0)
    checkpoint = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    train(model, opt, 2, seed=5)  # diverge, then come back
    model, opt = make()
    model.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["opt"])
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        torch.randn(16, 8, generator=g)  # replay the data stream to step 3
    for _ in range(3):
        x = torch.randn(16, 8, generator=g).bfloat16()
        opt.zero_grad()
        model(x).float().square().mean().backward()
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(straight, model.parameters(), strict=True))


def test_state_dict_fields():
    model = mlp()
    opt = CompensatedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), "kahan")
    train(model, opt, 2)
    state = opt.state_dict()
    assert state["method"] == "kahan" and len(state["compensation"]) == 4
    assert all(c.dtype == torch.bfloat16 for c in state["compensation"])
    assert any(c.abs().sum() > 0 for c in state["compensation"])


def test_skipped_steps_survive_a_checkpoint_and_a_bad_count_is_refused():
    """A skipped step counted before a checkpoint is still counted after resuming from it (the count
    restarted at 0 before it was saved); an older state dict without it leaves the count alone."""
    model = mlp()
    opt = CompensatedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), "kahan")
    train(model, opt, 1)
    for p in model.parameters():
        p.grad = torch.full_like(p, float("nan"))
    with pytest.warns(RuntimeWarning, match="1 such step"):
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    assert saved["skipped_steps"] == 1
    resumed = CompensatedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), "kahan")
    resumed.load_state_dict(saved)
    assert resumed.skipped_steps == 1
    older = {k: v for k, v in saved.items() if k != "skipped_steps"}
    resumed.skipped_steps = 5
    resumed.load_state_dict(older)
    assert resumed.skipped_steps == 5
    before = copy.deepcopy(resumed.state_dict())
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(
            ValueError, match=rf"state_dict\['skipped_steps'\] must be an int >= 0, got {bad!r}"
        ):
            resumed.load_state_dict({**saved, "skipped_steps": bad})
    after = resumed.state_dict()
    assert after["skipped_steps"] == 5
    assert all(torch.equal(a, b) for a, b in zip(before["compensation"], after["compensation"], strict=True))


def test_errors_name_the_bad_value():
    model = mlp()
    with pytest.raises(
        ValueError,
        match=r"unknown compensation method 'kahn'; accepted: \['kahan', 'nearest', 'stochastic'\]",
    ):
        CompensatedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), "kahn")
    with pytest.raises(ValueError, match="cannot round to torch.float16"):
        CompensatedOptimizer(torch.optim.SGD(mlp(dtype=torch.float16).parameters(), lr=0.1), "stochastic")
    with pytest.raises(ValueError, match="scratch_numel must be a positive int"):
        CompensatedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), scratch_numel=0)
    stepped = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 8).bfloat16()).sum().backward()
    stepped.step()
    with pytest.raises(ValueError, match="before its first step"):
        CompensatedOptimizer(stepped)
    kahan = CompensatedOptimizer(torch.optim.SGD(mlp().parameters(), lr=0.1), "kahan")
    rounding = CompensatedOptimizer(torch.optim.SGD(mlp().parameters(), lr=0.1), "stochastic")
    with pytest.raises(ValueError, match="saved with method 'stochastic', this is 'kahan'"):
        kahan.load_state_dict(rounding.state_dict())
    with pytest.raises(ValueError, match="closure"):
        kahan.step(lambda: 0.0)


def test_under_loss_scaling_the_model_grads_are_unscaled_and_clipped():
    from mixprec.optim import MixedPrecisionOptimizer
    from mixprec.scaling import GradScaler

    weight = nn.Parameter(torch.ones(64, dtype=torch.float16))
    inner = CompensatedOptimizer(torch.optim.SGD([weight], lr=1.0), "kahan")
    scaler = GradScaler("cpu", init_scale=1024.0, allow_fp16_grads=True)
    opt = MixedPrecisionOptimizer(inner, scaler=scaler, master_weights=False)
    for _ in range(100):
        opt.zero_grad()
        opt.backward((weight.float() * 1e-4).sum())
        norm = opt.clip_master_grads(1.0)
        opt.step()
    assert norm.item() == pytest.approx(8e-4, rel=1e-2)  # unscaled: sqrt(64) * 1e-4
    assert torch.all((weight.float() - 0.99).abs() <= 2.0**-10)  # fp16 alone would stay at 1.0


def test_add_param_group_gets_compensation():
    model = mlp()
    opt = CompensatedOptimizer(torch.optim.SGD(model[0].parameters(), lr=0.1), "kahan")
    opt.add_param_group({"params": model[2].parameters(), "lr": 0.01})
    assert len(opt.model_params) == len(opt.compensation) == 4
    assert opt.param_groups[1]["params"] == list(model[2].parameters())
    train(model, opt, 1)
    assert opt.compensation[3].abs().sum() > 0  # the new group's bias was stepped with compensation


def test_lr_scheduler_drives_the_inner_optimizer():
    model = mlp()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = CompensatedOptimizer(inner)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    train(model, opt, 1)
    schedule.step()
    assert inner.param_groups[0]["lr"] == 0.05


def test_state_dtype_follows_whether_a_bf16_average_can_move():
    from mixprec.optim.updates import moment_dtypes

    one = torch.ones(1, dtype=torch.bfloat16)
    assert torch.equal(one * 0.999, one) and not torch.equal(one * 0.99, one)  # why beta2 0.999 stays fp32
    assert moment_dtypes(BF16, "adam", {"betas": (0.9, 0.999)}) == (BF16, FP32)
    assert moment_dtypes(BF16, "adam", {"betas": (0.9, 0.99)}) == (BF16, BF16)
    assert moment_dtypes(BF16, "adam", {"betas": (0.999, 0.999)}) == (FP32, FP32)
    assert moment_dtypes(BF16, "sgd", {"momentum": 0.999}) == (FP32,)
    assert moment_dtypes(BF16, "sgd", {"momentum": 0}) == (BF16,)
    assert moment_dtypes(torch.float16, "adam", {"betas": (0.9, 0.99)}) == (FP32, FP32)  # fp16 range


def test_stochastic_rounding_with_bf16_adam_state_is_unbiased():
    weight = nn.Parameter(torch.ones(100_000, dtype=torch.bfloat16))
    inner = torch.optim.Adam([weight], lr=2.0**-9, betas=(0.9, 0.99), eps=1e-12)
    opt = CompensatedOptimizer(inner, "stochastic", seed=1)
    weight.grad = torch.full_like(weight, -1.0)  # Adam's first step: +lr, a quarter of the gap above 1.0
    opt.step()
    assert opt.state[weight]["exp_avg"].dtype == torch.bfloat16
    assert set(weight.unique().tolist()) == {1.0, 1.0 + 2.0**-7}
    assert (weight > 1).float().mean().item() == pytest.approx(0.25, abs=0.01)


def test_the_workspace_holds_no_more_than_the_tensors_stepped_and_is_not_pickled():
    model = mlp()
    opt = CompensatedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99)))
    train(model, opt, 2)
    numel = sum(p.numel() for p in model.parameters())
    assert all(0 < b.numel() <= numel for b in opt.workspace.buffers.values())
    assert copy.deepcopy(opt).workspace.buffers == {}


def test_fp32_params_warn_that_there_is_nothing_to_compensate():
    model = mlp(dtype=torch.float32)
    with pytest.warns(UserWarning, match=r"none of the optimizer's \d+ parameters is bfloat16 or float16"):
        opt = CompensatedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), "kahan")
    assert opt.compensation == []  # indeed nothing is kept for them
    reference = copy.deepcopy(model)
    torch_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for net, optimizer in ((model, opt), (reference, torch_opt)):
        net(torch.ones(2, 8)).sum().backward()
        optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters(), strict=True))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # bf16 weights (what it is for), or a low-bit state: no warning
        CompensatedOptimizer(torch.optim.SGD(mlp().parameters(), lr=0.1), "kahan")
        CompensatedOptimizer(torch.optim.AdamW(mlp(dtype=torch.float32).parameters()), state_format="int8")


def test_a_fresh_adagrad_is_wrapped_and_its_built_in_state_kept_fp32():
    """torch's Adagrad makes its state (``sum``, ``step`` 0) when built: that is not a step taken, so
    ``CompensatedOptimizer(torch.optim.Adagrad(bf16 params))`` is accepted (it was refused as an optimizer
    "before its first step"), its ``sum`` held in fp32 as the generic path's state is, and a state_format
    with it names the optimizer it needs."""
    model = mlp()
    reference = [nn.Parameter(p.detach().float()) for p in model.parameters()]
    opt = CompensatedOptimizer(torch.optim.Adagrad(model.parameters(), lr=0.1), "kahan")
    ref_opt = torch.optim.Adagrad(reference, lr=0.1)
    for p, r in zip(model.parameters(), reference, strict=True):
        p.grad = torch.full_like(p, 0.5)
        r.grad = torch.full_like(r, 0.5)
    opt.step()
    ref_opt.step()
    for p, r in zip(model.parameters(), reference, strict=True):  # one step: torch's fp32 step, rounded
        assert torch.equal(p, r.detach().bfloat16())
        assert opt.optimizer.state[p]["sum"].dtype == FP32
        assert torch.equal(opt.optimizer.state[p]["sum"], ref_opt.state[r]["sum"])
    with pytest.raises(ValueError, match="needs torch.optim.Adam or AdamW .* got Adagrad"):
        CompensatedOptimizer(torch.optim.Adagrad(mlp().parameters()), "kahan", state_format="fp8")
    stepped = opt.optimizer  # a step taken: refused as before
    with pytest.raises(ValueError, match="before its first step"):
        CompensatedOptimizer(stepped)
