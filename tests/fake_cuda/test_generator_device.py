"""Fake-CUDA tier: where stochastic rounding draws on a CUDA layer (``mixprec.lowbit.sr``).

A CPU generator given to a CUDA layer whose recipe draws is refused with a ValueError naming both devices, at
construction and at the forward of a layer moved by ``.cuda()``, not a crash inside ``torch.rand`` at the
first backward; a recipe that draws nothing never checks one; without one, every recipe of a model converted
on the CPU and moved to CUDA trains there, drawing from a generator the layers made on CUDA; and
``benchmarks/lowbit_lm.py`` converts and trains each of its modes on a CUDA model. Runs on a CUDA build of
torch without a GPU: ``device="cuda"`` tensors are FakeTensors under ``FakeTensorMode``; ``torch.Generator()``
is a CPU generator (inside ``fake_cuda`` a ``FakeCudaGenerator``, whose device the recorder reads).
"""

from __future__ import annotations

import importlib.util
import itertools
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from fake_cuda.harness import Recorder, direct_autograd, fake_cuda
from mixprec.lowbit import (
    RECIPES,
    LowbitLinear,
    convert_to_lowbit_training,
    get_recipe,
    load_sr_state_dict,
    sr_state_dict,
)
from mixprec.lowbit.gemm import LowbitLinearFunction
from mixprec.lowbit.sr import draws

pytestmark = pytest.mark.skipif(
    torch.version.cuda is None, reason="needs a CUDA build of torch (fake CUDA tensors, no GPU needed)"
)

CPU_ON_CUDA = r"generator is on cpu, the layer's weight on cuda:0.*torch.Generator\(device='cuda:0'\)"
SR_RECIPES = [
    "nvfp4",
    "fprop=mxfp8_floor,mxfp8_floor dgrad=mxfp8_floor,mxfp8_floor wgrad=mxfp8_floor,mxfp8_floor sr=on rht=off",
]


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


# Every named recipe and the switches' other settings (nvfp4 without SR draws nothing; mxfp8 with it draws).
ALL_RECIPES = [*RECIPES, "nvfp4 sr=off", "nvfp4 rht=off", "mxfp8 sr=on"]
LOWBIT_LM = Path(__file__).resolve().parents[2] / "benchmarks" / "lowbit_lm.py"


def _train_step(model: nn.Module, x: torch.Tensor, recorder: Recorder) -> list:
    """A forward under bf16 autocast and each low-bit layer's backward (autograd's engine does not run under
    fake CUDA); the :class:`Applied` calls, after checking that no random op drew from a foreign generator."""
    with direct_autograd(LowbitLinearFunction) as calls, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the emulated GEMMs say so
        with torch.autocast("cuda", dtype=torch.bfloat16):
            model(x)
        for call in calls:
            call.backward(torch.randn_like(call.output))
    assert recorder.of("bad_generator") == []
    return calls


@pytest.mark.parametrize("recipe", ALL_RECIPES)
def test_every_recipe_trains_on_cuda_after_a_cpu_conversion(recipe: str) -> None:
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))  # built on the CPU
    convert_to_lowbit_training(model, recipe, seed=7)
    with fake_cuda((9, 0), allow_non_fake_inputs=True) as recorder:
        model.cuda()
        calls = _train_step(model, torch.randn(32, 64, device="cuda"), recorder)
        assert len(calls) == 2 and all(c.output.device.type == "cuda" for c in calls)
        state = sr_state_dict(model)["0"]
        if draws(get_recipe(recipe)):
            # the draws came from the layers' own generator, made on CUDA from the seed, none on the CPU
            assert all(c.ctx.generator is model[0].sr_generators.on("cuda:0") for c in calls)
            assert all(c.ctx.generator.device == torch.device("cuda", 0) for c in calls)
            assert state["seed"] == 7 and list(state["generators"]) == ["cuda:0"]
        else:
            assert all(c.ctx.generator is None for c in calls) and state["generators"] == {}


@pytest.mark.parametrize("recipe", [r for r in ALL_RECIPES if not draws(get_recipe(r))])
def test_a_recipe_that_draws_nothing_trains_on_cuda_with_a_cpu_generator(recipe: str) -> None:
    # benchmarks/lowbit_lm.py gave a CUDA model a CPU generator: fp8_tensorwise, which draws nothing, failed
    with fake_cuda((9, 0)) as recorder:
        cpu = torch.Generator().manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 128, device="cuda"), nn.GELU(), nn.Linear(128, 64, device="cuda"))
        convert_to_lowbit_training(model, recipe, generator=cpu)
        calls = _train_step(model, torch.randn(32, 64, device="cuda"), recorder)
        assert len(calls) == 2 and all(c.ctx.generator is None for c in calls)


def _pair(seed: int) -> nn.Module:
    return convert_to_lowbit_training(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)), "nvfp4", seed=seed)


def test_the_layers_own_generators_follow_the_model_and_their_state_loads_across_devices() -> None:
    model, fresh = _pair(3), _pair(0)
    with fake_cuda((9, 0), allow_non_fake_inputs=True) as recorder:
        with direct_autograd(LowbitLinearFunction) as calls, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model(torch.randn(16, 64))  # on the CPU first
        assert all(c.ctx.generator.device.type == "cpu" for c in calls)
        model.to("cuda")
        _train_step(model, torch.randn(16, 64, device="cuda"), recorder)
        saved = sr_state_dict(model)["0"]
        assert list(saved["generators"]) == ["cpu", "cuda:0"]
        assert all(t.device.type == "cpu" and t.dtype == torch.uint8 for t in saved["generators"].values())
    if torch.cuda.is_available():  # a real CUDA generator would refuse the fake one's (CPU-sized) state
        return
    # a state saved on CUDA loads into a CPU model where no CUDA generator can be made (and back): each
    # device's state is kept for it, and set when that device's generator is made
    load_sr_state_dict(fresh, {"0": saved})
    again = sr_state_dict(fresh)["0"]
    assert again["seed"] == 3 and list(again["generators"]) == ["cpu", "cuda:0"]
    assert all(torch.equal(again["generators"][k], saved["generators"][k]) for k in saved["generators"])
    with fake_cuda((9, 0)):
        made = fresh[0].sr_generators.on("cuda:0")
    assert made.device == torch.device("cuda", 0)
    assert torch.equal(made.get_state(), saved["generators"]["cuda:0"])


@pytest.mark.parametrize("mode", ["fp8_tensorwise", "fp8_rowwise", "mxfp8", "nvfp4", "nvfp4 sr=off"])
def test_the_lowbit_lm_benchmark_converts_and_trains_a_cuda_model(mode: str) -> None:
    spec = importlib.util.spec_from_file_location("lowbit_lm", LOWBIT_LM)
    lowbit_lm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lowbit_lm)
    widths = (64, 256, 256, 256, 10)  # the benchmark's classify / teacher MLP, built on the CPU as there
    layers = [m for a, b in itertools.pairwise(widths) for m in (nn.Linear(a, b), nn.GELU())]
    model = nn.Sequential(*layers[:-1])
    with fake_cuda((9, 0), allow_non_fake_inputs=True) as recorder:
        model.cuda()  # then moved to the device and converted, as lowbit_lm.Run does
        lowbit_lm._convert(mode, model, seed=0)
        calls = _train_step(model, torch.randn(64, 64, device="cuda"), recorder)
        assert len(calls) == (2 if mode.split()[0] == "nvfp4" else 4)  # 4-bit: first and last stay bf16
