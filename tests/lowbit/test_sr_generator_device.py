"""A stochastic-rounding generator on another device than its layer is refused with a ValueError naming both
devices: at construction (``LowbitLinear``, ``from_linear``, ``convert_to_lowbit_training``, which then
converts nothing) and at forward time for a layer moved after construction, instead of a crash inside
``torch.rand`` at the first backward. On the CPU build the "cuda" side is a FakeTensor (FakeTensorMode makes
``device="cuda"`` tensors without CUDA, but cannot draw random numbers there, hence ``skip_init``);
``tests/fake_cuda/test_generator_device.py`` runs the same on a CUDA build."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.utils import skip_init

from mixprec.lowbit import LowbitLinear, convert_to_lowbit_training
from mixprec.lowbit.linear import check_generator_device
from mixprec.plan.measure import swapped_in


def _cuda_linear(fan_in: int, fan_out: int) -> nn.Linear:
    """An ``nn.Linear`` with (uninitialised) fake CUDA parameters; call under FakeTensorMode."""
    linear = nn.Linear(fan_in, fan_out, device="meta")
    linear.weight = nn.Parameter(torch.empty(fan_out, fan_in, device="cuda"))
    linear.bias = nn.Parameter(torch.empty(fan_out, device="cuda"))
    return linear


CPU_ON_CUDA = r"generator is on cpu, the layer's weight on cuda:0.*torch.Generator\(device='cuda:0'\)"


def test_the_check_compares_type_and_index_and_lets_meta_through() -> None:
    cpu = torch.Generator()
    check_generator_device(cpu, torch.device("cpu"), "the input")
    check_generator_device(cpu, torch.device("meta"), "the layer's weight")  # not placed yet
    with pytest.raises(ValueError, match="generator is on cpu, the input on cuda:1"):
        check_generator_device(cpu, torch.device("cuda:1"), "the input")
    cuda1 = SimpleNamespace(device=torch.device("cuda:1"))  # stands for torch.Generator(device="cuda:1")
    check_generator_device(cuda1, torch.device("cuda"), "the input")  # no index: the current device
    with pytest.raises(ValueError, match="generator is on cuda:1, the input on cuda:0"):
        check_generator_device(cuda1, torch.device("cuda:0"), "the input")
    with pytest.raises(ValueError, match="generator is on cuda:1, the input on cpu"):
        check_generator_device(cuda1, torch.device("cpu"), "the input")


def test_a_cuda_layer_with_a_cpu_generator_is_refused_at_construction() -> None:
    g = torch.Generator().manual_seed(0)
    with FakeTensorMode():
        with pytest.raises(ValueError, match=CPU_ON_CUDA):
            LowbitLinear(32, 16, device="cuda", recipe="nvfp4", generator=g)
        linear = _cuda_linear(32, 16)
        with pytest.raises(ValueError, match=CPU_ON_CUDA):
            LowbitLinear.from_linear(linear, "nvfp4", generator=g)


def test_convert_refuses_before_converting_anything() -> None:
    g = torch.Generator().manual_seed(0)
    with FakeTensorMode():
        model = nn.Sequential(nn.Linear(32, 32), _cuda_linear(32, 16))
        before = list(model)
        with pytest.raises(ValueError, match=r"generator is on cpu, the weight of '1' on cuda:0"):
            convert_to_lowbit_training(model, "nvfp4", generator=g)
        assert list(model) == before and not any(isinstance(m, LowbitLinear) for m in model)


def test_meta_construction_keeps_working_and_a_cpu_layer_takes_a_cpu_generator() -> None:
    g = torch.Generator().manual_seed(0)
    with torch.device("meta"):
        deferred = LowbitLinear(32, 16, recipe="nvfp4", generator=g)
        meta_linear = nn.Linear(32, 16)
    assert deferred.weight.is_meta and deferred.generator is g
    assert LowbitLinear.from_linear(meta_linear, "nvfp4", generator=g).generator is g
    layer = LowbitLinear.from_linear(nn.Linear(32, 16), "nvfp4", generator=g)
    x = torch.randn(4, 32, requires_grad=True)
    layer(x).sum().backward()  # stochastic rounding drew from g on the CPU
    assert x.grad is not None and layer.weight.grad is not None


def test_an_input_on_another_device_than_the_generator_is_refused_at_forward() -> None:
    g = torch.Generator()
    layer = LowbitLinear(32, 16, recipe="nvfp4", generator=g)  # e.g. moved by .cuda() later
    with FakeTensorMode():
        # built on meta, then placed on CUDA (skip_init's to_empty): the generator stayed on the CPU
        placed = skip_init(LowbitLinear, 32, 16, device="cuda", recipe="nvfp4", generator=g)
        assert placed.weight.device.type == "cuda"
        x = torch.empty(4, 32, device="cuda")
        for module in (layer, placed):
            with pytest.raises(ValueError, match="generator is on cpu, the input on cuda:0"):
                module(x)


def test_the_planners_per_device_generators_go_to_the_layer_on_that_device() -> None:
    g = torch.Generator().manual_seed(0)
    other = SimpleNamespace(device=torch.device("cuda:0"))  # never taken for a CPU layer
    module = swapped_in(nn.Linear(32, 16), "nvfp4", {torch.device("cpu"): g, torch.device("cuda:0"): other})
    assert isinstance(module, LowbitLinear) and module.generator is g
