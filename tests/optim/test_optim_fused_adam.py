"""The fused pure-bf16 Adam/AdamW path: torch's fused kernel as the oracle, bytes, no freezing, the guard."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from mixprec.amp import initialize
from mixprec.optim import CompensatedOptimizer
from mixprec.optim.rounding import (
    CHUNK,
    CUDA_CHUNK,
    KEEP_HIGH_16_BITS,
    POOL,
    RandomBits,
    Workspace,
    add_fresh_bits,
)
from mixprec.optim.state_formats import MOMENTS, ORIGINS, block_count, new_moments, scale_key

BF16, FP32 = torch.bfloat16, torch.float32


def mlp(seed=0, width=16):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, 4)).to(BF16)


def backward(model, seed):
    g = torch.Generator().manual_seed(seed)
    model.zero_grad()
    model(torch.randn(16, 8, generator=g).to(BF16)).float().square().mean().backward()


def tensor_bytes(tensors):
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


@pytest.mark.parametrize(
    ("make", "state", "per_param"),
    [
        (lambda ps: torch.optim.AdamW(ps, lr=1e-3), {"exp_avg": BF16, "exp_avg_sq": FP32}, 12),
        (
            lambda ps: torch.optim.AdamW(ps, lr=1e-3, betas=(0.9, 0.99)),
            {"exp_avg": BF16, "exp_avg_sq": BF16},
            10,
        ),
    ],
)
def test_bytes_per_parameter_counted_from_the_tensors(make, state, per_param):
    """Weight, gradient, Kahan buffer and first moment in bf16; the second moment fp32 only at beta2 0.999."""
    model = mlp()
    opt = CompensatedOptimizer(make(model.parameters()), "kahan")
    backward(model, 0)
    opt.step()
    params = list(model.parameters())
    for s in opt.state.values():
        assert {k: v.dtype for k, v in s.items() if k != "step"} == state
    moments = [v for s in opt.state.values() for k, v in s.items() if k != "step"]
    held = tensor_bytes([*params, *(p.grad for p in params), *opt.compensation, *moments])
    assert held == per_param * sum(p.numel() for p in params)


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1),
        lambda ps: torch.optim.Adam(ps, lr=1e-3, weight_decay=0.1, maximize=True),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.8, 0.99), eps=1e-6),
    ],
)
def test_first_step_is_torch_fused_adam_on_an_fp32_copy_bit_for_bit(make):
    model = mlp()
    backward(model, 1)
    params = list(model.parameters())
    copies = [nn.Parameter(p.detach().float()) for p in params]
    for c, p in zip(copies, params, strict=True):
        c.grad = p.grad.float()
    oracle = make(copies)
    for group in oracle.param_groups:
        group["fused"] = True  # torch's own fused kernel (the one behind AdamW(fused=True))
    oracle.step()
    opt = CompensatedOptimizer(make(params), "kahan")
    opt.step()
    for p, c, kahan in zip(params, copies, opt.compensation, strict=True):
        assert torch.equal(p, c.detach().to(BF16))  # w = round(t)
        assert torch.equal(kahan, (c.detach() - p.float()).to(BF16))  # c = round(t - w)
        ours, torchs = opt.state[p], oracle.state[c]
        assert torch.equal(ours["exp_avg"], torchs["exp_avg"].to(BF16))
        assert torch.equal(ours["exp_avg_sq"], torchs["exp_avg_sq"].to(ours["exp_avg_sq"].dtype))
        assert torch.equal(ours["step"], torchs["step"])


@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.9, 0.99)])
def test_chunking_through_a_small_workspace_changes_no_bit(betas):
    """Chunks are slices of the flattened tensors (a big one spans chunks, small ones share one)."""
    runs = []
    for scratch in (None, 37):
        model = mlp()
        opt = CompensatedOptimizer(torch.optim.AdamW(model.parameters(), betas=betas), scratch_numel=scratch)
        for step in range(5):
            backward(model, step)
            opt.step()
        runs.append((list(model.parameters()), opt.compensation, opt.state_dict()["optimizer"]["state"]))
    (p1, c1, s1), (p2, c2, s2) = runs
    assert all(torch.equal(a, b) for a, b in zip(p1 + c1, p2 + c2, strict=True))
    assert all(torch.equal(s1[i][k], s2[i][k]) for i in s1 for k in s1[i])


def test_second_moment_keeps_moving_at_beta2_0999():
    """A bf16 exp_avg_sq freezes once (1 - beta2) * g**2 is under half its ulp; the fp32 one follows torch."""
    weight = nn.Parameter(torch.zeros(64, dtype=BF16))
    reference = nn.Parameter(torch.zeros(64))
    opt = CompensatedOptimizer(torch.optim.Adam([weight], lr=1e-4), "kahan")
    oracle = torch.optim.Adam([reference], lr=1e-4, fused=True)
    for _ in range(3000):
        weight.grad = torch.full_like(weight, 2**-7)  # exact in bf16
        reference.grad = torch.full_like(reference, 2**-7)
        opt.step()
        oracle.step()
    ours, torchs = opt.state[weight]["exp_avg_sq"], oracle.state[reference]["exp_avg_sq"]
    assert torch.allclose(ours, torchs, rtol=1e-5)
    assert torchs[0] > 0.9 * 2**-14  # (1 - 0.999**3000) * g**2
    frozen = torch.zeros((), dtype=BF16)
    for _ in range(3000):
        frozen = frozen * 0.999 + 1e-3 * torch.tensor(2**-14, dtype=BF16)  # what a bf16 state computes
    assert frozen < 0.75 * torchs[0]


@pytest.mark.parametrize("method", ["kahan", "stochastic"])
def test_a_huge_finite_gradient_is_skipped_not_written_into_the_state(method):
    """x1e30 squared overflows fp32: torch's own AdamW state turns inf and the weight never moves again."""
    model = mlp()
    opt = CompensatedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), method, seed=0)
    for step in range(3):
        backward(model, step)
        opt.step()
    before = (copy.deepcopy(list(model.parameters())), copy.deepcopy(opt.state_dict()))
    backward(model, 3)
    for p in model.parameters():
        p.grad.mul_(1e30)
    with pytest.warns(RuntimeWarning, match="skipped an optimizer step"):
        opt.step()
    assert opt.last_step_skipped and opt.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before[0], model.parameters(), strict=True))
    saved = opt.state_dict()["optimizer"]["state"]
    assert all(
        torch.equal(before[1]["optimizer"]["state"][i][k], saved[i][k]) for i in saved for k in saved[i]
    )
    for step in range(4, 8):
        backward(model, step)
        opt.step()
    assert not opt.last_step_skipped
    assert all(torch.isfinite(v).all() for s in opt.state.values() for v in s.values())
    assert not all(torch.equal(a, b) for a, b in zip(before[0], model.parameters(), strict=True))
    # torch's AdamW on fp32 weights takes the same gradient and freezes: exp_avg_sq = inf, update 0 forever
    weight = nn.Parameter(torch.ones(4))
    plain = torch.optim.AdamW([weight], lr=1e-3)
    weight.grad = torch.full((4,), 1e27)
    plain.step()
    assert torch.isinf(plain.state[weight]["exp_avg_sq"]).all()


def test_a_nan_in_one_group_leaves_every_group_unchanged():
    model = mlp()
    groups = [
        {"params": [model[0].weight, model[0].bias]},
        {"params": model[2].parameters(), "weight_decay": 0},
    ]
    opt = CompensatedOptimizer(torch.optim.AdamW(groups, lr=1e-3), "kahan")
    backward(model, 0)
    opt.step()
    weights = copy.deepcopy(list(model.parameters()))
    backward(model, 1)
    model[2].bias.grad[0] = float("nan")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        opt.step()
    assert opt.last_step_skipped
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters(), strict=True))
    assert all(s["step"] == 1 for s in opt.state.values())


def test_bf16_true_checks_inside_the_update_pass_and_counts_skips():
    model = mlp().float()
    model, opt = initialize(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3), "bf16-true", weight_update="kahan"
    )
    assert not opt.scaler.is_enabled() and opt.optimizer.skip_nonfinite  # no separate gradient pass
    opt.zero_grad()
    opt.backward(model(torch.randn(4, 8)).float().sum() * float("inf"))
    with pytest.warns(RuntimeWarning, match="skipped an optimizer step"):
        opt.step()
    assert opt.last_step_skipped and opt.skipped_steps == 1 and opt.loss_scale == 1.0
    fresh = mlp().float()
    _, unguarded = initialize(
        fresh, torch.optim.AdamW(fresh.parameters()), "bf16-true", weight_update="kahan", loss_scale=None
    )
    assert not unguarded.optimizer.skip_nonfinite  # loss_scale=None: no check, as torch


def test_random_bit_pool_holds_every_pattern_equally_and_rounds_without_bias():
    bits = RandomBits(torch.device("cpu"))
    counts = torch.bincount(bits.pool[:POOL], minlength=2**16)
    assert counts.min() == counts.max() == POOL // 2**16
    assert torch.equal(bits.pool[:POOL], bits.pool[POOL:])
    # 1 + 0.3 ulp (ulp 2**-7 above 1.0): each element rounds up with probability 0.3, step after step
    value = torch.tensor(1 + 0.3 * 2**-7)
    generator = torch.Generator().manual_seed(0)
    ups = torch.zeros(3 * POOL // 2)
    draws = 400
    for _ in range(draws):
        flat = torch.full((3 * POOL // 2,), value.item())
        view = flat.view(torch.int32)
        bits.add_(view, generator)
        view.bitwise_and_(KEEP_HIGH_16_BITS)
        assert set(flat.to(BF16).unique().tolist()) <= {1.0, 1.0 + 2**-7}
        ups += flat > 1
    frequency = ups / draws
    assert frequency.mean().item() == pytest.approx(0.3, abs=0.003)  # all values, all draws
    spread = (0.3 * 0.7 / draws) ** 0.5
    assert (frequency[:1000] - 0.3).abs().max() < 5 * spread  # each element over its own draws


def test_fresh_bits_as_a_cuda_chunk_draws_them_round_a_big_chunk_without_bias():
    """The bits every chunk gets on a CUDA device (``add_fresh_bits``, whatever the chunk's size; a CPU chunk
    this big reads the pool), drawn here for CPU tensors: each 16-bit pattern about equally often, and
    1 + 0.3 ulp rounds up with probability 0.3, element by element."""
    generator = torch.Generator().manual_seed(0)
    n = 3 * POOL // 2
    draws = torch.empty((2**22 + 3) // 4, dtype=torch.int64)
    bits = torch.zeros(2**22, dtype=torch.int32)
    add_fresh_bits(bits, generator, draws)
    counts = torch.bincount(bits, minlength=2**16)
    assert counts.numel() == 2**16 and bits.min() >= 0  # every value in [0, 2**16)
    assert 20 < counts.min() and counts.max() < 120  # 64 expected per pattern, sd 8
    value = torch.tensor(1 + 0.3 * 2**-7)
    ups = torch.zeros(n)
    repeats = 400
    for _ in range(repeats):
        flat = torch.full((n,), value.item())
        view = flat.view(torch.int32)
        add_fresh_bits(view, generator, draws)
        view.bitwise_and_(KEEP_HIGH_16_BITS)
        assert set(flat.to(BF16).unique().tolist()) <= {1.0, 1.0 + 2**-7}
        ups += flat > 1
    frequency = ups / repeats
    assert frequency.mean().item() == pytest.approx(0.3, abs=0.003)
    spread = (0.3 * 0.7 / repeats) ** 0.5
    assert (frequency - 0.3).abs().max() < 6 * spread  # each of the 393,216 elements over its own draws


# Cut inside tensors by the CPU's CHUNK and by 1000 values, odd tails (a short last block and vector)
SIZES = ((517, 600), (1001,), (700, 333), (37,))


def _grid_restarting(opt, param, fmt, origins):
    """Zero state for ``param`` on a block grid that restarts at ``origins``, as a resharded state's."""
    state = {"step": torch.zeros(()), **new_moments(fmt, param), ORIGINS: torch.tensor(origins)}
    for key in MOMENTS if fmt != "bf16" else ():
        state[scale_key(key)] = torch.zeros(block_count(param.numel(), origins))
    opt.state[param] = state


@pytest.mark.parametrize(
    ("method", "state_format", "betas"),
    [
        ("kahan", None, (0.9, 0.999)),  # an fp32 second moment, stepped where it lies
        ("kahan", None, (0.9, 0.95)),  # a bf16 one, through a copy
        ("kahan", "int8", (0.9, 0.95)),
        ("nearest", "int8", (0.9, 0.999)),
        ("nearest", "fp8", (0.9, 0.95)),
        ("nearest", "bf16", (0.9, 0.95)),
    ],
)
def test_the_cpu_and_cuda_chunk_sizes_step_bit_for_bit_alike(method, state_format, betas):
    """Kahan and nearest rounding, torch's layout and every state format give the same bits whether the
    workspace holds 1000 values, the CPU's ``CHUNK`` or the CUDA device's ``CUDA_CHUNK`` (one chunk here):
    a tensor is cut only at vector or block edges, the low-bit grid of one tensor restarting inside it
    (a resharded state's ``block_origins``) included."""
    runs = []
    for chunk in (1000, CHUNK, CUDA_CHUNK):
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn(size).to(BF16)) for size in SIZES]
        inner = torch.optim.AdamW(params, lr=1e-2, betas=betas, weight_decay=0.1)
        opt = CompensatedOptimizer(inner, method, state_format=state_format)
        opt.workspace = Workspace(chunk, chunk)
        if state_format is not None:
            _grid_restarting(opt, params[0], state_format, [0, 1000, 300_000])
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            for p in params:
                p.grad = torch.randn(p.shape, generator=g).to(BF16)
            opt.step()
        state = opt.state_dict()["optimizer"]["state"]
        runs.append(
            [p.detach() for p in params] + opt.compensation + [v for s in state.values() for v in s.values()]
        )
    for other in runs[1:]:
        assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(runs[0], other, strict=True))


@pytest.mark.parametrize("update", ["kahan", "stochastic"])
def test_a_long_run_at_default_betas_with_gradient_spikes_ends_where_the_clean_run_does(update):
    """400 steps of a regression at torch's default betas: inf, nan and x1e30 spikes are skipped, the run
    ends within 2% of the clean one's loss, and both within 5% of fp32 AdamW's (bf16 rounding)."""
    g = torch.Generator().manual_seed(0)
    x, w_true = torch.randn(256, 8, generator=g), torch.randn(8, 4, generator=g)
    y = x @ w_true

    def run(spikes, precision):
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        if precision == "fp32":
            model, opt = initialize(model, optimizer, "O0")
        else:
            model, opt = initialize(model, optimizer, "bf16-true", weight_update=precision)
        for step in range(400):
            opt.zero_grad()
            loss = (model(x).float() - y).square().mean()
            opt.backward(loss * spikes.get(step, 1.0))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                opt.step()
        assert all(
            torch.isfinite(v).all() for s in opt.state.values() for v in s.values() if torch.is_tensor(v)
        )
        return (model(x).float() - y).square().mean().item(), opt.skipped_steps

    spikes = {50: float("inf"), 120: float("nan"), 200: 1e30, 201: 1e30, 300: -1e30}
    clean, skipped_clean = run({}, update)
    spiked, skipped = run(spikes, update)
    reference, _ = run({}, "fp32")
    assert skipped_clean == 0 and skipped == len(spikes)
    assert spiked == pytest.approx(clean, rel=0.02)
    assert clean == pytest.approx(reference, rel=0.05)


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: CompensatedOptimizer(torch.optim.Adam(ps, lr=1e-3), "kahan", state_dtype=torch.float32),
        lambda ps: CompensatedOptimizer(torch.optim.RMSprop(ps, lr=1e-3), "stochastic"),  # the generic path
        lambda ps: CompensatedOptimizer(torch.optim.SGD(ps, lr=1e-3, momentum=0.9), "kahan"),
    ],
)
def test_the_unfused_paths_skip_huge_gradients_too(make):
    model = mlp()
    opt = make(list(model.parameters()))
    backward(model, 0)
    opt.step()
    before = copy.deepcopy(opt.state_dict())
    backward(model, 1)
    model[0].weight.grad[0, 0] = 1e30
    with pytest.warns(RuntimeWarning, match="skipped an optimizer step"):
        opt.step()
    after = opt.state_dict()["optimizer"]["state"]
    saved = before["optimizer"]["state"]
    assert all(
        torch.equal(saved[i][k], after[i][k]) for i in saved for k in saved[i] if torch.is_tensor(saved[i][k])
    )
