"""The recorder catches each thing it is for, and flags nothing in a clean region."""

from __future__ import annotations

import pytest
import torch

from fake_cuda import devices
from fake_cuda.harness import Ctx, DeviceMismatch, fake_cuda


def test_clean_cuda_ops_record_nothing(fake_hopper):
    x = torch.randn(64, 32, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(16, 32, device="cuda", dtype=torch.bfloat16)
    y = torch.nn.functional.linear(x, w).float().softmax(-1)
    torch.rand(3, device="cuda")
    assert y.device.type == "cuda"
    assert fake_hopper.events == []


def test_item_bool_and_tolist_are_syncs_with_plausible_values(fake_hopper):
    x = torch.randn(4, device="cuda")
    assert x.sum().item() == 0.0
    assert bool((x > 0).any()) is False
    assert torch.stack([x[0], x[1]]).tolist() == [0.0, 0.0]  # one copy: one sync
    assert torch.zeros(2, 3, device="cuda", dtype=torch.long).tolist() == [[0, 0, 0], [0, 0, 0]]
    assert fake_hopper.count("sync") == 4
    assert fake_hopper.count("h2d") == fake_hopper.count("d2h") == 0
    x.cpu()
    assert fake_hopper.host_syncs() == 5


def test_copies_both_ways_and_host_constants(fake_hopper):
    torch.ones(8).to("cuda")
    torch.tensor([1.0, 2.0], device="cuda")  # lift_fresh of a host constant, then a copy
    c = torch.zeros(4, device="cuda")
    c.copy_(torch.ones(4))
    c.cpu()
    c[[0, 2]] = 1.0  # a list index becomes a host index tensor fed to a CUDA op
    assert fake_hopper.count("h2d") == 4
    assert fake_hopper.count("d2h") == 1
    assert fake_hopper.count("sync") == 0


def test_a_host_scalar_operand_is_not_a_copy(fake_hopper):
    # CUDA kernels read a 0-dim host tensor as a scalar argument: no copy, no sync.
    torch.randn(4, device="cuda") * torch.tensor(2.0)
    assert fake_hopper.count("h2d") == 0


def test_generator_on_another_device(fake_hopper):
    gen = torch.Generator().manual_seed(0)
    torch.rand(4, device="cuda", generator=gen)
    torch.empty(4, device="cuda").uniform_(generator=gen)
    torch.rand(4, generator=gen)  # cpu output, cpu generator: fine
    cuda_gen = torch.Generator(device="cuda").manual_seed(3)
    assert cuda_gen.device == torch.device("cuda", 0)
    torch.rand(4, device="cuda", generator=cuda_gen)  # a CUDA generator for a CUDA output: fine
    torch.empty(4, device="cuda").bernoulli_(0.5, generator=cuda_gen)
    torch.rand(4, generator=cuda_gen)  # a CUDA generator for a CPU output: bad
    bad = fake_hopper.of("bad_generator")
    assert [e.op for e in bad] == ["aten.rand.generator", "aten.uniform_.default", "aten.rand.generator"]
    assert [e.detail for e in bad] == [{"generator": "cpu", "out": "cuda"}] * 2 + [
        {"generator": "cuda", "out": "cpu"}
    ]


def test_scaled_mm_calls_and_refusals_are_recorded(fake_hopper):
    a = torch.randn(256, 512, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(1024, 512, device="cuda").to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    out = torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    assert out.shape == (256, 1024) and out.dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="Invalid scaling configuration"):
        torch._scaled_mm(
            a,
            b.t(),
            scale_a=torch.ones(256, 1, device="cuda"),
            scale_b=one.reshape(1, 1),
            out_dtype=torch.bfloat16,
        )
    ok, bad = fake_hopper.of("scaled_mm")
    assert "error" not in ok.detail and ok.detail["mat2"]["stride"] == (1, 512)
    assert bad.detail["scale_a"]["shape"] == (256, 1) and "Invalid scaling" in bad.detail["error"]


def test_capability_and_availability_are_patched_only_inside():
    with fake_cuda((12, 0)):
        assert torch.cuda.is_available()
        assert torch.cuda.get_device_capability() == (12, 0)
    assert not torch.cuda.is_available()


def test_ctx_runs_a_function_forward_and_backward(fake_hopper):
    class Square(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return 2 * x * g

    ctx = Ctx((True,))
    x = torch.randn(3, device="cuda")
    assert Square.backward(ctx, Square.forward(ctx, x)).shape == (3,)


def test_a_lost_host_float_reads_as_one_and_a_device_scalar_as_zero(fake_hopper):
    step = torch.tensor(0.0)
    torch._foreach_add_([step], 1.0)  # the fake mode drops the constant: its value is unknown
    assert torch.stack([step]).tolist() == [1.0]
    assert fake_hopper.host_syncs() == 0  # a host tensor: no wait for the device
    assert torch.ones((), device="cuda").item() == 0.0
    assert fake_hopper.host_syncs() == 1


def _adamw_lists(state_steps_device: str) -> dict:
    params = [torch.randn(64, device="cuda") for _ in range(2)]
    return {
        "self": params,
        "grads": [torch.randn_like(p) for p in params],
        "exp_avgs": [torch.zeros_like(p) for p in params],
        "exp_avg_sqs": [torch.zeros_like(p) for p in params],
        "max_exp_avg_sqs": [],
        "state_steps": [torch.zeros((), device=state_steps_device) for _ in params],
    }


_ADAMW = {"beta1": 0.9, "beta2": 0.999, "weight_decay": 0.0, "eps": 1e-8, "amsgrad": False, "maximize": False}


def test_the_device_check_refuses_a_fused_adamw_with_host_step_counters(fake_hopper):
    # FakeTensorMode alone runs this; a GPU raises "Expected all tensors to be on the same device, but got
    # state_steps is on cpu" (issue 39)
    with pytest.raises(DeviceMismatch, match="state_steps.*on cpu"):
        torch._fused_adamw_(*_adamw_lists("cpu").values(), lr=1e-3, **_ADAMW)
    (event,) = fake_hopper.of("device_mismatch")
    assert event.op == "aten._fused_adamw_.default"
    fake_hopper.device_errors.clear()  # raised on purpose


def test_the_fused_adamw_rules_for_lr_grad_scale_and_found_inf(fake_hopper):
    lists = list(_adamw_lists("cuda").values())
    torch._fused_adamw_(*lists, lr=1e-3, **_ADAMW)
    torch._fused_adamw_(*lists, lr=1e-3, grad_scale=torch.ones((), device="cuda"), **_ADAMW)
    # tensor_lr with a host lr (its kernel reads lr.item()); the fake mode has no kernel to run it
    bound = {**_adamw_lists("cuda"), "lr": torch.tensor(1e-3), **_ADAMW}
    assert devices.mismatch(torch.ops.aten._fused_adamw_.tensor_lr, bound) is None
    bound["state_steps"] = [torch.zeros(()) for _ in bound["state_steps"]]
    assert "state_steps" in devices.mismatch(torch.ops.aten._fused_adamw_.tensor_lr, bound)
    for name in ("grad_scale", "found_inf"):  # torch's fused Adam moves both to the params' device first
        with pytest.raises(DeviceMismatch, match=name):
            torch._fused_adamw_(*lists, lr=1e-3, **{name: torch.ones(())}, **_ADAMW)
    assert fake_hopper.count("device_mismatch") == 2
    fake_hopper.device_errors.clear()


def test_a_0_dim_host_tensor_is_a_pointwise_input_but_not_an_output(fake_hopper):
    x = torch.randn(4, device="cuda")
    assert (x * torch.tensor(2.0)).device.type == "cuda"  # a CPU scalar operand, as TensorIterator takes it
    x.mul_(torch.tensor(2.0))
    torch.where(x > 0, x, torch.tensor(0.0))
    with pytest.raises(DeviceMismatch, match="written"):
        torch.tensor(2.0).mul_(x)  # the output on the host
    with pytest.raises(DeviceMismatch, match="shape \\(4,\\)"):
        x.mul_(torch.ones(4))  # more than one element: no CPU scalar
    fake_hopper.device_errors.clear()


def test_foreach_ops_follow_their_kernels(fake_hopper):
    xs = [torch.randn(4, device="cuda") for _ in range(2)]
    scalars = [torch.tensor(2.0) for _ in xs]
    torch._foreach_add_(xs, scalars)  # mixed devices: the per-tensor slow path, CPU scalars taken
    torch._foreach_mul_(xs, torch.tensor(2.0))  # mul/div read a host scalar tensor with .item()
    torch._foreach_add_([torch.tensor(0.0), torch.tensor(1.0)], 1.0)  # all on the host: no CUDA kernel
    torch._foreach_copy_(xs, [torch.zeros(4) for _ in xs])  # an explicit copy
    torch._foreach_add_(xs, torch.tensor(2.0))  # Python reads a 0-dim tensor as a Scalar (.item())
    with pytest.raises(DeviceMismatch, match="other"):
        torch._foreach_add_(xs, torch.tensor(2.0), alpha=1.0)  # .Tensor: the fast route wants it on cuda
    with pytest.raises(DeviceMismatch, match="written"):
        torch._foreach_add_(scalars, xs)  # host outputs
    assert fake_hopper.count("device_mismatch") == 2
    fake_hopper.device_errors.clear()
    # addcdiv's packed scalars are read on the host (the fake mode has no kernel for them: rule only)
    addcdiv = torch.ops.aten._foreach_addcdiv_.Tensor
    bound = {"self": xs, "tensor1": xs, "tensor2": xs}
    assert devices.mismatch(addcdiv, {**bound, "scalars": torch.tensor([1.0, 2.0])}) is None
    on_device = devices.mismatch(addcdiv, {**bound, "scalars": torch.tensor([1.0, 2.0], device="cuda")})
    assert "scalars must be a host tensor" in on_device


def test_a_caught_device_mismatch_still_fails_the_fake_block():
    with pytest.raises(AssertionError, match="_fused_adamw_"), fake_cuda():
        try:
            torch._fused_adamw_(*_adamw_lists("cpu").values(), lr=1e-3, **_ADAMW)
        except RuntimeError:
            pass  # what code under test might do; the block's exit still reports it


def test_the_rule_table_reads_torchs_native_functions():
    aten = torch.ops.aten
    assert devices.rule_of(aten._fused_adamw_.default) == "same"
    assert devices.rule_of(aten._fused_adamw_.tensor_lr) == "same"
    assert devices.rule_of(aten.mul.Tensor) == devices.rule_of(aten.add_.Tensor) == "iterator"
    assert devices.rule_of(aten._foreach_add_.List) == "foreach"
    assert devices.rule_of(aten.copy_.default) == "copy"
    assert devices.rule_of(aten.mm.default) == "same"
    assert set(devices.OP_RULES.values()) <= set(devices.RULES)


@pytest.mark.parametrize(
    "flags", [{}, {"foreach": True}, {"foreach": False}, {"fused": True}, {"capturable": True}], ids=str
)
@pytest.mark.parametrize("optimizer", [torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD])
def test_torchs_own_optimizers_pass_the_device_check(fake_hopper, optimizer, flags):
    # torch's optimizers run on GPUs with every flag: the rules must not refuse any of their ops
    if optimizer is torch.optim.SGD and "capturable" in flags:
        pytest.skip("SGD has no capturable flag")
    if optimizer is torch.optim.SGD and "fused" in flags:
        pytest.skip("torch._fused_sgd_ has no fake kernel to run under the fake mode")
    params = [torch.nn.Parameter(torch.randn(64, 32, device="cuda")) for _ in range(2)]
    kwargs = {"momentum": 0.9} if optimizer is torch.optim.SGD else {}
    opt = optimizer(params, lr=1e-3, **kwargs, **flags)
    scaler = torch.amp.GradScaler("cuda")
    for _ in range(2):
        scale = scaler.scale(torch.ones((), device="cuda"))
        for p in params:
            p.grad = torch.randn_like(p) * scale
        scaler.step(opt)
        scaler.update()
    assert fake_hopper.device_errors == []
