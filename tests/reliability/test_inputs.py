"""Inputs that must work: Policy dtype names at construction, and fp8 edges that nn.Linear handles.

Refused inputs are battery cases (``cases_inputs.py``); here every accepted spelling of a dtype in every
dtype-valued field of ``Policy`` must give the dtype (print, compare, hash), and ``Float8Linear`` must
treat a zero-size batch and float64 as ``nn.Linear`` does, keep ``nn.Linear`` subclasses out of the swap
with a warning that names them, and recover from one outlier amax in the delayed-scaling history.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec import formats
from mixprec.float8 import Float8Config, Float8Linear, convert_to_float8_training
from mixprec.lowbit.history import to_float8

SPELLINGS = {
    torch.float32: ("fp32", "float32", "f32", "float", "torch.float32", " FP32 "),
    torch.bfloat16: ("bf16", "bfloat16", "torch.bfloat16", "BF16"),
    torch.float16: ("fp16", "float16", "f16", "half", "torch.float16"),
}
NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@pytest.mark.parametrize("field", ["compute_dtype", "param_dtype", "output_dtype"])
@pytest.mark.parametrize("dtype", list(SPELLINGS), ids=str)
def test_every_dtype_field_takes_every_dtype_name(field, dtype):
    for spelling in SPELLINGS[dtype]:
        policy = mixprec.Policy(**{field: spelling})
        assert getattr(policy, field) is dtype
        assert policy == mixprec.Policy(**{field: dtype}) and hash(policy) == hash(
            mixprec.Policy(**{field: dtype})
        )
        short = {"compute_dtype": "compute", "param_dtype": "params", "output_dtype": "output"}[field]
        assert f"{short}={NAMES[dtype]}" in str(policy)
        assert mixprec.Policy.parse(str(policy)) == policy


def test_module_override_dtype_names_become_dtypes():
    policy = mixprec.Policy(module_overrides=(("fc", "fp32"), ("head", "bf16")))
    assert policy.module_overrides == (("fc", torch.float32), ("head", torch.bfloat16))
    assert policy == mixprec.Policy().with_modules({"fc": "fp32", "head": torch.bfloat16})


CONFIGS = {"dynamic": Float8Config(), "delayed": Float8Config(scaling="delayed", amax_history_len=4)}


@pytest.mark.parametrize("shape", [(0, 6), (2, 0, 6), (0, 0, 6)])
@pytest.mark.parametrize("recipe", list(CONFIGS))
def test_a_zero_size_batch_works_as_in_nn_linear(recipe, shape):
    torch.manual_seed(0)
    ref = nn.Linear(6, 3)
    layer = Float8Linear.from_linear(nn.Linear(6, 3), CONFIGS[recipe])
    history = None if layer.amax_history is None else layer.amax_history.clone()
    for module in (ref, layer):
        x = torch.randn(*shape, requires_grad=True)
        out = module(x)
        assert out.shape == (*shape[:-1], 3) and out.dtype == torch.float32
        out.sum().backward()
        assert torch.equal(module.weight.grad, torch.zeros(3, 6)) and x.grad.shape == x.shape
    if history is not None:  # an empty batch says nothing about the input's or grad_output's range
        assert torch.equal(layer.amax_history[0::2], history[0::2])
        assert layer.amax_history[1, 0] == layer.weight.abs().max()


def test_float64_works_as_in_nn_linear():
    torch.manual_seed(0)
    ref = nn.Linear(6, 3).double()
    layer = Float8Linear.from_linear(nn.Linear(6, 3).double())
    x = torch.randn(4, 6, dtype=torch.float64)
    out = layer(x)
    assert out.dtype == torch.float64 == ref(x).dtype
    exact = F.linear(x, layer.weight, layer.bias)
    assert float((out - exact).detach().norm() / exact.detach().norm()) < 0.1  # fp8 precision


class ScaledLinear(nn.Linear):
    """A subclass with its own parameter and forward (a learned output scale)."""

    def __init__(self, *args: int) -> None:
        super().__init__(*args)
        self.gain = nn.Parameter(torch.tensor(3.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.gain


def test_subclasses_are_kept_and_named_and_exact_linears_converted():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), ScaledLinear(4, 4), nn.TransformerEncoderLayer(4, 1, 8))
    x = torch.randn(2, 3, 4)
    expected_keys = set(model.state_dict())
    scaled_out = model[1](x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        convert_to_float8_training(model)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "'1': ScaledLinear is a subclass of nn.Linear" in messages[0], messages
    assert "out_proj" not in messages[0]  # attention never calls its forward: nothing to say
    assert type(model[0]) is Float8Linear and type(model[1]) is ScaledLinear
    assert type(model[2].linear1) is Float8Linear
    assert set(model.state_dict()) == expected_keys and torch.equal(model[1](x), scaled_out)


def test_one_outlier_amax_does_not_starve_the_layer():
    """Transformer Engine would push 1e30 and scale the next 16 steps by 448 / 1e30: every ordinary value
    rounds to 0 in e4m3 (checked). Here the pushed amax is bounded, so the next steps stay accurate."""
    torch.manual_seed(0)
    xs = [torch.randn(8, 16) for _ in range(12)]
    xs[3] = xs[3].clone()
    xs[3][0, 0] = 1e30
    assert torch.all(to_float8(xs[4], torch.tensor(448 / 1e30), formats.FP8_E4M3FN).float() == 0)
    layer = Float8Linear(16, 8, config=Float8Config(scaling="delayed", amax_history_len=16))
    for step, x in enumerate(xs):
        x = x.detach().requires_grad_()
        out = layer(x)
        out.sum().backward()
        ref = F.linear(x, layer.weight, layer.bias)
        error = float((out - ref).detach().norm() / ref.detach().norm())
        if step != 3:  # the outlier's own step saturates under delayed scaling, as anywhere
            assert error < 0.2, (step, error)
            assert float(layer.weight.grad.abs().sum()) > 0
        layer.weight.grad = None
    assert float(layer.amax_history[0].max()) < 1e5


def test_a_genuine_jump_is_followed_within_two_steps():
    layer = Float8Linear(16, 8, config=Float8Config(scaling="delayed", amax_history_len=4))
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    layer(x)
    for _ in range(3):
        layer(x * 1e4)
    amax = float((x * 1e4).abs().max())
    assert layer.last_scale()["input"] == pytest.approx(448 / amax, rel=1e-6)
    assert math.isfinite(layer.last_scale()["input"])
