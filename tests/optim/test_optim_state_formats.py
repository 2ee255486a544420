"""Low-bit optimizer states (``state_format=``): codecs against torchao's, torch's fused AdamW as the oracle
of a first step, skipped steps that write nothing, quantized state dicts that resume bit for bit, refusals."""

from __future__ import annotations

import io
import warnings

import pytest
import torch

from mixprec.optim.compensated import CompensatedOptimizer
from mixprec.optim.masters import MixedPrecisionOptimizer
from mixprec.optim.state_formats import (
    BLOCK,
    STATE_FORMATS,
    dequantize_,
    dynamic_map,
    quantize_,
    state_nbytes,
)

quant_utils = pytest.importorskip("torchao.optim.quant_utils")

FORMATS = list(STATE_FORMATS)
MAKERS = {
    "kahan": lambda m, fmt: CompensatedOptimizer(
        torch.optim.AdamW(m.parameters(), lr=3e-3), "kahan", state_format=fmt, scratch_numel=512
    ),
    "stochastic": lambda m, fmt: CompensatedOptimizer(
        torch.optim.Adam(m.parameters(), lr=3e-3, weight_decay=0.01), "stochastic", seed=5, state_format=fmt
    ),
    "masters": lambda m, fmt: MixedPrecisionOptimizer(
        torch.optim.AdamW(m.parameters(), lr=3e-3), state_format=fmt
    ),
}


def _model(seed: int = 1) -> torch.nn.Module:
    torch.manual_seed(seed)
    # 600 weights in the first layer: blocks of 256 and a short last block
    return torch.nn.Sequential(torch.nn.Linear(20, 30), torch.nn.Tanh(), torch.nn.Linear(30, 3)).bfloat16()


def _data(seed: int = 0):
    """Inputs drawn from ``seed``, targets from one fixed map (another seed: held-out data)."""
    x = torch.randn(64, 20, generator=torch.Generator().manual_seed(seed))
    return x, torch.tanh(x @ torch.randn(20, 3, generator=torch.Generator().manual_seed(99)))


def _train(model, opt, steps: int, start: int = 0) -> float:
    x, y = _data()
    loss = torch.tensor(0.0)
    for i in range(start, start + steps):
        rows = slice(8 * (i % 8), 8 * (i % 8) + 8)
        loss = ((model(x[rows].bfloat16()).float() - y[rows]) ** 2).mean()
        (opt.backward(loss) if isinstance(opt, MixedPrecisionOptimizer) else loss.backward())
        opt.step()
        opt.zero_grad()
    return float(loss.detach())


def _tensors(model, opt) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in model.parameters()]
    for state in opt.state.values():
        out += [v.clone() for _, v in sorted(state.items()) if torch.is_tensor(v)]
    return out + [c.clone() for c in getattr(opt, "compensation", [])]


def _bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        x.dtype == y.dtype and torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
        for x, y in zip(a, b, strict=True)
    )


def test_dynamic_map_is_torchaos():
    for signed in (True, False):
        ours = torch.tensor(dynamic_map(signed))
        assert torch.equal(ours, torch.tensor(quant_utils.create_dynamic_map(signed=signed)))


def test_int8_and_fp8_codes_match_torchaos_quantizers():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40 * BLOCK, generator=gen) * torch.logspace(-6, 2, 40).repeat_interleave(BLOCK)
    for signed, values in ((True, x), (False, x.abs())):
        codes, scale = torch.empty(x.numel(), dtype=torch.uint8), torch.empty(40)
        quantize_("int8", not signed, values.clone(), codes, scale)
        qmap = torch.tensor(quant_utils.create_dynamic_map(signed=signed))
        normed, their_scale = quant_utils.scale_tensor(values, BLOCK)
        theirs = quant_utils.quantize_8bit_with_qmap(normed, qmap)
        assert torch.equal(scale, their_scale)
        same = codes == theirs
        assert same.float().mean() > 0.999  # a value at a midpoint may round either way
        assert ((codes.int() - theirs.int()).abs() <= 1).all()
        out = torch.empty(x.numel())
        dequantize_("int8", not signed, codes, scale, out)
        assert torch.equal(out[same], quant_utils.dequant_with_qmap(theirs, qmap, their_scale)[same])
    from torchao.optim.subclass_fp8 import quantize_fp8

    codes, scale = torch.empty(x.numel(), dtype=torch.float8_e4m3fn), torch.empty(40)
    quantize_("fp8", False, x.clone(), codes, scale)
    their_codes, their_scale = quantize_fp8(x, BLOCK)
    assert torch.equal(codes.view(torch.uint8), their_codes.view(torch.uint8)) and torch.equal(
        scale, their_scale
    )


def test_fp8_second_moment_keeps_small_values_where_plain_e4m3_flushes_them():
    v = torch.logspace(-12, 0, BLOCK)  # one block spanning 12 decades, as exp_avg_sq can
    codes, scale, out = torch.empty(BLOCK, dtype=torch.float8_e4m3fn), torch.empty(1), torch.empty(BLOCK)
    quantize_("fp8", True, v.clone(), codes, scale)
    dequantize_("fp8", True, codes, scale, out)
    plain = (v / (v.max() / 448)).to(torch.float8_e4m3fn).float() * (v.max() / 448)
    assert (plain == 0).sum() > 50  # the peer's plain e4m3 storage: small values flush to 0
    assert (out[v > 1e-10] > 0).all()  # 10 decades below the block's largest value still nonzero
    close = v > 1e-8  # sqrt(v) in e4m3's normal range: 3 mantissa bits, so |error| < 2 * 2**-4 of v
    assert ((out[close] - v[close]).abs() / v[close]).max() < 0.13


@pytest.mark.parametrize("bad", ["int4", "FP8", 8, torch.bfloat16])
def test_unknown_state_format_is_refused_naming_it_and_the_accepted(bad):
    for make in (
        lambda: CompensatedOptimizer(torch.optim.AdamW(_model().parameters()), state_format=bad),
        lambda: MixedPrecisionOptimizer(torch.optim.AdamW(_model().parameters()), state_format=bad),
    ):
        # None said "the moments as today", which told a new user nothing: it names what None keeps
        accepted = r"accepted: None \(the inner optimizer's own state\), 'bf16', 'int8', 'fp8'$"
        with pytest.raises(ValueError, match=rf"unknown state_format {bad!r}; {accepted}"):
            make()


def test_state_format_needs_adam_and_no_state_dtype():
    with pytest.raises(ValueError, match="needs torch.optim.Adam or AdamW.*SGD"):
        CompensatedOptimizer(torch.optim.SGD(_model().parameters(), lr=0.1), state_format="int8")
    with pytest.raises(ValueError, match="needs torch.optim.Adam or AdamW.*SGD"):
        MixedPrecisionOptimizer(torch.optim.SGD(_model().parameters(), lr=0.1), state_format="int8")
    with pytest.raises(ValueError, match="state_dtype must stay None"):
        CompensatedOptimizer(
            torch.optim.Adam(_model().parameters()), state_format="fp8", state_dtype=torch.float32
        )
    inner = CompensatedOptimizer(torch.optim.Adam(_model().parameters()))
    with pytest.raises(ValueError, match="give it to the CompensatedOptimizer"):
        MixedPrecisionOptimizer(inner, state_format="bf16")


_FLAGS = [{}, {"foreach": True}, {"foreach": False}, {"fused": True}, {"capturable": True}]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("maker", ["kahan", "masters"])
def test_the_inner_optimizers_flags_do_not_change_the_lowbit_step(fmt, maker):
    """Every foreach/fused/capturable flag torch accepts is taken, and the low-bit step (one fused pass
    whatever they say) is bit for bit the same under each."""
    runs = []
    for flags in _FLAGS:
        model = _model()
        inner = torch.optim.AdamW(model.parameters(), lr=3e-3, **flags)
        if maker == "kahan":
            opt = CompensatedOptimizer(inner, "kahan", state_format=fmt)
        else:
            opt = MixedPrecisionOptimizer(inner, scaler=None, state_format=fmt)
        _train(model, opt, 3)
        runs.append(_tensors(model, opt))
    assert all(_bitwise(runs[0], run) for run in runs[1:])


@pytest.mark.parametrize("fmt", FORMATS)
def test_first_step_of_fp32_masters_is_torchs_fused_adamw(fmt):
    """From zero state the step uses the moments before they are stored: torch's fused AdamW exactly."""
    model = _model()
    reference = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    opt = MixedPrecisionOptimizer(
        torch.optim.AdamW(model.parameters(), lr=3e-3), scaler=None, state_format=fmt
    )
    torch_opt = torch.optim.AdamW(reference, lr=3e-3, fused=True)
    x, y = _data()
    loss = ((model(x.bfloat16()).float() - y) ** 2).mean()
    opt.backward(loss)
    for ref, p in zip(reference, model.parameters(), strict=True):
        ref.grad = p.grad.float()
    opt.step()
    torch_opt.step()
    assert _bitwise([m.detach() for m in opt.master_params], [r.detach() for r in reference])


@pytest.mark.parametrize("fmt", FORMATS)
def test_chunked_pass_equals_one_pass_and_its_scratch_stays_chunk_sized(fmt):
    results = []
    for scratch in (256, None):
        model = _model()
        opt = CompensatedOptimizer(
            torch.optim.AdamW(model.parameters(), lr=3e-3), state_format=fmt, scratch_numel=scratch
        )
        _train(model, opt, 4)
        results.append(_tensors(model, opt))
        if scratch:
            assert max(b.numel() for b in opt.workspace.buffers.values()) <= 256
    assert _bitwise(*results)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("maker", sorted(MAKERS))
def test_skipped_step_leaves_every_state_byte_unchanged(fmt, maker):
    model = _model()
    opt = MAKERS[maker](model, fmt)
    _train(model, opt, 3)
    before = _tensors(model, opt)
    x, y = _data()
    loss = ((model(x.bfloat16()).float() - y) ** 2).mean()
    (opt.backward(loss) if maker == "masters" else loss.backward())
    next(model.parameters()).grad[0, 0] = float("inf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        opt.step()
    opt.zero_grad()
    assert opt.last_step_skipped
    assert _bitwise(before, _tensors(model, opt))


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_skipped_first_step_creates_no_state(fmt):
    model = _model()
    opt = MAKERS["kahan"](model, fmt)
    for p in model.parameters():
        p.grad = torch.full_like(p, float("nan"))
    with pytest.warns(RuntimeWarning, match="skipped an optimizer step"):
        opt.step()
    assert not opt.optimizer.state


@pytest.mark.parametrize("maker", sorted(MAKERS))
def test_state_dict_holds_the_quantized_form_in_fewer_bytes(maker):
    numel = sum(p.numel() for p in _model().parameters())
    per_param = {}
    for fmt in [None, *FORMATS]:
        model = _model()
        opt = MAKERS[maker](model, fmt)
        _train(model, opt, 2)
        saved = opt.state_dict()
        inner = saved["optimizer"]["state"]
        dtypes = {v["exp_avg"].dtype for v in inner.values()} | {
            v["exp_avg_sq"].dtype for v in inner.values()
        }
        expected = {
            None: None,
            "bf16": {torch.bfloat16},
            "int8": {torch.uint8},
            "fp8": {torch.float8_e4m3fn},
        }[fmt]
        assert expected is None or dtypes == expected
        assert saved.get("state_format") == fmt
        per_param[fmt] = state_nbytes(opt.optimizer) / numel
    assert per_param["bf16"] < 4.1 and per_param["int8"] < 2.2 and per_param["fp8"] < 2.2
    assert per_param["int8"] < per_param["bf16"] < per_param[None]


def _roundtrip(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("maker", sorted(MAKERS))
def test_resume_from_a_saved_state_is_bitwise_an_uninterrupted_run(fmt, maker):
    model = _model()
    opt = MAKERS[maker](model, fmt)
    _train(model, opt, 3)
    saved = _roundtrip({"model": model.state_dict(), "opt": opt.state_dict()})
    _train(model, opt, 3, start=3)
    fresh_model = _model(seed=9)
    fresh = MAKERS[maker](fresh_model, fmt)
    fresh_model.load_state_dict(saved["model"])
    fresh.load_state_dict(saved["opt"])
    _train(fresh_model, fresh, 3, start=3)
    assert _bitwise(_tensors(model, opt), _tensors(fresh_model, fresh))


@pytest.mark.parametrize("maker", sorted(MAKERS))
def test_state_saved_with_another_format_is_refused_and_changes_nothing(maker):
    for saved_fmt, ours in (("int8", "fp8"), (None, "int8"), ("bf16", None)):
        model = _model()
        source = MAKERS[maker](model, saved_fmt)
        _train(model, source, 2)
        saved = source.state_dict()
        target_model = _model(seed=2)
        target = MAKERS[maker](target_model, ours)
        _train(target_model, target, 2)
        before = _tensors(target_model, target)
        with pytest.raises(
            ValueError, match=rf"saved with state_format={saved_fmt!r}.*uses state_format={ours!r}"
        ):
            target.load_state_dict(saved)
        assert _bitwise(before, _tensors(target_model, target))
    model = _model()
    target = MAKERS[maker](model, "int8")
    _train(model, target, 1)
    forged = target.state_dict()
    state = forged["optimizer"]["state"]
    state[0] = {**state[0], "exp_avg_scale": state[0]["exp_avg_scale"][:-1]}
    with pytest.raises(ValueError, match=r"exp_avg_scale.*state_format='int8' stores"):
        target.load_state_dict(forged)


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_trains_as_close_as_fp32_state_adamw(fmt):
    """A tiny regression: 300 steps of AdamW on fp32 masters with fp32 state, against the same with
    low-bit moments (loose: quantized moments change the path, not where it ends)."""
    losses = {}
    for key in (None, fmt):
        model = _model()
        opt = MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-3), state_format=key)
        _train(model, opt, 300)
        x, y = _data(seed=1)  # held out
        with torch.no_grad():
            losses[key] = float(((model(x.bfloat16()).float() - y) ** 2).mean())
    assert losses[fmt] < 1.15 * losses[None] + 0.01, losses


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("scratch", [1024, None])  # chunks under POOL // 4 (fresh bits) and over (the pool)
def test_stochastic_rounding_of_a_lowbit_step_is_unbiased(fmt, scratch):
    """Weights of 1.0 stepped by lr = 0.3 of the bf16 ulp below 1 (Adam's first step moves each by lr):
    about 30% round down, in every tensor of a chunk, the bits drawn once per chunk (an odd-sized tensor
    and an fp32 one share the chunks)."""
    sizes = (3, 1001, 150_000)
    params = [torch.nn.Parameter(torch.ones(n, dtype=torch.bfloat16)) for n in sizes]
    fp32 = torch.nn.Parameter(torch.ones(777))
    lr = 0.3 * 2.0**-8
    opt = CompensatedOptimizer(
        torch.optim.Adam([*params, fp32], lr=lr),
        "stochastic",
        seed=7,
        state_format=fmt,
        scratch_numel=scratch,
    )
    downs = torch.zeros(3)
    repeats = 100
    for _ in range(repeats):  # a fresh first step each time: the state is dropped
        with torch.no_grad():
            for p in [*params, fp32]:
                p.fill_(1.0)
                p.grad = torch.ones_like(p)
        opt.step()
        opt.state.clear()
        downs += torch.stack([(p.detach() < 1).float().sum() for p in params])
        assert all(((p == 1) | (p == 1 - 2.0**-8)).all() for p in params)  # the two neighbours only
    fraction = (downs / (repeats * torch.tensor(sizes, dtype=torch.float32))).tolist()
    assert fraction[1:] == pytest.approx([0.3, 0.3], abs=0.01)  # Adam's move lr / (1 + eps), in ulps
    assert fraction[0] == pytest.approx(0.3, abs=0.12)  # 300 draws: 4.5 standard deviations
    assert fp32.detach().sub(1 - lr).abs().max().item() < 1e-6  # the fp32 param stepped in place, unrounded
