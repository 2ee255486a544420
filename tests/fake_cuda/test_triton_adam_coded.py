"""The one-pass Triton Adam step with block-coded moments (``state_format="int8"`` / ``"fp8"``:
``mixprec.optim._triton_adam``'s ``adam_coded``) against the chunked engine, in the same run.

Under Triton's CPU interpreter on CPU tensors, as tests/fake_cuda/test_triton_adam.py (whose fixture and
exact fp32 helpers this file uses). The chunked engine steps with torch's CPU fused Adam, which computes
in double; here its ``fused_adam_`` is replaced by torch's CUDA fused kernel's operation order in fp32
(``_adam32``, the same the kernel follows), so everything else the engine does (decode, the Kahan
widening, encode with ``torch.bucketize`` / torch's e4m3 cast, rounding) is compared bit for bit: weights,
Kahan buffers, codes and scales. The engine's ``sqrt_`` (fp8's second moment, stored as its square
root) is given a correctly rounded fp32 square root too: torch's CPU one misrounds about one value in
six, its CUDA one (and the kernel's ``sqrt_rn``) is correctly rounded. The kernel's e4m3 cast is integer
arithmetic (the interpreter's own cast is wrong at binade edges), compared with torch's over every class
of fp32 value on its own. fp8's scale ``amax / 448`` is divided here, as torch's CPU divides; on CUDA
the kernel multiplies by the fp32 reciprocal, as torch's CUDA does: that branch is forced on the CPU
against an engine given CUDA's division, and a GPU run checks it as it runs
(``benchmarks/optimizer_speed.py``'s ``coded_vs_chunked_engine``). Stochastic rounding draws another
stream than the engine's, so there only the moments are bitwise.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from fake_cuda import test_triton_adam as torch_layout
from mixprec.optim import CompensatedOptimizer
from mixprec.optim.state_formats import MOMENTS, CodedMoments, scale_key

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),  # numpy's, in the interpreter: inf * 0
]

BF16, F32 = torch.bfloat16, torch.float32
GROUPS = torch_layout.GROUPS
interpret = torch_layout.interpret  # the fixture: Triton's interpreter with a true fp32 fma
SHAPES = [(37, 29), (1,), (512,), (3, 300)]  # a short last block, one value, whole blocks, two tensors odd
ALL_BF16 = (BF16,) * len(SHAPES)


def _cuda_adam_(group, params, grads, exp_avgs, exp_avg_sqs, steps) -> None:
    """``updates.fused_adam_`` in torch's CUDA kernel's fp32 operation order, in place."""
    for t, g, m, v, step in zip(params, grads, exp_avg_sqs and exp_avgs, exp_avg_sqs, steps, strict=True):
        new = torch_layout._adam32(t.clone(), g.clone(), m.clone(), v.clone(), step, group)
        for out, value in zip((t, m, v), new, strict=True):
            out.copy_(value)


@pytest.fixture
def coded(interpret, monkeypatch):
    """The interpreter, the chunked engine in CUDA's order, and a record of the kernel's launches."""
    from mixprec.optim import fused_adam

    monkeypatch.setattr(fused_adam, "fused_adam_", _cuda_adam_)
    # fp8's second moment: torch's CPU sqrt_ misrounds about one value in six; CUDA's is correctly rounded
    monkeypatch.setattr(torch.Tensor, "sqrt_", lambda self: self.copy_(torch_layout._sqrt32(self)))
    calls: list[object] = []
    real = interpret.step_unit
    monkeypatch.setattr(interpret, "step_unit", lambda unit, *a: calls.append(unit.moments) or real(unit, *a))
    return calls


def _grads(gen: torch.Generator, step: int) -> list[torch.Tensor]:
    """Magnitudes that vary by block (each block its own power of ten) and one all-zero block."""
    out = []
    for shape in SHAPES:
        n = torch.Size(shape).numel()
        exps = torch.randint(-6, 1, (-(-n // 256),), generator=gen).repeat_interleave(256)[:n]
        g = torch.randn(n, generator=gen) * 10.0 ** exps.float() / step
        if n >= 512:
            g[256:512] = 0
        out.append(g.reshape(shape).to(BF16))
    return out


def _run(monkeypatch, switch, fmt, name, method, steps=4, seed=0, dtypes=ALL_BF16):
    monkeypatch.setenv("MIXPREC_FUSED_OPTIM", switch)
    gen = torch.Generator().manual_seed(seed)
    params = [
        torch.nn.Parameter((torch.randn(s, generator=gen) * 0.3).to(d))
        for s, d in zip(SHAPES, dtypes, strict=True)
    ]
    group = GROUPS[name]
    cls = torch.optim.AdamW if group.get("decoupled_weight_decay") else torch.optim.Adam
    inner = cls(params, **{k: v for k, v in group.items() if k != "decoupled_weight_decay"})
    opt = CompensatedOptimizer(inner, method, seed=3, state_format=fmt)
    history = []
    for step in range(1, steps + 1):
        for p, g in zip(params, _grads(gen, step), strict=True):
            p.grad = g.to(p.dtype)
        opt.step()
        history.append(_snapshot(opt, params))
    return history


def _snapshot(opt, params) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in params] + [c.clone() for c in opt.compensation]
    for p in params:
        state = opt.optimizer.state[p]
        out += [state[key].clone() for key in (*MOMENTS, *map(scale_key, MOMENTS)) if key in state]
    return out


def _mismatch(a: torch.Tensor, b: torch.Tensor) -> int:
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    assert a.dtype == b.dtype and a.shape == b.shape
    return int((a.view(bits) != b.view(bits)).sum())


@pytest.mark.parametrize("fmt", ["int8", "fp8", "bf16"])
@pytest.mark.parametrize("name", list(GROUPS))
@pytest.mark.parametrize("method", ["kahan", "nearest"])
def test_steps_are_the_chunked_engines_bit_for_bit(coded, monkeypatch, fmt, name, method):
    """Decoupled and L2 decay, none with maximize; four steps; odd sizes, a zero block (its absmax the
    floor 1e-12), blocks of magnitudes 1e-6 to 1. ``"bf16"`` (no scales) steps through the torch-layout
    kernel with both moments in bf16."""
    fast = _run(monkeypatch, "1", fmt, name, method)
    assert len(coded) == 4 and all(isinstance(m, CodedMoments) for m in coded)
    slow = _run(monkeypatch, "0", fmt, name, method)
    assert len(coded) == 4
    for step, (got, want) in enumerate(zip(fast, slow, strict=True), 1):
        bad = [i for i, (a, b) in enumerate(zip(got, want, strict=True)) if _mismatch(a, b)]
        assert not bad, (step, bad)


@pytest.mark.parametrize("fmt", ["int8", "fp8", "bf16"])
@pytest.mark.parametrize("method", ["kahan", "stochastic"])
def test_fp32_weights_beside_bf16_ones_take_the_kernel_bit_for_bit(coded, monkeypatch, fmt, method):
    """A group of bf16 and fp32 weights (norms kept in fp32, masters): the fp32 ones are stepped and stored
    in fp32 as the engine steps them in place, without a Kahan buffer or rounding, in the same launch
    sequence (``"bf16"``: the torch-layout kernel). Under stochastic rounding only the bf16 weights draw
    bits (another stream than the engine's), so the fp32 weights and all moments are still bitwise.
    (Without a ``state_format`` the inner torch optimizer steps fp32 params, not these kernels.)"""
    dtypes = (BF16, F32, F32, BF16)
    fast = _run(monkeypatch, "1", fmt, "adamw", method, steps=3, dtypes=dtypes)
    assert len(coded) == 3
    slow = _run(monkeypatch, "0", fmt, "adamw", method, steps=3, dtypes=dtypes)
    assert len(coded) == 3
    stochastic = {i for i, d in enumerate(dtypes) if d == BF16} if method == "stochastic" else set()
    for step, (got, want) in enumerate(zip(fast, slow, strict=True), 1):
        assert got[1].dtype == F32 and got[2].dtype == F32
        bad = [
            i
            for i, (a, b) in enumerate(zip(got, want, strict=True))
            if _mismatch(a, b) and i not in stochastic
        ]
        assert not bad, (step, bad)


@pytest.mark.parametrize("fmt", ["int8", "fp8", "bf16"])
def test_master_weights_with_a_state_format_take_the_kernel(coded, monkeypatch, fmt):
    """``MixedPrecisionOptimizer``'s fp32 masters of bf16 weights with low-bit moments: one kernel launch
    per master, bit for bit the chunked engine (masters, the bf16 weights copied from them, codes,
    scales; ``"bf16"``: the torch-layout kernel, no scales)."""
    from mixprec.optim import MixedPrecisionOptimizer

    def run(switch):
        monkeypatch.setenv("MIXPREC_FUSED_OPTIM", switch)
        gen = torch.Generator().manual_seed(1)
        params = [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.3).to(BF16)) for s in SHAPES]
        opt = MixedPrecisionOptimizer(torch.optim.AdamW(params, lr=1e-2), scaler=None, state_format=fmt)
        assert all(m.dtype == F32 for m in opt.master_params) and len(opt.master_params) == len(params)
        out = []
        for step in range(1, 4):
            for p, g in zip(params, _grads(gen, step), strict=True):
                p.grad = g
            opt.step()
            states = [opt.optimizer.state[m] for m in opt.master_params]
            out.append(
                [p.detach().clone() for p in params]
                + [m.detach().clone() for m in opt.master_params]
                + [s[k].clone() for s in states for k in (*MOMENTS, *map(scale_key, MOMENTS)) if k in s]
            )
        return out

    fast = run("1")
    assert len(coded) == 3
    slow = run("0")
    assert len(coded) == 3
    for step, (got, want) in enumerate(zip(fast, slow, strict=True), 1):
        bad = [i for i, (a, b) in enumerate(zip(got, want, strict=True)) if _mismatch(a, b)]
        assert not bad, (step, bad)


def test_stochastic_rounding_keeps_the_moments_and_stays_within_an_ulp(coded, monkeypatch):
    """AdamW's moments do not read the weights: bitwise the engine's over three steps; after the first
    step each weight is the nearest-rounded one or its bf16 neighbour."""
    fast = _run(monkeypatch, "1", "int8", "adamw", "stochastic", steps=3)
    slow = _run(monkeypatch, "0", "int8", "adamw", "stochastic", steps=3)
    nearest = _run(monkeypatch, "0", "int8", "adamw", "nearest", steps=1)
    k = len(SHAPES)
    for got, want in zip(fast, slow, strict=True):
        assert all(not _mismatch(a, b) for a, b in zip(got[k:], want[k:], strict=True))
    for w, ref in zip(fast[0][:k], nearest[0][:k], strict=True):
        ulp = torch.finfo(BF16).eps * ref.float().abs().clamp(min=2**-126)
        assert bool(((w.float() - ref.float()).abs() <= ulp).all())
    assert any(_mismatch(w, ref) for w, ref in zip(fast[0][:k], nearest[0][:k], strict=True))


def _origins_unit(fmt: str, kahan: bool):
    """A param of 1000 values whose int8/fp8 state was resharded: its grid restarts at 300 and 701, so
    blocks are 256, 44, 256, 145, 256, 43 values long."""
    from mixprec.optim.fused_adam import AdamUnit

    gen = torch.Generator().manual_seed(9)
    p = (torch.randn(1000, generator=gen) * 0.3).to(BF16)
    p.grad = (torch.randn(1000, generator=gen) * 1e-3).to(BF16)
    codes = {"int8": torch.uint8, "fp8": torch.float8_e4m3fn}[fmt]
    state = {"step": torch.tensor(3.0), "block_origins": torch.tensor([0, 300, 701])}
    for key in MOMENTS:
        raw = torch.randint(0, 120, (1000,), generator=gen, dtype=torch.uint8)  # fp8: positive, below 448
        state[key] = raw if fmt == "int8" else raw.view(codes)
        state[scale_key(key)] = torch.rand(6, generator=gen) * 1e-3 + 1e-6
    c = torch.zeros_like(p) if kahan else None
    group = dict(GROUPS["adamw"])
    return AdamUnit(group, [state], [p], [c] if kahan else None, CodedMoments(fmt))


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_a_resharded_grid_is_stepped_run_by_run(coded, monkeypatch, fmt):
    from mixprec.optim.fused_adam import adam_step
    from mixprec.optim.rounding import Workspace

    out = []
    for switch in ("1", "0"):
        monkeypatch.setenv("MIXPREC_FUSED_OPTIM", switch)
        unit = _origins_unit(fmt, kahan=True)
        adam_step([unit], Workspace(), guard=False)
        state = unit.states[0]
        out.append([unit.params[0], unit.kahan[0], *(state[k] for k in (*MOMENTS, *map(scale_key, MOMENTS)))])
    assert len(coded) == 1
    assert [_mismatch(a, b) for a, b in zip(*out, strict=True)] == [0] * 6


def test_a_skipped_step_writes_nothing(coded, monkeypatch):
    """A non-finite gradient after a real step: weights, buffers, codes and scales as they were."""
    monkeypatch.setenv("MIXPREC_FUSED_OPTIM", "1")
    params = [torch.nn.Parameter(torch.randn(300).to(BF16))]
    opt = CompensatedOptimizer(torch.optim.AdamW(params), "kahan", state_format="int8")
    params[0].grad = torch.randn(300).to(BF16)
    opt.step()
    before = _snapshot(opt, params)
    params[0].grad = torch.full((300,), float("nan")).to(BF16)
    with pytest.warns(RuntimeWarning, match="skipped"):
        opt.step()
    assert all(not _mismatch(a, b) for a, b in zip(_snapshot(opt, params), before, strict=True))
    assert len(coded) == 1


def test_which_units_take_the_coded_kernel(coded, monkeypatch):
    """Codes or scales laid out otherwise than the format makes them, fp32 params, the switch: the
    chunked engine."""
    from mixprec.optim import _triton_adam

    monkeypatch.setenv("MIXPREC_FUSED_OPTIM", "1")
    unit = _origins_unit("int8", kahan=False)
    assert _triton_adam.takes(unit)
    state = unit.states[0]
    for key, bad in [
        ("exp_avg", state["exp_avg"].to(torch.int16)),  # another dtype
        ("exp_avg", state["exp_avg"].reshape(10, 100).t()),  # not contiguous, another shape
        ("exp_avg_scale", state["exp_avg_scale"][:5]),  # too few scales for the grid
        ("exp_avg_sq_scale", state["exp_avg_sq_scale"].double()),
    ]:
        good, state[key] = state[key], bad
        assert not _triton_adam.takes(unit), key
        state[key] = good
    monkeypatch.setenv("MIXPREC_FUSED_OPTIM", "0")
    assert not _triton_adam.takes(unit)
    monkeypatch.setenv("MIXPREC_FUSED_OPTIM", "1")
    unit.params = [unit.params[0].float()]
    unit.params[0].grad = torch.zeros(1000)
    assert _triton_adam.takes(unit)  # fp32 with an fp32 gradient, no Kahan buffer
    unit.kahan = [torch.zeros(1000, dtype=BF16)]
    assert not _triton_adam.takes(unit)  # fp32 with a Kahan buffer: the engine's to refuse
    unit.kahan = None
    unit.params = [unit.params[0].half()]
    unit.params[0].grad = torch.zeros(1000, dtype=torch.float16)
    assert not _triton_adam.takes(unit)  # fp16


def test_the_e4m3_cast_is_torchs(interpret):
    """Every class of fp32 value: subnormal results, ties either way, the top of the range, 448's
    neighbours up to 480 (nan from there), inf, nan, zeros of both signs; and random values."""
    kern = interpret._kernels(True)
    gen = torch.Generator().manual_seed(2)
    e4m3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    finite = e4m3[e4m3.isfinite()].unique()
    mids = (finite[:-1] + finite[1:]) / 2  # exact in fp32: every tie
    special = torch.tensor([0.0, -0.0, 448.0, 449.0, 463.9, 464.0, 464.1, 479.9, 480.0, 1e6, float("inf")])
    ties = [mids, mids.nextafter(torch.tensor(float("inf"))), mids.nextafter(torch.tensor(0.0))]
    wide = torch.randn(20000, generator=gen) * 10.0 ** torch.randint(-12, 3, (20000,), generator=gen).float()
    x = torch.cat([finite, *ties, special, torch.tensor([float("nan")]), wide])
    x = torch.cat([x, -x])
    out = torch.empty(x.numel(), dtype=torch.uint8)
    kern.cast_e4m3[(-(-x.numel() // 1024),)](x, out, x.numel(), BLOCK=1024)
    want = x.to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(out, want), x[out != want][:10]


@pytest.mark.parametrize("method", ["kahan", "nearest"])
def test_the_cuda_scale_branch_is_the_engines_with_cudas_division(coded, monkeypatch, method):
    """fp8's scale as a GPU computes it (``amax * fp32(1 / 448)``, torch's CUDA division by a Python number):
    the kernel's ``RECIPROCAL`` branch, forced on CPU tensors, against the engine whose ``amax / 448`` is
    made CUDA's; and the branch differs from the CPU's division somewhere, so the test sees it."""
    from mixprec.optim import _triton_adam, state_formats

    inverse = torch.tensor(1.0, dtype=F32) / 448.0
    monkeypatch.setattr(state_formats, "_fp8_scale", lambda amax: amax * inverse)
    monkeypatch.setattr(_triton_adam, "RECIPROCAL_DIVISION", ("cuda", "cpu"))
    fast = _run(monkeypatch, "1", "fp8", "adamw", method)
    slow = _run(monkeypatch, "0", "fp8", "adamw", method)
    for step, (got, want) in enumerate(zip(fast, slow, strict=True), 1):
        bad = [i for i, (a, b) in enumerate(zip(got, want, strict=True)) if _mismatch(a, b)]
        assert not bad, (step, bad)
    monkeypatch.undo()
    amax = torch.rand(100_000, generator=torch.Generator().manual_seed(1), dtype=F32)
    assert bool((amax * inverse != amax / 448.0).any())  # the two divisions differ: the branch matters


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_a_nan_gradient_unguarded_spreads_as_the_engines(coded, monkeypatch, fmt):
    """``skip_nonfinite=False`` and one nan in a gradient: the nan block's moments, scales and weights end
    as the engine's (a nan compared equal to a nan), the other blocks bit for bit."""
    from fake_cuda.bits import same_bits

    out = []
    for switch in ("1", "0"):
        monkeypatch.setenv("MIXPREC_FUSED_OPTIM", switch)
        gen = torch.Generator().manual_seed(5)
        p = torch.nn.Parameter((torch.randn(700, generator=gen) * 0.3).to(BF16))
        opt = CompensatedOptimizer(
            torch.optim.AdamW([p], lr=1e-3), "kahan", state_format=fmt, skip_nonfinite=False
        )
        for step in range(2):
            g = (torch.randn(700, generator=gen) * 1e-3).to(BF16)
            if step == 1:
                g[300] = float("nan")
            p.grad = g
            opt.step()
        state = opt.optimizer.state[p]
        out.append(
            [
                p.detach().clone(),
                opt.compensation[0].clone(),
                *(state[k].clone() for k in (*MOMENTS, *map(scale_key, MOMENTS))),
            ]
        )
    fast, slow = out
    for a, b in zip(fast, slow, strict=True):
        if a.dtype in (torch.uint8, torch.float8_e4m3fn):
            assert _mismatch(a, b) == 0
        else:
            assert same_bits(a, b)
    assert bool(torch.isnan(fast[0].float()).any())  # the nan reached the weights: the case is exercised
