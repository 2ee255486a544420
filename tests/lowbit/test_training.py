"""Low-bit linear layers against torchao's float8 recipes; checkpoints, autocast, GradScaler, compile."""

from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import torch
from torch import nn

import mixprec
from mixprec import lowbit
from mixprec.lowbit import LowbitLinear, convert_to_lowbit_training

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    ao = pytest.importorskip("torchao.float8")

AO_RECIPES = {
    "fp8_tensorwise": "tensorwise",
    "fp8_rowwise": "rowwise",
    "fp8_rowwise_gw_hp": "rowwise_with_gw_hp",
}
CASES = [((32, 64), (64, 48), torch.float32), ((2, 16, 32), (32, 64), torch.float32),
         ((3, 5, 40), (40, 24), torch.float32), ((32, 64), (64, 48), torch.bfloat16)]  # fmt: skip


def _run(model: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:
    x = x.clone().requires_grad_()
    out = model(x)
    out.backward(grad)
    return [out.detach(), x.grad, model[0].weight.grad]


@pytest.mark.parametrize(("shape", "features", "dtype"), CASES)
@pytest.mark.parametrize("recipe", list(AO_RECIPES))
def test_fp8_recipes_match_torchao_emulated_recipes(recipe, shape, features, dtype) -> None:
    # The bound is ‖mixprec - torchao‖ <= 5% of ‖torchao - fp32‖; the emulations agree bitwise.
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(*features)).to(dtype)
    config = dataclasses.replace(ao.Float8LinearConfig.from_recipe_name(AO_RECIPES[recipe]), emulate=True)
    theirs = ao.convert_to_float8_training(copy.deepcopy(base), config=config)
    ours = convert_to_lowbit_training(copy.deepcopy(base), recipe)
    x, grad = torch.randn(shape, dtype=dtype), torch.randn(*shape[:-1], features[1], dtype=dtype)
    reference, oracle, mine = (_run(m, x, grad) for m in (base, theirs, ours))
    for name, r, o, m in zip(("out", "grad_x", "grad_w"), reference, oracle, mine, strict=True):
        assert m.dtype == o.dtype and m.shape == o.shape, name
        assert torch.equal(m, o), name
        if not (recipe == "fp8_rowwise_gw_hp" and name == "grad_w"):
            assert (o - r).norm() > 0, name  # fp8 is lossy here, so agreeing is not vacuous


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 32, bias=False))


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(48, 64, generator=g), torch.randn(48, 32, generator=g)
    return nn.functional.mse_loss(model(x).float(), y)


@pytest.mark.parametrize("recipe", list(lowbit.RECIPES))
def test_every_recipe_trains_close_to_fp32_and_checkpoints_load_both_ways(recipe) -> None:
    plain = _mlp()
    converted = convert_to_lowbit_training(_mlp(), recipe)
    assert [type(m) for m in converted] == [LowbitLinear, nn.GELU, LowbitLinear]
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (plain, converted)]
    for step in range(5):
        for model, opt in zip((plain, converted), opts, strict=True):
            opt.zero_grad()
            _loss(model, step).backward()
            opt.step()
    bound = 0.1 if "fp4" in recipe else 0.02
    assert abs(_loss(converted, 99).item() / _loss(plain, 99).item() - 1) < bound
    fresh_plain, fresh_converted = _mlp(1), convert_to_lowbit_training(_mlp(1), recipe)
    fresh_plain.load_state_dict(converted.state_dict())  # converted -> nn.Linear
    fresh_converted.load_state_dict(plain.state_dict())  # nn.Linear -> converted
    assert converted.state_dict().keys() == plain.state_dict().keys()
    for a, b in zip(fresh_plain.parameters(), converted.parameters(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(fresh_converted.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("recipe", ["fp8_rowwise", "mxfp8", "nvfp4"])
def test_under_mixprec_autocast_the_gemm_sees_the_bf16_input_and_the_fp32_master_weight(recipe) -> None:
    # The input is cast to bf16 as F.linear's would be; the weight goes to its low-bit format straight
    # from fp32 (one rounding, as torchao and Transformer Engine do), not through bf16 first.
    model = convert_to_lowbit_training(_mlp(), recipe, generator=torch.Generator().manual_seed(0))
    x = torch.randn(16, 64)
    with mixprec.autocast("cpu", dtype=torch.bfloat16):
        out = model[0](x)
        model(x).float().sum().backward()
    assert out.dtype == torch.bfloat16
    layer = LowbitLinear.from_linear(_mlp()[0], recipe)
    assert layer.weight.dtype == torch.float32
    assert torch.equal(out, layer(x.to(torch.bfloat16)))
    assert all(p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("recipe", list(lowbit.RECIPES))
def test_grad_scaler_unscaled_grads_equal_unscaled_training_bitwise(recipe) -> None:
    # Every scale rule is exact under a power-of-two loss scale, so the quantized gradients and, after
    # unscale_, the weight gradients are bitwise those of an unscaled backward (SR draws the same numbers).
    model = convert_to_lowbit_training(_mlp(), recipe, generator=torch.Generator().manual_seed(5))
    reference = convert_to_lowbit_training(_mlp(), recipe, generator=torch.Generator().manual_seed(5))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = mixprec.GradScaler("cpu", init_scale=2.0**12)
    scaler.scale(_loss(model, 0)).backward()
    scaler.unscale_(optimizer)
    _loss(reference, 0).backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


def test_stochastic_rounding_follows_the_module_generator() -> None:
    grads = []
    for seed in (1, 1, 2):
        model = convert_to_lowbit_training(_mlp(), "nvfp4", generator=torch.Generator().manual_seed(seed))
        _loss(model, 0).backward()
        grads.append(model[0].weight.grad)
    assert torch.equal(grads[0], grads[1]) and not torch.equal(grads[0], grads[2])


def test_nvfp4_switches_change_only_what_they_name() -> None:
    base = lowbit.get_recipe("nvfp4")
    x = torch.randn(48, 64)
    x[:, 3] *= 50.0  # an outlier channel
    outs = {}
    for text in ("nvfp4", "nvfp4 rht=off", "nvfp4 sr=off", "nvfp4 sr=off rht=off"):
        recipe = lowbit.Recipe.parse(text)
        layer = LowbitLinear.from_linear(_mlp()[0], recipe, generator=torch.Generator().manual_seed(0))
        xx = x.clone().requires_grad_()
        out = layer(xx)
        out.square().sum().backward()
        outs[text] = (out.detach(), xx.grad, layer.weight.grad)
    assert lowbit.Recipe.parse("nvfp4 rht=off") == dataclasses.replace(base, rht=False)
    assert torch.equal(outs["nvfp4"][0], outs["nvfp4 rht=off"][0])  # forward has no RHT and no SR
    assert torch.equal(outs["nvfp4 sr=off"][1], outs["nvfp4 sr=off rht=off"][1])  # RHT touches wgrad only
    assert not torch.equal(outs["nvfp4 sr=off"][2], outs["nvfp4 sr=off rht=off"][2])


def test_hadamard_is_orthogonal_so_it_cancels_in_the_wgrad_product() -> None:
    h = lowbit.hadamard_16()
    torch.testing.assert_close(h @ h.t(), torch.eye(16), rtol=0, atol=1e-6)
    assert set(h.abs().unique().tolist()) == {0.25}


def test_conversion_contract_filter_exact_types_root_and_shared_modules() -> None:
    class MyLinear(nn.Linear):
        pass

    shared = nn.Linear(8, 8)
    model = nn.Sequential(nn.Linear(8, 8), shared, nn.Sequential(shared, MyLinear(8, 8)), nn.Linear(8, 4))
    seen = []
    with pytest.warns(UserWarning, match=r"kept .*'2.1': MyLinear is a subclass of nn.Linear"):
        convert_to_lowbit_training(
            model, "mxfp8", module_filter_fn=lambda m, fqn: seen.append(fqn) or fqn != "3"
        )
    assert seen == [
        "0",
        "1",
        "2.0",
        "2.1",
        "3",
    ]  # every nn.Linear (as float8's swap), every path of a shared one
    assert (
        isinstance(model[0], LowbitLinear) and isinstance(model[1], LowbitLinear) and model[1] is model[2][0]
    )
    assert type(model[2][1]) is MyLinear and type(model[3]) is nn.Linear
    convert_to_lowbit_training(model, "mxfp8", linear_types=(MyLinear,))
    assert isinstance(model[2][1], LowbitLinear)
    root = convert_to_lowbit_training(nn.Linear(4, 4), "fp8_rowwise")
    assert isinstance(root, LowbitLinear)


def test_bad_conversions_raise_and_convert_nothing() -> None:
    root = nn.Linear(4, 4)
    root.child = nn.ReLU()
    with pytest.raises(ValueError, match=r"root Linear with child modules \['child'\]"):
        convert_to_lowbit_training(root, "mxfp8")
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="unknown low-bit recipe 'mxfp7'.*mxfp8"):
        convert_to_lowbit_training(model, "mxfp7")
    with pytest.raises(TypeError, match="module_filter_fn must be callable"):
        convert_to_lowbit_training(model, "mxfp8", module_filter_fn=3)
    with pytest.raises(TypeError, match="linear_types must be a tuple"):
        convert_to_lowbit_training(model, "mxfp8", linear_types=(nn.ReLU,))
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        convert_to_lowbit_training(model, "mxfp8", generator=1)
    assert type(model[0]) is nn.Linear


@pytest.mark.parametrize("recipe", ["mxfp8_floor", "mxfp8"])
def test_torch_compile_matches_eager(tmp_path, monkeypatch, recipe) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # /tmp's shared cache can vanish under us
    model = convert_to_lowbit_training(_mlp(), recipe)
    eager = copy.deepcopy(model)
    compiled = torch.compile(model)
    loss, expected = _loss(compiled, 0), _loss(eager, 0)
    loss.backward()
    expected.backward()
    if recipe == "mxfp8_floor":
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
        for p, q in zip(model.parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
        return
    # Known difference: with AVX512 kernels the compiled round-up (RCEIL) model's loss moves by ~8e-6 and
    # its weight gradients by ~3e-3 relative L2 (with AVX2 kernels it matches); the scale, the e4m3 cast and
    # each quantize compiled alone are bitwise eager's, so it comes from fusion around them (cause not
    # pinned). Bounded here well below the quantization error itself (a few % of the gradients' norm).
    torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-6)
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        assert ((p.grad - q.grad).norm() / q.grad.norm()).item() < 1e-2


def test_mxfp8_rounds_block_scales_up_and_mxfp8_floor_is_torchaos_mx_default() -> None:
    # The forward GEMM of each recipe against torchao's MXTensor.to_mx of both operands, in the same run:
    # "mxfp8" with the round-up (RCEIL) rule, "mxfp8_floor" with to_mx's default (the floor rule).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import MXTensor
    layer = _mlp()[0]
    w, x = layer.weight.detach(), torch.randn(32, 64, generator=torch.Generator().manual_seed(3))
    saturated = {}
    for recipe, mode in (("mxfp8", {"scaling_mode": ScaleCalculationMode.RCEIL}), ("mxfp8_floor", {})):
        assert set(vars(lowbit.get_recipe(recipe)).values()) - {False, None} == {
            "mxfp8_rceil" if recipe == "mxfp8" else "mxfp8_floor"
        }
        xq, wq = (
            MXTensor.to_mx(t, torch.float8_e4m3fn, 32, **mode).dequantize(torch.float32) for t in (x, w)
        )
        out = LowbitLinear.from_linear(nn.Linear(64, 64, bias=False), recipe)
        out.weight = layer.weight
        assert torch.equal(out(x), torch.mm(xq, wq.t()))
        # Rounding to e4m3 moves a value by at most 2**-4 of itself; a block amax that lost more was clamped.
        amax, amax_q = (t.abs().reshape(64, 2, 32).amax(-1) for t in (w, wq))
        saturated[recipe] = (amax_q < amax * (1 - 2.0**-4)).float().mean().item()
    assert saturated["mxfp8"] == 0.0 and saturated["mxfp8_floor"] > 0.05
    assert (
        str(lowbit.get_recipe("mxfp8")) == "mxfp8"
        and lowbit.Recipe.parse("mxfp8_floor").name == "mxfp8_floor"
    )


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        optimizer.zero_grad()
        _loss(model, step).backward()
        optimizer.step()


def test_a_resumed_stochastic_rounding_run_draws_what_an_uninterrupted_one_draws() -> None:
    def converted(seed: int, sr_seed: int) -> nn.Module:
        gen = torch.Generator().manual_seed(sr_seed)
        return convert_to_lowbit_training(_mlp(seed), "nvfp4", generator=gen)

    full = converted(0, 3)
    _train(full, torch.optim.SGD(full.parameters(), lr=0.05, momentum=0.9), range(6))
    first = converted(0, 3)
    optimizer = torch.optim.SGD(first.parameters(), lr=0.05, momentum=0.9)
    _train(first, optimizer, range(3))
    checkpoint = (first.state_dict(), optimizer.state_dict(), lowbit.sr_state_dict(first))
    assert list(checkpoint[2]) == ["0"]  # one generator, shared by the converted modules
    for restore_sr in (True, False):
        resumed = converted(1, 99)
        resumed.load_state_dict(checkpoint[0])
        again = torch.optim.SGD(resumed.parameters(), lr=0.05, momentum=0.9)
        again.load_state_dict(checkpoint[1])
        if restore_sr:
            lowbit.load_sr_state_dict(resumed, checkpoint[2])
        _train(resumed, again, range(3, 6))
        same = all(torch.equal(a, b) for a, b in zip(resumed.parameters(), full.parameters(), strict=True))
        assert same == restore_sr  # without the SR state the resumed run draws other bits
    state = resumed[0].generator.get_state()
    with pytest.raises(ValueError, match=r"SR state for modules \['2'\].*generators are at \['0'\]"):
        lowbit.load_sr_state_dict(resumed, {"2": checkpoint[2]["0"]})
    with pytest.raises(TypeError, match="uint8"):
        lowbit.load_sr_state_dict(resumed, {"0": checkpoint[2]["0"].float()})
    assert torch.equal(resumed[0].generator.get_state(), state)
    own = lowbit.sr_state_dict(convert_to_lowbit_training(_mlp(), "nvfp4", seed=4))  # the layers' own
    assert own == {"0": {"seed": 4, "generators": {}}}  # none made before a draw
