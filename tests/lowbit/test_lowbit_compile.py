"""Every low-bit recipe under ``torch.compile(fullgraph=True)`` (issue 39 item 3), stochastic rounding from a
``torch.Generator`` included: one graph, no recompilation once each model has compiled (several stepped
alternately), and the compiled loss, gradients, parameters after an optimizer step and generator state
equal to eager's.

The ``aot_eager`` backend traces as inductor does (Dynamo, AOTAutograd, the same graphs and guards) and
runs the ops eagerly, so a compiled step is eager's bit for bit, a second or a few per recipe on a 2-core
CPU; inductor's own compile of these recipes takes a minute there (tests/float8/test_float8_compile.py runs it
once, and tests/lowbit/test_training.py for mxfp8).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from mixprec.lowbit import RECIPES, convert_to_lowbit_training, get_recipe, quantize
from mixprec.lowbit import gemm as gemm_module
from mixprec.lowbit.kernels import KERNELS
from mixprec.lowbit.quantize import hold_generator


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    # Models of one class share code objects: other tests' compiled models would count against Dynamo's
    # recompile limit (8 per code object) and its counters.
    torch._dynamo.reset()
    counters.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the emulated GEMMs' once-per-process warning is tested elsewhere
        yield
    torch._dynamo.reset()


def _model(recipe: str, generator: torch.Generator | None, seed: int = 0) -> nn.Module:
    """One low-bit layer: its input requires grad, so a step runs all three GEMMs and an optimizer step."""
    torch.manual_seed(seed)
    return convert_to_lowbit_training(nn.Linear(64, 32), recipe, generator=generator)


def _step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(step), requires_grad=True)
    loss = model(x).square().mean()
    loss.backward()
    grad_x = x.grad
    assert grad_x is not None
    opt.step()
    opt.zero_grad()
    return loss.detach(), grad_x


def _unique_graphs() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_every_recipe_compiles_in_one_graph_and_steps_as_eager(recipe: str) -> None:
    # Each model draws its stochastic rounding from its own generator, seeded alike.
    gen_c, gen_e = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    model, eager = _model(recipe, gen_c), _model(recipe, gen_e)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    opt_c = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    for step in range(2):
        loss_c, grad_x_c = _step(compiled, opt_c, step)  # compiled first: nothing warmed by eager
        loss_e, grad_x_e = _step(eager, opt_e, step)
        assert torch.equal(loss_c, loss_e), (recipe, step)
        assert torch.equal(grad_x_c, grad_x_e), (recipe, step)
        for (name, a), b in zip(model.state_dict().items(), eager.state_dict().values(), strict=True):
            assert torch.equal(a, b), (recipe, step, name)
        assert torch.equal(gen_c.get_state(), gen_e.get_state()), (recipe, step)  # drew as much
    assert _unique_graphs() == 1
    if get_recipe(recipe).sr:
        assert not torch.equal(gen_c.get_state(), torch.Generator().manual_seed(7).get_state())


def test_interleaved_models_compile_once_each_and_then_never_recompile() -> None:
    # Three recipes, stochastic rounding from torch's global generator and from a generator of its own
    # among them, compiled and stepped alternately; after each has compiled once, a recompilation is an
    # error. The eager copies, stepped alike from the same global seeds, end bitwise the same.
    generator = torch.Generator().manual_seed(3)
    recipes = (("fp8_tensorwise", None), ("mxfp8 sr=on", None), ("fp8_rowwise sr=on", generator))
    models = [_model(r, g, seed=i) for i, (r, g) in enumerate(recipes)]
    eagers = [copy.deepcopy(m) for m in models]  # the last with a copy of the generator
    compiled = [torch.compile(m, backend="aot_eager", fullgraph=True) for m in models]

    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in compiled]
    opts_e = [torch.optim.SGD(m.parameters(), lr=0.05) for m in eagers]

    def run(steppers: list, optimizers: list, steps: range) -> None:
        for step in steps:
            torch.manual_seed(100 + step)  # what the global generator's draws start from
            for m, o in zip(steppers, optimizers, strict=True):
                _step(m, o, step)

    run(compiled, opts, range(1))
    assert _unique_graphs() == len(recipes)
    with torch._dynamo.config.patch(error_on_recompile=True):
        run(compiled, opts, range(1, 20))
    assert _unique_graphs() == len(recipes)
    run(eagers, opts_e, range(20))
    for (recipe, _), m, e in zip(recipes, models, eagers, strict=True):
        assert torch.equal(m.weight, e.weight) and torch.equal(m.bias, e.bias), recipe
    assert torch.equal(models[2].generator.get_state(), eagers[2].generator.get_state())


def test_a_layer_given_a_new_generator_recompiles_once_and_draws_from_it() -> None:
    model = _model("fp8_rowwise sr=on", torch.Generator().manual_seed(1))
    eager = copy.deepcopy(model)  # a copied generator: a new object, held at its first forward
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    opt_c = torch.optim.SGD(model.parameters(), lr=0.05)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.05)
    _step(compiled, opt_c, 0)
    _step(eager, opt_e, 0)
    model.generator, eager.generator = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    loss_c, grad_x_c = _step(compiled, opt_c, 1)
    loss_e, grad_x_e = _step(eager, opt_e, 1)
    assert torch.equal(loss_c, loss_e) and torch.equal(grad_x_c, grad_x_e)
    assert torch.equal(model.weight, eager.weight)
    assert torch.equal(model.generator.get_state(), eager.generator.get_state())
    assert _unique_graphs() == 2  # the generator is guarded by identity


def test_compiled_quantize_draws_from_a_held_generator_and_names_the_fix_otherwise() -> None:
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))

    def fn(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        return quantize(x, "nvfp4", stochastic=True, generator=g).dequantize()

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    g = torch.Generator().manual_seed(4)
    with pytest.raises(RuntimeError, match="hold_generator"):
        compiled(x, g)  # never held: nothing outside the graph made it reachable
    hold_generator(g)
    expected_g = torch.Generator().manual_seed(4)
    g.manual_seed(4)
    assert torch.equal(compiled(x, g), fn(x, expected_g))
    assert torch.equal(g.get_state(), expected_g.get_state())


def _v2_runs_on_this_cpu() -> bool:
    if gemm_module._SCALED_MM_V2 is None:
        return False
    a = torch.zeros(16, 16).to(torch.float8_e4m3fn)
    f = torch.nn.functional
    try:
        f.scaled_mm(
            a, a.t(), torch.ones(()), f.ScalingType.TensorWise, torch.ones(()), f.ScalingType.TensorWise
        )
    except (NotImplementedError, RuntimeError):  # torch < 2.13 has no CPU kernel
        return False
    return True


def _rowwise_operands() -> tuple:
    rowwise = next(k for k in KERNELS if k.name == "fp8_rowwise")
    gen = torch.Generator().manual_seed(0)
    qa = quantize(torch.randn(32, 64, generator=gen), "fp8_rowwise")
    qb = quantize(torch.randn(48, 64, generator=gen), "fp8_rowwise")
    return rowwise, qa, qb


@pytest.mark.skipif(gemm_module._SCALED_MM_V2 is None, reason="this torch has no v2 scaled matmul")
def test_the_v2_scaled_mm_call_traces_in_one_graph() -> None:
    # The rowwise (sm89+), MXFP8 and NVFP4 kernel paths: torch 2.11's Dynamo cannot trace the binding
    # F.scaled_mm calls (a graph break: fullgraph failed on the H200), so mixprec calls aten's op. Traced
    # only (the backend runs nothing), so it checks this on a torch without the CPU kernel too.
    graphs: list[torch.fx.GraphModule] = []

    def capture(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return lambda *args: (torch.zeros(32, 48, dtype=torch.bfloat16),)

    rowwise, qa, qb = _rowwise_operands()
    torch.compile(gemm_module._scaled, backend=capture, fullgraph=True)(rowwise, qa, qb, torch.bfloat16)
    (graph,) = graphs
    assert sum("scaled_mm" in str(node.target) for node in graph.graph.nodes) == 1


@pytest.mark.skipif(not _v2_runs_on_this_cpu(), reason="this torch has no CPU _scaled_mm_v2 kernel")
def test_the_v2_scaled_mm_call_is_f_scaled_mm_eager_and_compiled() -> None:
    rowwise, qa, qb = _rowwise_operands()
    f = torch.nn.functional
    scale_a = gemm_module._operand_scale(qa, "row", False, 32)
    scale_b = gemm_module._operand_scale(qb, "row", True, 48)
    expected = f.scaled_mm(
        qa.data, qb.data.t(), scale_a, f.ScalingType.RowWise, scale_b, f.ScalingType.RowWise,
        swizzle_a=f.SwizzleType.NO_SWIZZLE, swizzle_b=f.SwizzleType.NO_SWIZZLE, output_dtype=torch.bfloat16,
    )  # fmt: skip
    assert torch.equal(gemm_module._scaled(rowwise, qa, qb, torch.bfloat16), expected)
    compiled = torch.compile(gemm_module._scaled, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(rowwise, qa, qb, torch.bfloat16), expected)
