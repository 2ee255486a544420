"""Fake-CUDA tier: a CPU stochastic-rounding generator for a CUDA layer is refused with a ValueError naming
both devices, at construction and at the forward of a layer moved by ``.cuda()``, not a crash inside
``torch.rand`` at the first backward. Runs on a CUDA build of torch without a GPU: ``device="cuda"`` tensors
are FakeTensors under ``FakeTensorMode``; ``torch.Generator()`` is a CPU generator. Self-contained (no
conftest fixture)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from mixprec.lowbit import LowbitLinear, convert_to_lowbit_training
from mixprec.lowbit.gemm import LowbitLinearFunction

pytestmark = pytest.mark.skipif(
    torch.version.cuda is None, reason="needs a CUDA build of torch (fake CUDA tensors, no GPU needed)"
)

CPU_ON_CUDA = r"generator is on cpu, the layer's weight on cuda:0.*torch.Generator\(device='cuda:0'\)"
SR_RECIPES = ["nvfp4", "fprop=mxfp8,mxfp8 dgrad=mxfp8,mxfp8 wgrad=mxfp8,mxfp8 sr=on rht=off"]


@pytest.mark.parametrize("recipe", SR_RECIPES)
def test_a_cuda_layer_refuses_a_cpu_generator_at_construction(recipe: str) -> None:
    g = torch.Generator().manual_seed(0)
    with FakeTensorMode():
        with pytest.raises(ValueError, match=CPU_ON_CUDA):
            LowbitLinear(256, 128, device="cuda", recipe=recipe, generator=g)
        with pytest.raises(ValueError, match=CPU_ON_CUDA):
            LowbitLinear.from_linear(nn.Linear(256, 128, device="cuda"), recipe, generator=g)
        assert LowbitLinear(256, 128, device="cuda", recipe=recipe).weight.device.type == "cuda"


def test_convert_refuses_and_leaves_the_model_as_it_was() -> None:
    g = torch.Generator().manual_seed(0)
    with FakeTensorMode():
        model = nn.Sequential(
            nn.Linear(256, 256, device="cuda"), nn.GELU(), nn.Linear(256, 128, device="cuda")
        )
        before = list(model)
        with pytest.raises(ValueError, match=r"generator is on cpu, the weight of '0' on cuda:0"):
            convert_to_lowbit_training(model, "nvfp4", generator=g)
        assert list(model) == before


def test_a_layer_moved_to_cuda_after_construction_is_refused_at_forward() -> None:
    layer = LowbitLinear(256, 128, recipe="nvfp4", generator=torch.Generator().manual_seed(0))
    with FakeTensorMode(allow_non_fake_inputs=True):
        moved = layer.cuda()
        assert moved.weight.device.type == "cuda" and moved.generator.device.type == "cpu"
        x = torch.randn(64, 256, device="cuda")
        with pytest.raises(ValueError, match="generator is on cpu, the input on cuda:0"):
            moved(x)


def test_meta_construction_then_cuda_placement_is_caught_at_forward() -> None:
    g = torch.Generator().manual_seed(0)
    with torch.device("meta"):
        deferred = LowbitLinear(256, 128, recipe="nvfp4", generator=g)  # deferred init takes any generator
    with FakeTensorMode(allow_non_fake_inputs=True):
        placed = deferred.to_empty(device="cuda")
        with pytest.raises(ValueError, match="generator is on cpu, the input on cuda:0"):
            placed(torch.empty(64, 256, device="cuda"))


@pytest.mark.filterwarnings("ignore:mixprec.lowbit")
def test_without_a_generator_the_sr_backward_draws_on_the_layers_device(monkeypatch) -> None:
    # The forward and backward of the autograd.Function called directly (no autograd under fake CUDA): the
    # stochastic rounding noise comes from CUDA's default generator, on the tensors' device. An sm80 device
    # has no fp8 tensor cores, so every GEMM is the emulation whatever paths lowbit.gemm has.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with FakeTensorMode():
        layer = LowbitLinear(256, 128, device="cuda", recipe="nvfp4")
        x = torch.randn(64, 256, device="cuda")
        ctx = _Ctx()
        out = LowbitLinearFunction.forward(ctx, x, layer.weight, layer.recipe, None)
        grad_x, grad_w, *_ = LowbitLinearFunction.backward(ctx, torch.randn_like(out))
        assert out.shape == (64, 128) and grad_x.device.type == grad_w.device.type == "cuda"


class _Ctx:
    """The parts of an autograd ctx that LowbitLinearFunction uses."""

    needs_input_grad = (True, True, False, False)

    def save_for_backward(self, *tensors: torch.Tensor) -> None:
        self.saved_tensors = tensors
