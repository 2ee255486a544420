"""find_nonfinite: the first module/op whose result is inf or nan, forward and backward."""

import pytest
import torch
from inspect_helpers import assert_no_hooks
from torch import nn

from mixprec.inspect import NonfiniteReport, demo, find_nonfinite
from mixprec.inspect._modules import OUTSIDE
from mixprec.policy import Policy

FP16 = Policy.for_device("cpu", torch.float16)


@pytest.fixture
def inputs():
    return demo.demo_inputs()


def test_healthy_model_is_none_forward_and_backward(inputs):
    model = demo.healthy_model()
    assert find_nonfinite(model, inputs) is None
    assert find_nonfinite(model, inputs, loss_fn=demo.scaled_loss(2.0**8)) is None
    assert_no_hooks(model)


def test_forward_overflow_names_module_op_dtype_and_inputs(inputs):
    report = find_nonfinite(demo.forward_overflow_model(), inputs)
    assert isinstance(report, NonfiniteReport)
    assert (report.module, report.phase, report.op) == ("blocks.2.fc", "forward", "linear")
    assert report.dtype == torch.float16 and report.value == "inf"
    assert report.inputs_finite and report.finite_in_fp32 is True
    low, high = report.input_range
    assert low < 0 < high and report.input_absmax == pytest.approx(30000.0)
    text = str(report)
    assert "'blocks.2.fc'" in text and "65504" in text
    assert "with_modules({'blocks.2.fc': torch.float32})" in text


def test_forward_overflow_is_gone_in_bfloat16(inputs):
    assert find_nonfinite(demo.forward_overflow_model(), inputs, dtype=torch.bfloat16) is None
    assert find_nonfinite(demo.forward_overflow_model(), inputs, policy="bf16-mixed") is None


def test_pinning_the_module_moves_the_overflow_downstream(inputs):
    pinned = FP16.with_modules({"blocks.2.fc": torch.float32})
    report = find_nonfinite(demo.forward_overflow_model(), inputs, policy=pinned)
    # blocks.2.fc now runs in fp32, and its 1.7e5 outputs overflow where blocks.3.fc casts them to fp16.
    assert report.module == "blocks.3.fc" and report.phase == "forward"


def test_backward_overflow_at_known_module(inputs):
    model = demo.backward_overflow_model()
    assert find_nonfinite(model, inputs) is None  # the forward is finite
    report = find_nonfinite(model, inputs, loss_fn=demo.scaled_loss(2.0**12))
    assert (report.module, report.phase, report.op) == ("blocks.1.fc", "backward", "linear")
    assert report.dtype == torch.float16 and report.value == "inf"
    assert report.node == "AddmmBackward0" and report.inputs_finite
    assert 1 < report.input_absmax < 65504
    assert "lower the loss scale" in str(report) and "'blocks.1.fc'" in str(report)
    assert find_nonfinite(model, inputs, loss_fn=demo.scaled_loss(2.0**4)) is None


def test_weight_gradient_overflow_is_attributed_to_its_module(inputs):
    # At 2^8 the input gradient of blocks.1.fc fits in fp16, but blocks.0.fc's weight gradient does not.
    report = find_nonfinite(demo.backward_overflow_model(), inputs, loss_fn=demo.scaled_loss(2.0**8))
    assert (report.module, report.phase) == ("blocks.0.fc", "backward")


def test_residual_branch_blames_the_branch_not_the_add(inputs):
    class Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(32, 32)
            self.branch = nn.Linear(32, 32)
            self.out = nn.Linear(32, 1)
            with torch.no_grad():
                self.inp.weight.mul_(1e-4)
                self.inp.bias.zero_()
                self.branch.weight.fill_(0.0)
                self.branch.weight[:, 0] = 30000.0  # backward: every output's gradient lands on input 0
                self.out.weight.fill_(1 / 32)
                self.out.bias.zero_()

        def forward(self, x):
            h = self.inp(x)
            return self.out(h + self.branch(h))

    report = find_nonfinite(Residual(), inputs, loss_fn=demo.scaled_loss(2.0**4))
    assert (report.module, report.phase, report.op) == ("branch", "backward", "linear")


def test_loss_overflow_is_outside_the_model(inputs):
    report = find_nonfinite(demo.healthy_model(), inputs, loss_fn=lambda m, x: (m(x) * 70000).sum())
    assert report.module == OUTSIDE and report.phase == "forward"
    assert ".float()" in str(report)


def test_nonfinite_input_data_is_reported_as_such(inputs):
    bad = inputs.clone()
    bad[0, 0] = float("nan")
    report = find_nonfinite(demo.healthy_model(), bad)
    assert report.module == "blocks.0.fc" and not report.inputs_finite
    assert "not finite" in str(report)


@pytest.mark.parametrize("loss", [False, True])
def test_a_diverged_weight_is_named_not_blamed_on_the_input_data(inputs, loss):
    # was: "the inputs of linear in module 'blocks.1.fc' already held inf/nan, so the data fed to the
    # model is not finite; check the inputs and preprocessing": the inputs were finite, the weight was not
    model = demo.healthy_model()
    with torch.no_grad():
        model.blocks[1].fc.weight[0, 0] = float("nan")
    loss_fn = (lambda m, x: m(x).float().pow(2).mean()) if loss else None
    report = find_nonfinite(model, inputs, loss_fn=loss_fn, dtype=torch.bfloat16)
    assert (
        report.state == "blocks.1.fc.weight" and report.module == "blocks.1.fc" and report.op == "parameter"
    )
    assert report.value == "nan" and "already held nan before the run" in str(report)
    assert "preprocessing" not in str(report)
    assert_no_hooks(model)


def test_a_minus_inf_mask_buffer_is_not_taken_for_a_diverged_model():
    class Masked(nn.Module):  # an attention-style mask kept as a buffer of -inf, used through finfo.min
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.register_buffer("mask", torch.full((8, 8), float("-inf")).triu(1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            scores = self.fc(x) @ x.transpose(-1, -2)
            return scores.masked_fill(torch.isinf(self.mask), torch.finfo(scores.dtype).min).softmax(-1)

    model = Masked()
    assert find_nonfinite(model, torch.randn(2, 8, 8), dtype=torch.bfloat16) is None
    with torch.no_grad():
        model.mask[0, 0] = float("nan")  # nan in a buffer is a broken state
    report = find_nonfinite(model, torch.randn(2, 8, 8), dtype=torch.bfloat16)
    assert report is not None and report.state == "mask" and report.op == "buffer"


class _CausalAttention(nn.Module):
    """nanoGPT's non-flash attention: scores masked with -inf (masked_fill, or a -inf buffer added)."""

    def __init__(self, additive: bool) -> None:
        super().__init__()
        self.additive = additive
        self.qkv = nn.Linear(16, 48)
        self.register_buffer("bias", torch.tril(torch.ones(8, 8)))
        self.register_buffer("minus_inf", torch.full((8, 8), float("-inf")).triu(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split(16, dim=-1)
        att = q @ k.transpose(-1, -2) / 4.0
        if self.additive:
            att = att + self.minus_inf
        else:
            att = att.masked_fill(self.bias == 0, float("-inf"))
        return att.softmax(-1) @ v


@pytest.mark.parametrize("additive", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_minus_inf_attention_mask_is_not_reported_but_an_overflow_still_is(additive, dtype):
    # was: "masked_fill ... produced inf in float16 from finite inputs ... does so in float32 too" (or the
    # add's "inputs already held inf/nan ... check the inputs and preprocessing") for every such model
    torch.manual_seed(0)
    model, x = _CausalAttention(additive), torch.randn(2, 8, 16)
    loss_fn = lambda m, b: m(b).float().pow(2).mean()  # noqa: E731
    assert find_nonfinite(model, x, loss_fn=loss_fn, dtype=dtype) is None
    with torch.no_grad():
        model.qkv.weight.mul_(1e5)  # now the projection overflows fp16: found where it happens
    if dtype == torch.float16:
        report = find_nonfinite(model, x, loss_fn=loss_fn, dtype=dtype)
        assert report is not None and report.module == "qkv" and report.phase == "forward"
    with torch.no_grad():
        model.qkv.weight.div_(1e5)
    model.bias.zero_()
    model.minus_inf.fill_(float("-inf"))  # every position masked: the softmax's nan is still found
    report = find_nonfinite(model, x, loss_fn=loss_fn, dtype=dtype)
    assert report is not None and report.value == "nan"


def test_nan_that_fp32_also_gives_is_not_blamed_on_precision(inputs):
    report = find_nonfinite(
        demo.healthy_model(), inputs, loss_fn=lambda m, x: (m(x).float() - 100).sqrt().sum()
    )
    assert report.op == "sqrt" and report.value == "nan" and report.finite_in_fp32 is False
    assert "not a precision problem" in str(report)


def test_tuple_and_dict_inputs(inputs):
    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(32, 1)

        def forward(self, a, b):
            return self.fc(a * b)

    model = TwoInputs()
    assert find_nonfinite(model, (inputs, inputs)) is None
    # a * b runs in fp32 (mul is not a lower-precision op); fc's fp16 matmul of 1e4-sized inputs overflows.
    report = find_nonfinite(model, {"a": inputs, "b": inputs * 1e4})
    assert (report.module, report.op) == ("fc", "linear")


def test_bad_arguments_name_the_value(inputs):
    with pytest.raises(TypeError, match="nn.Module"):
        find_nonfinite(lambda x: x, inputs)
    with pytest.raises(ValueError, match=r"one-element tensor, got \(8, 1\)"):
        find_nonfinite(demo.healthy_model(), inputs, loss_fn=lambda m, x: m(x))
    with pytest.raises(ValueError, match="conflicts"):
        find_nonfinite(demo.healthy_model(), inputs, dtype=torch.bfloat16, policy=FP16)


class _InPlaceDouble(nn.Module):
    def forward(self, h):
        h = h.clone()
        h += h  # fp16 40000 + 40000 overflows: this op made the inf, its input was finite
        return h


def test_an_in_place_overflow_is_blamed_on_the_op_not_on_its_inputs():
    """Issue 11: the inputs were judged after ``h += h`` had overwritten them, and reported as non-finite."""
    x = torch.full((2, 3), 40000.0, dtype=torch.float16)
    report = find_nonfinite(_InPlaceDouble(), x)
    assert report is not None and report.op in ("__iadd__", "add_") and report.value == "inf"
    assert report.inputs_finite, str(report)
    assert report.input_range == (40000.0, 40000.0)
    assert report.finite_in_fp32 is True  # re-run on float32 copies taken before the op
    assert torch.equal(x, torch.full((2, 3), 40000.0, dtype=torch.float16))
