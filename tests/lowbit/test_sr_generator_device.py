"""Where stochastic rounding draws (``mixprec.lowbit.sr``): a recipe that draws nothing never checks a
generator; one that draws takes a given generator on its weight's device only (another is refused with a
ValueError naming both devices, at construction, in ``from_linear``, ``convert_to_lowbit_training`` and
``Plan.apply``, which then change nothing, and at forward for a layer moved after construction), and
without one draws from generators it makes on each device from its seed. ``sr_state_dict`` keeps one state
per device, so a checkpoint saved on one device loads on another. On the CPU build the "cuda" side is a
FakeTensor (FakeTensorMode makes ``device="cuda"`` tensors without CUDA, but cannot draw random numbers
there, hence ``skip_init``); ``tests/fake_cuda/test_generator_device.py`` runs the CUDA side."""

from __future__ import annotations

import copy
import pickle
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.utils import skip_init

from mixprec import CompensatedOptimizer
from mixprec.lowbit import (
    RECIPES,
    LowbitLinear,
    convert_to_lowbit_training,
    get_recipe,
    load_sr_state_dict,
    sr_state_dict,
)
from mixprec.lowbit.sr import check_generator_device, draws
from mixprec.plan import PrecisionPlan
from mixprec.plan.measure import swapped_in


def _cuda_linear(fan_in: int, fan_out: int) -> nn.Linear:
    """An ``nn.Linear`` with (uninitialised) fake CUDA parameters; call under FakeTensorMode."""
    linear = nn.Linear(fan_in, fan_out, device="meta")
    linear.weight = nn.Parameter(torch.empty(fan_out, fan_in, device="cuda"))
    linear.bias = nn.Parameter(torch.empty(fan_out, device="cuda"))
    return linear


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))


def _step(model: nn.Module, seed: int = 1) -> list[torch.Tensor]:
    """One forward and backward on a fixed batch; the weight gradients (the SR-rounded ones)."""
    model.zero_grad(set_to_none=True)
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(seed))
    model(x).square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]


CPU_ON_CUDA = r"generator is on cpu, the layer's weight on cuda:0.*torch.Generator\(device='cuda:0'\)"
DRAWS = [name for name, recipe in RECIPES.items() if draws(recipe)]
DRAW_NOTHING = [name for name, recipe in RECIPES.items() if not draws(recipe)]


def test_only_stochastic_rounding_of_a_quantized_gradient_draws() -> None:
    assert DRAWS == ["nvfp4"] and "fp8_tensorwise" in DRAW_NOTHING
    assert not draws(get_recipe("nvfp4 sr=off")) and draws(get_recipe("mxfp8 sr=on"))
    assert not draws(
        get_recipe("fprop=mxfp8_rceil,mxfp8_rceil dgrad=hp,hp wgrad=hp,hp sr=on")
    )  # no go quantized


def test_the_check_compares_type_and_index_and_lets_meta_through() -> None:
    cpu = torch.Generator()
    check_generator_device(cpu, torch.device("cpu"), "the input")
    check_generator_device(cpu, torch.device("meta"), "the layer's weight")  # not placed yet
    with pytest.raises(ValueError, match="generator is on cpu, the input on cuda:1.*or no generator"):
        check_generator_device(cpu, torch.device("cuda:1"), "the input")
    cuda1 = SimpleNamespace(device=torch.device("cuda:1"))  # stands for torch.Generator(device="cuda:1")
    check_generator_device(cuda1, torch.device("cuda"), "the input")  # no index: the current device
    with pytest.raises(ValueError, match="generator is on cuda:1, the input on cuda:0"):
        check_generator_device(cuda1, torch.device("cuda:0"), "the input")
    with pytest.raises(ValueError, match="generator is on cuda:1, the input on cpu"):
        check_generator_device(cuda1, torch.device("cpu"), "the input")


def test_a_cuda_layer_with_a_cpu_generator_is_refused_at_construction_where_it_draws() -> None:
    g = torch.Generator().manual_seed(0)
    with FakeTensorMode():
        with pytest.raises(ValueError, match=CPU_ON_CUDA):
            LowbitLinear(32, 16, device="cuda", recipe="nvfp4", generator=g)
        linear = _cuda_linear(32, 16)
        with pytest.raises(ValueError, match=CPU_ON_CUDA):
            LowbitLinear.from_linear(linear, "nvfp4", generator=g)


@pytest.mark.parametrize("recipe", [*DRAW_NOTHING, "nvfp4 sr=off"])
def test_a_recipe_that_draws_nothing_never_checks_its_generator(recipe: str) -> None:
    g = torch.Generator().manual_seed(0)  # the CPU generator benchmarks/lowbit_lm.py gave a CUDA model
    with FakeTensorMode():
        assert LowbitLinear.from_linear(_cuda_linear(32, 16), recipe, generator=g).generator is g
        model = convert_to_lowbit_training(nn.Sequential(_cuda_linear(32, 16)), recipe, generator=g)
        assert isinstance(model[0], LowbitLinear)
        plan = PrecisionPlan({"0": recipe}, {}, {"0": "test"}, 0.01, {})
        assert isinstance(plan.apply(nn.Sequential(_cuda_linear(32, 16)), g)[0], LowbitLinear)


def test_convert_and_plan_apply_refuse_before_converting_anything() -> None:
    g = torch.Generator().manual_seed(0)
    with FakeTensorMode():
        model = nn.Sequential(nn.Linear(32, 32), _cuda_linear(32, 16))
        before = list(model)
        with pytest.raises(ValueError, match=r"generator is on cpu, the weight of '1' on cuda:0"):
            convert_to_lowbit_training(model, "nvfp4", generator=g)
        assert list(model) == before and not any(isinstance(m, LowbitLinear) for m in model)
        plan = PrecisionPlan({"0": "nvfp4", "1": "nvfp4"}, {}, {"0": "t", "1": "t"}, 0.01, {})
        with pytest.raises(ValueError, match=r"generator is on cpu, the weight of '1' on cuda:0"):
            plan.apply(model, g)
        assert list(model) == before  # the CPU layer '0' was not swapped either


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


def test_with_a_seed_the_layers_draw_from_their_own_seeded_generator() -> None:
    # seed=5 draws what a CPU torch.Generator seeded with 5, given to every layer, draws: the same bits
    given = convert_to_lowbit_training(_mlp(), "nvfp4", generator=torch.Generator().manual_seed(5))
    own = convert_to_lowbit_training(_mlp(), "nvfp4", seed=5)
    for _ in range(2):
        assert all(torch.equal(a, b) for a, b in zip(_step(given), _step(own), strict=True))
    state = sr_state_dict(own)
    assert list(state) == ["0"] and state["0"]["seed"] == 5  # one source shared by the converted layers
    assert list(state["0"]["generators"]) == ["cpu"]
    assert torch.equal(state["0"]["generators"]["cpu"], given[0].generator.get_state())
    # without either, torch's default generator of the device draws (what trainers checkpoint): the
    # same draws as a CPU generator in torch's default state, and no SR state of the model's own
    default, seeded = _mlp(), _mlp()
    convert_to_lowbit_training(default, "nvfp4")
    convert_to_lowbit_training(seeded, "nvfp4", generator=torch.Generator().manual_seed(11))
    assert default[0].sr_generators is None and sr_state_dict(default) == {}
    torch.manual_seed(11)
    assert all(torch.equal(a, b) for a, b in zip(_step(default), _step(seeded), strict=True))
    with pytest.raises(ValueError, match="a generator or a seed, not both"):
        convert_to_lowbit_training(_mlp(), "nvfp4", generator=torch.Generator(), seed=1)
    with pytest.raises(TypeError, match="seed must be an int"):
        LowbitLinear(32, 16, recipe="nvfp4", seed=1.5)


def test_a_layers_own_generators_survive_deepcopy_and_pickle() -> None:
    model = convert_to_lowbit_training(_mlp(), "nvfp4", seed=3)
    _step(model)
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert clone[0].sr_generators is clone[2].sr_generators  # still one shared source
        assert all(torch.equal(a, b) for a, b in zip(_step(clone), _step(copy.deepcopy(model)), strict=True))


def test_sr_state_saved_on_another_device_loads_and_is_kept_for_it() -> None:
    # A GPU run's SR state (a CUDA Philox state is 16 bytes: seed and offset) resumed on a CPU-only machine:
    # the CUDA state is kept for that device; the CPU draws restore from the CPU state where there is one,
    # else start afresh from the saved seed.
    cuda_state = torch.tensor([7, 0, 0, 0, 0, 0, 0, 0, 32, 0, 0, 0, 0, 0, 0, 0], dtype=torch.uint8)
    model = convert_to_lowbit_training(_mlp(), "nvfp4", seed=99)
    load_sr_state_dict(model, {"0": {"seed": 7, "generators": {"cuda:0": cuda_state}}})
    fresh = convert_to_lowbit_training(_mlp(), "nvfp4", seed=7)
    assert all(torch.equal(a, b) for a, b in zip(_step(model), _step(fresh), strict=True))
    saved = sr_state_dict(model)["0"]
    assert saved["seed"] == 7 and list(saved["generators"]) == ["cpu", "cuda:0"]
    assert torch.equal(saved["generators"]["cuda:0"], cuda_state)  # passed through unchanged
    # and back: that state (CPU and CUDA) restores the CPU draws bitwise
    again = convert_to_lowbit_training(_mlp(), "nvfp4", seed=0)
    load_sr_state_dict(again, {"0": saved})
    assert all(torch.equal(a, b) for a, b in zip(_step(again), _step(model), strict=True))


def test_a_bad_sr_state_is_refused_and_changes_nothing() -> None:
    model = convert_to_lowbit_training(_mlp(), "nvfp4", seed=3)
    _step(model)
    before = sr_state_dict(model)
    cuda_state = torch.zeros(16, dtype=torch.uint8)
    bad_states = [
        ({"0": {"seed": 3, "generators": {"cpu": cuda_state}}}, ValueError, "not a state of a cpu generator"),
        ({"0": {"seed": 3, "generators": {"nowhere": cuda_state}}}, TypeError, "not a device string"),
        ({"0": {"seed": "x", "generators": {}}}, TypeError, "seed must be an int"),
        ({"0": before["0"]["generators"]["cpu"]}, TypeError, "own generators"),
        ({"2": before["0"]}, ValueError, r"SR state for modules \['2'\]"),
    ]
    for bad, error, match in bad_states:
        with pytest.raises(error, match=match):
            load_sr_state_dict(model, bad)
        assert _same(sr_state_dict(model), before)
    given = convert_to_lowbit_training(_mlp(), "nvfp4", generator=torch.Generator().manual_seed(1))
    state = given[0].generator.get_state()
    with pytest.raises(ValueError, match="not a state of a cpu generator.*device-specific"):
        load_sr_state_dict(given, {"0": cuda_state})  # a CUDA generator's state for a CPU generator
    assert torch.equal(given[0].generator.get_state(), state)


def test_compensated_optimizer_state_from_a_gpu_loads_on_a_cpu() -> None:
    param = nn.Parameter(torch.randn(64, dtype=torch.bfloat16))
    opt = CompensatedOptimizer(torch.optim.AdamW([param], lr=1e-2), "stochastic", seed=3)
    param.grad = torch.randn_like(param)
    opt.step()
    state = opt.state_dict()
    cuda_state = torch.zeros(16, dtype=torch.uint8)
    state["generators"] = {**state["generators"], "cuda:0": cuda_state}  # as a 2-device run saves it
    opt.load_state_dict(state)
    assert torch.equal(opt.state_dict()["generators"]["cuda:0"], cuda_state)
    state["generators"] = {"cpu": cuda_state}
    before = opt.state_dict()["generators"]
    with pytest.raises(ValueError, match="not a state of a cpu generator"):
        opt.load_state_dict(state)
    assert _same(opt.state_dict()["generators"], before)


def test_the_planners_per_device_generators_go_to_the_layer_on_that_device() -> None:
    g = torch.Generator().manual_seed(0)
    other = SimpleNamespace(device=torch.device("cuda:0"))  # never taken for a CPU layer
    module = swapped_in(nn.Linear(32, 16), "nvfp4", {torch.device("cpu"): g, torch.device("cuda:0"): other})
    assert isinstance(module, LowbitLinear) and module.generator is g


def _same(a: object, b: object) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b
