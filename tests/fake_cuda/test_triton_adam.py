"""The one-pass Triton Adam/AdamW step (mixprec.optim._triton_adam) against a pure-torch reference.

Run under Triton's CPU interpreter (``TRITON_INTERPRET=1``, set per test) on CPU tensors, in the CUDA
build's environment, which has Triton. The reference follows torch's CUDA fused Adam kernel operation for
operation (fp32 hyperparameters, the fmas of ``adam_math``, correctly rounded ``/`` and ``sqrt``). The
interpreter's ``tl.fma`` multiplies and adds in two roundings, so the fixture gives it a true fp32 fma
(:func:`_fma32`, checked against exact rational arithmetic below); ``powf`` is torch's on the host in both
(the interpreter has no libdevice), libdevice's on a GPU, checked there by benchmarks/optimizer_speed.py.
"""

from __future__ import annotations

import importlib.util
import math
from fractions import Fraction

import pytest
import torch

from mixprec.optim import CompensatedOptimizer

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")

F32, BF16 = torch.float32, torch.bfloat16


def _fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 ``a * b + c`` rounded once: the product is exact in float64, the sum is rounded to odd there
    (its exact error by TwoSum), and rounding that to fp32 is the single rounding (29 spare bits)."""
    a, b, c = torch.broadcast_tensors(a.double(), b.double(), c.double())
    p = a * b
    s = p + c
    bb = s - p
    err = (p - (s - bb)) + (c - bb)
    even = (s.view(torch.int64) & 1) == 0
    towards = torch.where(err > 0, torch.full_like(s, math.inf), torch.full_like(s, -math.inf))
    s = torch.where((err != 0) & even, torch.nextafter(s, towards), s)
    return s.float()


def _sqrt32(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``sqrt`` correctly rounded (torch's CPU ``sqrt`` is off by an ulp now and then, e.g. at the
    bits 0x391ac17b): the float64 root's fp32 neighbour whose half-ulp interval holds ``x``, tested by
    squaring the midpoints, exact in float64."""
    r = torch.sqrt(x.double()).float()
    up, down = torch.nextafter(r, torch.full_like(r, math.inf)), torch.nextafter(r, torch.zeros_like(r))
    x64 = x.double()
    r = torch.where(((r.double() + up.double()) / 2) ** 2 < x64, up, r)
    return torch.where(((r.double() + down.double()) / 2) ** 2 > x64, down, r)


@pytest.fixture
def interpret(monkeypatch: pytest.MonkeyPatch):
    """Triton's CPU interpreter with a true fp32 fma; the module (imported here, it needs Triton)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("MIXPREC_FUSED_OPTIM", raising=False)
    import numpy as np
    from triton.runtime import interpreter

    def fma(self, x, y, z):
        out = _fma32(*(torch.from_numpy(np.ascontiguousarray(t.data)) for t in (x, y, z)))
        return interpreter.TensorHandle(out.numpy().astype(np.float32), z.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_fma", fma)
    from mixprec.optim import _triton_adam

    return _triton_adam


def test_the_gpu_kernel_compiles_with_torchs_rounding(monkeypatch):
    """For sm90: correctly rounded division and square root, the kernel's own fmas, no contraction, in the
    torch-layout kernel and the coded one (int8 and fp8). First in this file (and before
    test_triton_adam_coded.py): once an interpreted kernel has run in the process, Triton's compiler
    fails here."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from mixprec.optim import _triton_adam

    k = _triton_adam._kernels(False)
    args = "w_ptr c_ptr g_ptr m_ptr v_ptr step_ptr seed_ptr bc_ptr n index lr beta1 beta2 eps wd".split()
    types = dict.fromkeys(["w_ptr", "c_ptr", "g_ptr", "m_ptr"], "*i16") | {"seed_ptr": "*i64"}
    types |= {"v_ptr": "*fp32", "step_ptr": "*fp32", "bc_ptr": "*fp32", "n": "i32", "index": "i32"}
    signature = {a: types.get(a, "fp32") for a in args}
    consts = {"ADAMW": True, "DECAY": True, "MAXIMIZE": False, "ROUND": 1, "M_BF16": True}
    consts |= {"V_BF16": False, "PRECISE": True, "BLOCK": 1024, "W_F32": False}
    signature.update(dict.fromkeys(consts, "constexpr"))
    source = ASTSource(fn=k.adam, signature=signature, constexprs=consts)
    ptx = compile(source, target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False}).asm["ptx"]
    for needed in ("div.rn.f32", "sqrt.rn.f32", "fma.rn.f32"):
        assert needed in ptx, needed
    assert "div.full.f32" not in ptx and "sqrt.approx" not in ptx
    stochastic = ASTSource(fn=k.adam, signature=signature, constexprs={**consts, "ROUND": 2})
    assert "mul.hi.u32" in compile(stochastic, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    coded_args = ["w_ptr", "c_ptr", "g_ptr", "m_ptr", "ms_ptr", "v_ptr", "vs_ptr", "m_table", "m_mids",
                  "v_table", "v_mids", "step_ptr", "seed_ptr", "bc_ptr", "n", "start", "index"]  # fmt: skip
    types = dict.fromkeys(["w_ptr", "c_ptr", "g_ptr"], "*i16") | dict.fromkeys(["m_ptr", "v_ptr"], "*u8")
    types |= {"seed_ptr": "*i64", "n": "i32", "start": "i32", "index": "i32"}
    signature = {a: types.get(a, "*fp32") for a in coded_args}
    signature |= dict.fromkeys(["lr", "beta1", "beta2", "eps", "wd", "tiny", "q"], "fp32")
    consts = {"ADAMW": True, "DECAY": True, "MAXIMIZE": False, "ROUND": 1, "PRECISE": True, "ROWS": 4}
    consts |= {"BLOCK": 256, "RECIPROCAL": True}
    signature.update(dict.fromkeys([*consts, "FP8", "W_F32"], "constexpr"))
    wide = dict.fromkeys(["w_ptr", "c_ptr", "g_ptr"], "*fp32")  # an fp32 weight (masters), stored as stepped
    for fp8, w_f32 in ((False, False), (True, False), (False, True)):
        source = ASTSource(
            fn=k.adam_coded,
            signature=signature | wide if w_f32 else signature,
            constexprs={**consts, "FP8": fp8, "W_F32": w_f32, "ROUND": 0 if w_f32 else 1},
        )
        ptx = compile(source, target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False}).asm[
            "ptx"
        ]
        for needed in ("div.rn.f32", "sqrt.rn.f32", "fma.rn.f32"):
            assert needed in ptx, (fp8, needed)
        assert "div.full.f32" not in ptx and "sqrt.approx" not in ptx, fp8


def test_the_fma_is_rounded_once():
    g = torch.Generator().manual_seed(3)
    a = torch.randn(3000, generator=g)
    b = torch.randn(3000, generator=g)
    c = -(a.double() * b.double()).float() * (1 + torch.randn(3000, generator=g) * 2**-20)  # cancellation
    c[:1000] = torch.randn(1000, generator=g)
    got = _fma32(a, b, c)
    for x, y, z, r in zip(a.tolist(), b.tolist(), c.tolist(), got.tolist(), strict=True):
        exact = Fraction(x) * Fraction(y) + Fraction(z)
        low = torch.tensor(float(exact), dtype=torch.float64).float()  # near; then the two fp32 neighbours
        cands = {low.item(), torch.nextafter(low, torch.tensor(math.inf)).item(),
                 torch.nextafter(low, torch.tensor(-math.inf)).item()}  # fmt: skip
        best = min(cands, key=lambda q: (abs(Fraction(q) - exact), torch.tensor(q).view(torch.int32) & 1))
        assert r == best, (x, y, z)


def test_the_square_root_is_rounded_once():
    g = torch.Generator().manual_seed(4)
    x = torch.cat([torch.rand(2000, generator=g) * 10.0 ** torch.randint(-30, 30, (2000,), generator=g),
                   torch.tensor([0.0, 1.0, 4.0, 2.0]), torch.tensor([0x391AC17B]).view(F32)])  # fmt: skip
    got = _sqrt32(x)
    for value, root in zip(x.tolist(), got.tolist(), strict=True):
        exact = Fraction(value)
        below, above = (
            torch.nextafter(torch.tensor(root), torch.tensor(0.0)),
            torch.nextafter(torch.tensor(root), torch.tensor(math.inf)),
        )
        assert ((Fraction(below.item()) + Fraction(root)) / 2) ** 2 <= exact
        assert exact <= ((Fraction(above.item()) + Fraction(root)) / 2) ** 2


def _f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=F32)


def _nearest_bits(t: torch.Tensor) -> torch.Tensor:
    return t.to(BF16)


def _adam32(t, g, m, v, step, group):
    """torch's CUDA fused Adam/AdamW on fp32 ``t`` (the weight), ``g``, ``m``, ``v`` at fp32 ``step``,
    operation for operation; returns the new (t, m, v)."""
    lr, eps, wd = _f32(group["lr"]), _f32(group["eps"]), _f32(group["weight_decay"])
    b1, b2 = _f32(group["betas"][0]), _f32(group["betas"][1])
    if group.get("maximize", False):
        g = -g
    if wd.item() != 0:
        if group.get("decoupled_weight_decay", False):
            t = _fma32(t, -(lr * wd), t)
        else:
            g = _fma32(t, wd, g)
    m = _fma32(m, b1, _fma32(g, -b1, g))
    g2 = g * g
    v = _fma32(v, b2, _fma32(g2, -b2, g2))
    bc = 1 - torch.pow(torch.stack([b1, b2]), step)
    denom = _sqrt32(v) / _sqrt32(bc[1]) + eps
    return t - (lr / bc[0]) * m / denom, m, v


def _reference(w, c, g, m, v, step, group, rounding, moment_dtypes):
    """One step in torch's CUDA fused Adam order on fp32 copies; returns (w, c, m, v) as stored."""
    t = w.float() + c.float() if rounding == "kahan" else w.float()
    t, m, v = _adam32(t, g.float(), m.float(), v.float(), step, group)
    w_new = t.to(BF16)
    c_new = (t - w_new.float()).to(BF16) if rounding == "kahan" else c
    return w_new, c_new, m.to(moment_dtypes[0]), v.to(moment_dtypes[1]), t


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    bits = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.view(bits), b.view(bits))


def _unit(group, params, kahan, dtypes, generator=None):
    from mixprec.optim.fused_adam import AdamUnit
    from mixprec.optim.state_formats import TorchMoments
    from mixprec.optim.updates import new_states

    states = [{} for _ in params]
    unit = AdamUnit(group, states, params, kahan, TorchMoments(dtypes), generator)
    return unit, lambda: new_states(states, params, unit.moments.new)


GROUPS = {
    "adamw": {
        "lr": 1e-3,
        "betas": (0.9, 0.999),
        "eps": 1e-8,
        "weight_decay": 0.1,
        "decoupled_weight_decay": True,
    },
    "adam": {"lr": 3e-3, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.01},
    "adam_max": {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0, "maximize": True},
}


@pytest.mark.parametrize("name", list(GROUPS))
@pytest.mark.parametrize("rounding", ["kahan", "nearest"])
@pytest.mark.parametrize("second", [BF16, F32], ids=["v_bf16", "v_fp32"])
def test_steps_are_bitwise_the_reference(interpret, name, rounding, second):
    group = GROUPS[name]
    gen = torch.Generator().manual_seed(1)
    shapes = [(37, 29), (1,), (2051,)]  # odd sizes: partial blocks, a one-element tensor, two blocks
    params = [(torch.randn(s, generator=gen) * 0.5).to(BF16) for s in shapes]
    kahan = [torch.zeros_like(p) for p in params] if rounding == "kahan" else None
    dtypes = (BF16, second)
    ref = [
        [p.clone(), torch.zeros_like(p), torch.zeros_like(p, dtype=BF16), torch.zeros_like(p, dtype=second)]
        for p in params
    ]
    unit, count = _unit(group, params, kahan, dtypes)
    for step in range(1, 5):
        for p in params:
            p.grad = (torch.randn(p.shape, generator=gen) * 10.0**-step).to(BF16)
        count()
        interpret.step_unit(unit)
        for i, p in enumerate(params):
            w, c, m, v = ref[i]
            ref[i] = list(_reference(w, c, p.grad, m, v, _f32(float(step)), group, rounding, dtypes)[:4])
            state = unit.states[i]
            assert _same(p, ref[i][0]), (step, i)
            if kahan is not None:
                assert _same(kahan[i], ref[i][1]), (step, i)
            assert _same(state["exp_avg"], ref[i][2]) and _same(state["exp_avg_sq"], ref[i][3]), (step, i)


def _opt(params, method, fused_adamw=True, seed=0):
    inner = (
        torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)
        if fused_adamw
        else torch.optim.Adam(params, lr=1e-3)
    )
    return CompensatedOptimizer(inner, method, seed=seed)


def _model_step(monkeypatch, switch: str, method: str, steps: int = 1):
    monkeypatch.setenv("MIXPREC_FUSED_OPTIM", switch)
    gen = torch.Generator().manual_seed(5)
    params = [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.3).to(BF16)) for s in [(64, 33), (130,)]]
    opt = _opt(params, method)
    for _ in range(steps):
        for p in params:
            p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).to(BF16)
        opt.step()
    return params, opt


def test_the_first_step_is_the_chunked_engines(interpret, monkeypatch):
    """From fresh state, through CompensatedOptimizer: the kernel's Kahan step and the chunked engine's
    (torch's CPU fused AdamW on fp32 copies) agree bit for bit in the weights, buffers and first moments;
    the CPU kernel computes in double with the betas as given where CUDA's (and the kernel's) round them
    to fp32 first: ``1 - fp32(0.999)`` is ``0.001 * (1 - 1.29e-5)``, so the fp32 second moment differs by
    that share (plus an ulp) and a weight by at most one bf16 rounding."""
    calls = []
    monkeypatch.setattr(
        interpret, "step_unit", lambda *args, f=interpret.step_unit: calls.append(1) or f(*args)
    )
    fast, fast_opt = _model_step(monkeypatch, "1", "kahan")
    assert calls
    calls.clear()
    slow, slow_opt = _model_step(monkeypatch, "0", "kahan")
    assert not calls
    for a, b in zip(fast, slow, strict=True):
        diff = (a.float() - b.float()).abs()
        ulp = torch.finfo(BF16).eps * b.float().abs()
        assert bool((diff <= ulp).all()), diff.max()
        sa, sb = fast_opt.optimizer.state[a], slow_opt.optimizer.state[b]
        assert _same(sa["exp_avg"], sb["exp_avg"])
        beta2 = 0.999
        share = abs(_f32(beta2).double().item() - beta2) / (1 - beta2)
        torch.testing.assert_close(sa["exp_avg_sq"], sb["exp_avg_sq"], rtol=share + 2**-22, atol=0)


def test_later_steps_stay_with_the_chunked_engine(interpret, monkeypatch):
    fast, _ = _model_step(monkeypatch, "1", "kahan", steps=3)
    slow, _ = _model_step(monkeypatch, "0", "kahan", steps=3)
    for a, b in zip(fast, slow, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=2**-7, atol=1e-6)


def test_stochastic_rounding_is_unbiased(interpret):
    """Every element of one tensor steps to the same fp32 value between two bf16 neighbours; the share
    rounded up is that value's place between them, within 5 binomial standard deviations."""
    n = 8192
    group = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    w = torch.full((n,), 1.0, dtype=BF16)
    w.grad = torch.full((n,), 0.37, dtype=BF16)
    exact = _reference(w, w, w.grad, torch.zeros(n, dtype=BF16), torch.zeros(n), _f32(1.0), group, "nearest",
                       (BF16, F32))[4][0]  # fmt: skip
    bits = exact.view(torch.int32) & -65536  # positive: truncation gives the bf16 neighbour below
    lo, up = bits.view(F32), (bits + 65536).view(F32)
    frac = ((exact - lo) / (up - lo)).item()
    assert 0.05 < frac < 0.95
    unit, count = _unit(group, [w], None, (BF16, F32), torch.Generator().manual_seed(7))
    count()
    interpret.step_unit(unit)
    values = set(w.float().unique().tolist())
    assert values <= {lo.item(), up.item()}
    share = (w.float() == up).double().mean().item()
    assert abs(share - frac) <= 5 * math.sqrt(frac * (1 - frac) / n), (share, frac)


def _stochastic_step(interpret, seed: int, steps: int):
    group = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    out = []
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        w = torch.full((3000,), 1.0, dtype=BF16)
        w.grad = torch.full((3000,), 0.37, dtype=BF16)
        unit, count = _unit(group, [w], None, (BF16, F32), gen)
        count()
        interpret.step_unit(unit)
        out.append(w)
    return out


def test_stochastic_bits_differ_by_step_and_repeat_by_seed(interpret):
    first, second = _stochastic_step(interpret, 11, 2)
    assert not torch.equal(first, second)
    again = _stochastic_step(interpret, 11, 2)
    assert torch.equal(first, again[0]) and torch.equal(second, again[1])


def test_which_path_runs(monkeypatch):
    """A CPU tensor takes the kernel only under the interpreter; the switch and fp16 params keep the
    chunked engine (fp32 ones take the kernel); an int8 state takes the coded kernel."""
    from mixprec.optim import _triton_adam

    calls = []
    real = _triton_adam.step_unit
    monkeypatch.setattr(_triton_adam, "step_unit", lambda unit, *a: calls.append(unit) or real(unit, *a))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("MIXPREC_FUSED_OPTIM", raising=False)
    _model_step(monkeypatch, "1", "kahan")
    assert not calls
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _model_step(monkeypatch, "1", "kahan")
    assert len(calls) == 1
    _model_step(monkeypatch, "1", "stochastic")
    assert len(calls) == 2
    _model_step(monkeypatch, "0", "kahan")
    assert len(calls) == 2
    params = [torch.nn.Parameter(torch.randn(8, 8).to(BF16))]
    params[0].grad = torch.randn(8, 8).to(BF16)
    CompensatedOptimizer(torch.optim.AdamW(params), "kahan", state_format="int8").step()
    assert len(calls) == 2  # the switch still 0
    monkeypatch.setenv("MIXPREC_FUSED_OPTIM", "1")
    CompensatedOptimizer(torch.optim.AdamW(params), "kahan", state_format="int8").step()
    assert len(calls) == 3
    t = torch.nn.Parameter(torch.randn(8, 8).to(BF16)[:, ::2])  # not contiguous
    t.grad = torch.randn(8, 4).to(BF16)
    from mixprec.optim.fused_adam import AdamUnit
    from mixprec.optim.state_formats import TorchMoments

    unit = AdamUnit({"lr": 1e-3, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0}, [{}], [t], None,
                    TorchMoments((BF16, BF16)))  # fmt: skip
    assert not _triton_adam.takes(unit)
    unit.params = [torch.randn(8, 8, requires_grad=True)]
    unit.params[0].grad = torch.randn(8, 8)
    assert _triton_adam.takes(unit)  # fp32, its gradient fp32: stored as stepped
    unit.params = [torch.randn(8, 8, dtype=torch.float16, requires_grad=True)]
    unit.params[0].grad = torch.randn(8, 8, dtype=torch.float16)
    assert not _triton_adam.takes(unit)  # fp16: the chunked engine


def test_a_skipped_step_writes_nothing(interpret, monkeypatch):
    params = [torch.nn.Parameter(torch.randn(40).to(BF16))]
    opt = _opt(params, "kahan")
    params[0].grad = torch.full((40,), float("inf")).to(BF16)
    before = params[0].detach().clone()
    with pytest.warns(RuntimeWarning, match="skipped"):
        opt.step()
    assert torch.equal(params[0], before) and not opt.optimizer.state


@pytest.mark.parametrize("state_format", [None, "int8"])
def test_a_step_between_forward_and_backward_is_caught_as_torchs_is(interpret, monkeypatch, state_format):
    """The kernels write the weights through pointers; the step marks them modified in place, so a graph
    that saved a weight before the step fails in backward as it does after ``torch.optim.AdamW``'s step
    (and ``p._version`` counts the change), instead of computing gradients from the new weights."""
    calls = []
    monkeypatch.setattr(interpret, "step_unit", lambda *a, f=interpret.step_unit: calls.append(1) or f(*a))
    results = []
    for wrap in (lambda o: o, lambda o: CompensatedOptimizer(o, "kahan", state_format=state_format)):
        p = torch.nn.Parameter(torch.randn(300, generator=torch.Generator().manual_seed(3)).bfloat16())
        opt = wrap(torch.optim.AdamW([p], lr=1e-3, foreach=True))
        out = (p * p).sum()  # saves p for its backward
        p.grad = torch.ones_like(p)
        version = p._version
        opt.step()
        with pytest.raises(RuntimeError, match="modified by an inplace operation") as caught:
            out.backward()
        results.append((p._version > version, "is at version" in str(caught.value)))
    assert results == [(True, True), (True, True)] and calls  # torch's step, then the kernel's
