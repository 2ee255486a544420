"""Every float8 config's three GEMMs on fake CUDA: accepted by ``_scaled_mm``'s meta kernel, no host cost.

A bf16 ``nn.Sequential(nn.Linear)`` on fake CUDA is converted by ``convert_to_float8_training`` for each
config mixprec.float8 accepts (every recipe name times every scaling the recipe takes, so a new recipe or
scaling is covered here without a new test), at the four capabilities and two sizes. The module's own
forward runs with its autograd function called directly (:func:`fake_cuda.harness.direct_autograd`), then
that function's backward. Every ``_scaled_mm`` the recorder saw must have been accepted by torch's meta
kernel (the scale-layout and size checks a GPU makes), and the second step must neither wait for the
device nor copy from the host (delayed scaling's amax history stays on the device).
"""

from __future__ import annotations

import warnings
from contextlib import nullcontext
from unittest import mock

import pytest
import torch
from torch import nn

from fake_cuda.harness import Recorder, direct_autograd, fake_cuda
from mixprec.float8 import Float8Config, Float8GemmConfig, Float8Linear, convert_to_float8_training
from mixprec.float8.config import RECIPE_NAMES, SCALINGS
from mixprec.lowbit import gemm
from mixprec.lowbit.gemm import LowbitLinearFunction

pytestmark = pytest.mark.skipif(torch.version.cuda is None, reason="needs a CUDA build of torch (fake tier)")


def _configs() -> dict[str, Float8Config]:
    """Every (recipe, scaling) pair :class:`Float8Config` accepts, by ``recipe-scaling``."""
    out = {}
    for name in RECIPE_NAMES:
        for scaling in SCALINGS:
            try:
                out[f"{name}-{scaling}"] = Float8Config.from_recipe_name(name, scaling=scaling)
            except ValueError:  # e.g. delayed rowwise: the config refuses it, so no model can run it
                continue
    return out


CONFIGS = _configs()
# (rows M, in K, out N): every dim above 128; and a small one whose M (20) is no multiple of 16, which
# torch's _scaled_mm takes in fprop and dgrad (it checks K and N only; M is wgrad's K there).
BIG, SMALL = (256, 512, 1024), (20, 64, 48)
# The _scaled_mm calls of a step per recipe (fprop, dgrad, wgrad) where every dim is a multiple of 16;
# rowwise_with_gw_hp's wgrad is high precision. A recipe not listed is checked for everything else.
_CALLS_BIG = {"tensorwise": 3, "rowwise": 3, "rowwise_with_gw_hp": 2}
# At SMALL, wgrad's reduction dim is M = 20: no kernel takes it (mixprec emulates it, or torch would refuse).
_CALLS_SMALL = {"tensorwise": 2, "rowwise": 2, "rowwise_with_gw_hp": 2}


def _legacy_api(api: str):
    """``torch._scaled_mm`` for mixprec.lowbit's GEMMs too: the meta kernel checks its scales' shapes
    and dtypes as CUDA does; ``_scaled_mm_v2``'s only infers the output shape (its checks run in C++)."""
    return mock.patch.object(gemm, "_SCALED_MM_V2", None) if api == "_scaled_mm" else nullcontext()


def _step(model: nn.Module, m: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One forward (the module's own, its function applied directly) and the function's backward."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with direct_autograd(LowbitLinearFunction) as calls:
        out = model(x)
    (call,) = calls
    grads = call.backward(torch.randn_like(call.output))
    return out, grads[0], grads[1]


def _accepted(recorder: Recorder) -> list[dict]:
    calls = [e.detail for e in recorder.of("scaled_mm")]
    assert [c.get("error") for c in calls] == [None] * len(calls), calls
    return calls


@pytest.mark.parametrize("api", ["_scaled_mm", "scaled_mm_v2"])
@pytest.mark.parametrize("dims", [BIG, SMALL], ids=["big", "small"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_each_config_reaches_scaled_mm_accepted_and_without_host_cost(capability, name, dims, api) -> None:
    m, k, n = dims
    config = CONFIGS[name]
    with fake_cuda(capability) as recorder, _legacy_api(api), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the emulation's once-per-process warning is tested on the CPU
        model = nn.Sequential(nn.Linear(k, n, device="cuda", dtype=torch.bfloat16))
        convert_to_float8_training(model, config=config)
        layer = model[0]
        assert isinstance(layer, Float8Linear) and layer.config == config
        steps = []
        for _ in range(2):
            recorder.reset()
            out, grad_x, grad_w = _step(model, m, k)
            steps.append((list(recorder.events), _accepted(recorder)))
        assert out.shape == (m, n) and out.dtype == torch.bfloat16 and out.device.type == "cuda"
        assert grad_x.shape == (m, k) and grad_x.dtype == torch.bfloat16 and grad_x.device.type == "cuda"
        assert grad_w.shape == (n, k) and grad_w.dtype == torch.bfloat16 and grad_w.device.type == "cuda"
        if config.delayed:  # the history advanced on the device: input, weight, grad_output rows
            assert layer.amax_history.device.type == "cuda" and layer.amax_history.shape[0] == 3
    events, calls = steps[1]
    assert recorder.host_syncs() == 0, [e for e in events if e.kind in ("sync", "d2h")]
    assert recorder.count("h2d") == 0, [e for e in events if e.kind == "h2d"]
    expected = (_CALLS_BIG if dims == BIG else _CALLS_SMALL).get(config.recipe)
    if expected is not None:
        assert len(calls) == expected, calls
    for call in calls:  # the GEMM operand dtypes a scaled GEMM takes: e4m3 forward, e5m2 only for go
        assert call["self"]["dtype"] in (torch.float8_e4m3fn, torch.float8_e5m2), call
        assert call["mat2"]["dtype"] == torch.float8_e4m3fn, call
        assert call["out_dtype"] in (torch.bfloat16, torch.float32), call


def test_rowwise_with_gw_hp_dgrad_at_512_to_1024_is_accepted(fake_hopper) -> None:
    """The crash: the dgrad paired rowwise go's (M, 1) scale with the weight's tensorwise (1, 1) one,
    which _scaled_mm refuses ("Invalid scaling configuration"); it must be expanded to (1, N). The
    rowwise kernel gets the scales with fast accumulation (without, the dgrad is tensorwise, below)."""
    m, k, n = BIG
    model = nn.Sequential(nn.Linear(k, n, device="cuda", dtype=torch.bfloat16))
    config = Float8Config.from_recipe_name(
        "rowwise_with_gw_hp", gemm_config_grad_input=Float8GemmConfig(use_fast_accum=True)
    )
    convert_to_float8_training(model, config=config)
    with _legacy_api("_scaled_mm"):  # the API whose meta kernel raised the error
        _, grad_x, grad_w = _step(model, m, k)
    fprop, dgrad = _accepted(fake_hopper)
    assert fprop["scale_a"]["shape"] == (m, 1) and fprop["scale_b"]["shape"] == (1, n)
    assert dgrad["self"]["shape"] == (m, n) and dgrad["mat2"]["shape"] == (n, k)
    assert dgrad["scale_a"]["shape"] == (m, 1) and dgrad["scale_b"]["shape"] == (1, k)
    assert dgrad["use_fast_accum"] is True
    assert grad_x.shape == (m, k) and grad_w.shape == (n, k)


@pytest.mark.parametrize("api", ["_scaled_mm", "scaled_mm_v2"])
@pytest.mark.parametrize("name", ["rowwise", "rowwise_with_gw_hp"])
def test_rowwise_gemms_run_as_torchaos(fake_hopper, name, api) -> None:
    """torchao's default: fast accumulation in the forward GEMM only. So fprop takes the rowwise kernel
    with (M, 1) and (1, N) scales; dgrad and wgrad (torchao's addmm_float8_unwrapped without fast accum)
    the tensorwise ``torch._scaled_mm`` with unit 0-dim scales writing bf16, the scales applied after."""
    m, k, n = BIG
    model = nn.Sequential(nn.Linear(k, n, device="cuda", dtype=torch.bfloat16))
    convert_to_float8_training(model, config=Float8Config.from_recipe_name(name))
    with _legacy_api(api):
        out, grad_x, grad_w = _step(model, m, k)
    fprop, *backward = _accepted(fake_hopper)
    assert len(backward) == (2 if name == "rowwise" else 1)
    v2 = api == "scaled_mm_v2" and gemm._SCALED_MM_V2 is not None
    ops = [e.op for e in fake_hopper.of("scaled_mm")]
    assert ops == [f"aten._scaled_mm{'_v2' if v2 else ''}.default"] + ["aten._scaled_mm.default"] * len(
        backward
    )
    if not v2:  # (the v2 op takes lists of scales)
        assert fprop["scale_a"]["shape"] == (m, 1) and fprop["scale_b"]["shape"] == (1, n)
        assert fprop["use_fast_accum"] is True
    for call in backward:
        assert call["scale_a"]["shape"] == () and call["scale_b"]["shape"] == ()
        assert call["out_dtype"] == torch.bfloat16 and not call.get("use_fast_accum", False)
    assert out.shape == (m, n) and grad_x.shape == (m, k) and grad_w.shape == (n, k)
    assert grad_x.dtype == grad_w.dtype == torch.bfloat16


def test_tensorwise_rows_not_a_multiple_of_16_reach_scaled_mm(fake_hopper) -> None:
    """torch checks K and N of a _scaled_mm, not M: 100 rows run fprop and dgrad on the kernel; wgrad,
    whose reduction dim is those 100 rows, is emulated (the meta kernel would refuse it)."""
    m, k, n = 100, 64, 48
    model = nn.Sequential(nn.Linear(k, n, device="cuda", dtype=torch.bfloat16))
    convert_to_float8_training(model, config=Float8Config())
    _step(model, m, k)
    fprop, dgrad = _accepted(fake_hopper)
    assert fprop["self"]["shape"] == (m, k) and fprop["mat2"]["shape"] == (k, n)
    assert dgrad["self"]["shape"] == (m, n) and dgrad["mat2"]["shape"] == (n, k)
    assert dgrad["self"]["dtype"] == torch.float8_e5m2


def test_every_recipe_name_is_covered() -> None:
    """The table above follows the config: each accepted recipe runs here under every scaling it takes."""
    assert {c.recipe for c in CONFIGS.values()} == set(RECIPE_NAMES)
    assert {c.scaling for c in CONFIGS.values()} == set(SCALINGS)
