"""The recorder catches each thing it is for, and flags nothing in a clean region."""

from __future__ import annotations

import pytest
import torch

from fake_cuda.harness import Ctx, fake_cuda


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
