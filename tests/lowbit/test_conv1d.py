"""transformers' ``Conv1D`` (GPT-2's linear layers, weight (in, out)) converts in both swaps (issue 33
item 5): on a GPT-2 from a tiny config every Conv1D converts, the logits stay within the recipe's
tolerance of the fp32 model, parameters and state_dict keys are unchanged, and one layer's numerics are
bitwise those of an ``nn.Linear`` of weight ``W.t()`` converted the same way (output and all gradients)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from mixprec.float8 import Float8Config, Float8Conv1D, convert_to_float8_training, sync_float8_amax_history
from mixprec.lowbit import LowbitConv1D, convert_to_lowbit_training, sr_state_dict

transformers = pytest.importorskip("transformers")
Conv1D = transformers.pytorch_utils.Conv1D

CONV1D_NAMES = [
    f"transformer.h.{i}.{name}"
    for i in range(2)
    for name in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
]
# Relative Frobenius error of the logits against the fp32 model, per element width (measured: fp8 recipes
# 0.045, the 4-bit ones 0.17-0.20; bf16 itself 0.005).
TOLERANCE = {8: 0.08, 4: 0.3}
SWAPS = [
    ("lowbit", "fp8_rowwise", 8),
    ("lowbit", "mxfp8", 8),
    ("lowbit", "nvfp4", 4),
    ("float8", Float8Config(), 8),
    ("float8", Float8Config(scaling="delayed"), 8),
    ("float8", Float8Config.from_recipe_name("rowwise"), 8),
]


def _convert(model: nn.Module, swap: str, setting: object) -> nn.Module:
    if swap == "lowbit":
        return convert_to_lowbit_training(model, setting)
    return convert_to_float8_training(model, config=setting)


def _gpt2() -> nn.Module:
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=2, n_positions=32, vocab_size=128, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def _ids() -> torch.Tensor:
    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(("swap", "setting", "bits"), SWAPS, ids=lambda v: str(v)[:24])
def test_gpt2_conv1d_layers_convert_and_train(swap: str, setting: object, bits: int) -> None:
    reference = _gpt2()
    expected = reference(_ids()).logits
    model = _gpt2()
    params_before = [id(p) for p in model.parameters()]
    keys_before = list(model.state_dict())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _convert(model, swap, setting)
    assert not [w for w in caught if "kept layers" in str(w.message)]
    kind = LowbitConv1D if swap == "lowbit" else Float8Conv1D
    modules = dict(model.named_modules())
    assert [f for f, m in modules.items() if isinstance(m, kind)] == CONV1D_NAMES
    assert not [f for f, m in modules.items() if isinstance(m, Conv1D)]
    # the same Parameter objects (optimizer groups, tied wte / lm_head), the same keys (+ delayed histories)
    assert [id(p) for p in model.parameters()] == params_before
    assert model.lm_head.weight is model.transformer.wte.weight
    keys = [k for k in model.state_dict() if not k.endswith("amax_history")]
    assert keys == keys_before
    out = model(_ids(), labels=_ids())
    error = ((out.logits - expected).norm() / expected.norm()).item()
    assert error < TOLERANCE[bits], f"{swap} {setting}: relative logit error {error:.4f}"
    out.loss.backward()
    for name in CONV1D_NAMES:
        grad = modules[name].weight.grad
        assert grad is not None and grad.shape == modules[name].weight.shape and bool(grad.isfinite().all())
        assert bool(grad.abs().sum() > 0)


@pytest.mark.parametrize(("swap", "setting", "bits"), SWAPS, ids=lambda v: str(v)[:24])
def test_converted_gpt2_state_dict_round_trips_with_the_plain_model(
    swap: str, setting: object, bits: int
) -> None:
    model = _convert(_gpt2(), swap, setting)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)  # not the init, so a load that did nothing would show
    plain = _gpt2()
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    assert missing == [] and all(k.endswith("amax_history") for k in unexpected)
    converted = model.state_dict()
    for k, value in plain.state_dict().items():
        assert torch.equal(value, converted[k]), k
    back = _convert(_gpt2(), swap, setting)
    back.load_state_dict(plain.state_dict(), strict=False)
    assert torch.equal(back(_ids()).logits, model(_ids()).logits)


def _pair(swap: str, setting: object) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    conv = Conv1D(48, 32)
    with torch.no_grad():
        conv.bias.normal_()
    linear = nn.Linear(32, 48)
    linear.weight = nn.Parameter(conv.weight.detach().t().contiguous())
    linear.bias = nn.Parameter(conv.bias.detach().clone())
    if swap == "lowbit":  # one seeded generator each, so stochastic rounding draws the same bits
        return (
            convert_to_lowbit_training(conv, setting, generator=torch.Generator().manual_seed(3)),
            convert_to_lowbit_training(linear, setting, generator=torch.Generator().manual_seed(3)),
        )
    return convert_to_float8_training(conv, config=setting), convert_to_float8_training(
        linear, config=setting
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("swap", "setting", "bits"), SWAPS, ids=lambda v: str(v)[:24])
def test_conv1d_is_bitwise_a_linear_of_the_transposed_weight(
    swap: str, setting: object, bits: int, dtype: torch.dtype
) -> None:
    conv, linear = _pair(swap, setting)
    assert isinstance(conv, LowbitConv1D if swap == "lowbit" else Float8Conv1D)
    assert (conv.in_features, conv.out_features, conv.nx, conv.nf) == (32, 48, 32, 48)
    x = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(2))
    for _ in range(2):  # twice: delayed scaling's second step reads the history of the first
        xa, xb = (x.to(dtype).requires_grad_() for _ in range(2))
        ya, yb = conv(xa), linear(xb)
        assert ya.dtype == dtype and torch.equal(ya, yb)
        ya.square().sum().backward()
        yb.square().sum().backward()
        assert torch.equal(xa.grad, xb.grad)
        assert torch.equal(conv.weight.grad.t(), linear.weight.grad)
        assert torch.equal(conv.bias.grad, linear.bias.grad)
    if swap == "float8" and setting.delayed:
        assert torch.equal(conv.amax_history, linear.amax_history) and bool(conv.amax_history.any())


def test_conv1d_reconversion_is_refused_and_the_same_setting_is_a_no_op() -> None:
    model = convert_to_lowbit_training(_gpt2(), "mxfp8")
    before = model.transformer.h[0].attn.c_attn
    convert_to_lowbit_training(model, "mxfp8")
    assert model.transformer.h[0].attn.c_attn is before
    with pytest.raises(ValueError, match=r"'transformer.h.0.attn.c_attn' \(LowbitConv1D, recipe mxfp8\)"):
        convert_to_lowbit_training(model, "fp8_rowwise")
    with pytest.raises(ValueError, match=r"'transformer.h.0.attn.c_attn' \(LowbitConv1D, recipe mxfp8\)"):
        convert_to_float8_training(model)
    model = convert_to_float8_training(_gpt2())
    with pytest.raises(ValueError, match=r"'transformer.h.1.mlp.c_proj' \(Float8Conv1D, Float8Config\(\)\)"):
        convert_to_float8_training(model, config=Float8Config(scaling="delayed"))
    assert model.transformer.h[1].mlp.c_proj.amax_history is None


@pytest.mark.parametrize("swap", ["float8", "lowbit"])
def test_the_filter_keeps_conv1d_out(swap: str) -> None:
    def no_conv1d(module: nn.Module, fqn: str) -> bool:
        return type(module).__name__ != "Conv1D"

    model = _gpt2()
    if swap == "lowbit":
        convert_to_lowbit_training(model, "mxfp8", module_filter_fn=no_conv1d)
    else:
        convert_to_float8_training(model, module_filter_fn=no_conv1d)
    kinds = {type(model.get_submodule(name)).__name__ for name in CONV1D_NAMES}
    assert kinds == {"Conv1D"} and type(model.lm_head).__name__ != "Linear"


def test_float8_all_gather_keeps_conv1d_and_names_it() -> None:
    model = _gpt2()
    with pytest.warns(UserWarning, match="kept layers") as caught:
        convert_to_float8_training(model, config=Float8Config(enable_fsdp_float8_all_gather=True))
    (text,) = [str(w.message) for w in caught if "kept layers" in str(w.message)]
    for name in CONV1D_NAMES:
        assert (
            f"'{name}': transformers Conv1D is not converted with enable_fsdp_float8_all_gather=True" in text
        )
    with pytest.raises(ValueError, match="enable_fsdp_float8_all_gather"):
        Float8Conv1D(Conv1D(8, 4), Float8Config(enable_fsdp_float8_all_gather=True))


def test_delayed_conv1d_histories_sync_and_generators_are_saved() -> None:
    model = convert_to_float8_training(_gpt2(), config=Float8Config(scaling="delayed"))
    model(_ids(), labels=_ids()).loss.backward()
    assert sync_float8_amax_history(model) == 0  # no process group: nothing reduced, and no error
    sd = model.state_dict()
    assert all(f"{name}.amax_history" in sd for name in CONV1D_NAMES)
    bad = dict(sd)
    bad[f"{CONV1D_NAMES[0]}.amax_history"] = torch.full_like(sd[f"{CONV1D_NAMES[0]}.amax_history"], -1.0)
    weight = model.transformer.h[0].attn.c_attn.weight.detach().clone()
    with pytest.raises(ValueError, match="not finite amaxes"):
        model.load_state_dict({k: v + 1 if k.endswith("weight") else v for k, v in bad.items()})
    assert torch.equal(model.transformer.h[0].attn.c_attn.weight, weight)  # refused before any tensor loads
    lowbit = convert_to_lowbit_training(_gpt2(), "nvfp4", generator=torch.Generator().manual_seed(0))
    assert list(sr_state_dict(lowbit)) == [CONV1D_NAMES[0]]


def test_conv1d_constructors_refuse_a_module_without_a_2d_weight() -> None:
    with pytest.raises(TypeError, match="conv1d must be a transformers Conv1D"):
        LowbitConv1D(nn.Identity(), "mxfp8")
    with pytest.raises(TypeError, match="conv1d must be a transformers Conv1D"):
        Float8Conv1D(nn.Conv1d(3, 3, 1))
