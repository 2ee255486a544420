"""Every optimizer path steps on fake CUDA under the device check, with every inner-optimizer flag torch
accepts, from fresh state and from state loaded from a state_dict on the host (issue 39: a host step counter
handed to ``torch._fused_adamw_``, which a GPU refuses).

A state_dict "on the host" is the optimizer's own, every tensor moved to the CPU: what
``torch.load(path, map_location="cpu")`` of a checkpoint gives, and what torch's non-fused Adam keeps its
``step`` as. Where a step counter lives is checked per path: on the param's device where a fused kernel
reads it (mixprec's fused Adam, low-bit states, torch's fused/capturable Adam), on the host where the step
reads it on the host (mixprec's foreach path, torch's foreach/single-tensor Adam), as torch places it.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch.utils._pytree import tree_map

import mixprec
from fake_cuda import loops
from fake_cuda.harness import module_apply_in_place
from mixprec.apex import FP16_Optimizer
from mixprec.optim import METHODS
from mixprec.optim.state_formats import STATE_FORMATS

FLAGS: dict[str, dict[str, bool]] = {
    "default": {},
    "foreach": {"foreach": True},
    "single-tensor": {"foreach": False},
    "fused": {"fused": True},
    "capturable": {"capturable": True},
}
INNER = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW}
FORMATS = [None, *STATE_FORMATS]


def _steps(opt: torch.optim.Optimizer, ps: list[torch.Tensor], n: int = 2) -> None:
    """``n`` steps of ``opt`` with gradients set by hand (scaled where ``opt`` has a loss scaler)."""
    scaler = getattr(opt, "scaler", None)
    for _ in range(n):
        loss = sum(p.float().sum() for p in ps)
        loops._set_grads(ps, scaler.scale(loss) if scaler is not None else None)
        opt.step()
        opt.zero_grad(set_to_none=True)


def _on_host(state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` with every tensor on the CPU (a checkpoint loaded with ``map_location="cpu"``)."""
    return tree_map(lambda v: v.cpu() if isinstance(v, torch.Tensor) else v, state_dict)


def _step_devices(opt: torch.optim.Optimizer) -> set[str]:
    return {s["step"].device.type for s in opt.state.values()}


def _compensated(method: str, state_format: str | None, inner: str, flags: str):
    ps = loops.params(torch.bfloat16)
    opt = mixprec.CompensatedOptimizer(
        INNER[inner](ps, lr=1e-3, **FLAGS[flags]), method, state_format=state_format
    )
    return ps, opt


def _compensated_step_device(method: str, state_format: str | None, flags: str) -> str:
    """Where the step counter of a bf16 param lives after a CompensatedOptimizer step: the fused Adam pass
    (kahan, stochastic) and low-bit states read it on the device; torch's capturable Adam keeps it there
    (the generic path steps through torch); mixprec's foreach Adam (nearest) reads it on the host."""
    if state_format is not None or flags == "capturable" or method != "nearest":
        return "cuda"
    return "cpu"


@pytest.mark.parametrize("flags", FLAGS)
@pytest.mark.parametrize("inner", INNER)
@pytest.mark.parametrize("state_format", FORMATS)
@pytest.mark.parametrize("method", METHODS)
def test_compensated_optimizer_steps_on_cuda(fake_hopper, method, state_format, inner, flags) -> None:
    ps, opt = _compensated(method, state_format, inner, flags)
    _steps(opt, ps)
    assert _step_devices(opt) == {_compensated_step_device(method, state_format, flags)}
    assert {v.device.type for s in opt.state.values() for k, v in s.items() if k != "step"} == {"cuda"}


@pytest.mark.parametrize("flags", FLAGS)
@pytest.mark.parametrize("inner", INNER)
@pytest.mark.parametrize("state_format", FORMATS)
@pytest.mark.parametrize("method", METHODS)
def test_compensated_optimizer_resumes_from_a_host_state_dict(
    fake_hopper, method, state_format, inner, flags
) -> None:
    ps, opt = _compensated(method, state_format, inner, flags)
    _steps(opt, ps, 1)
    saved = _on_host(opt.state_dict())
    ps, opt = _compensated(method, state_format, inner, flags)
    opt.load_state_dict(saved)
    _steps(opt, ps, 1)
    fake_hopper.reset()
    _steps(opt, ps, 1)
    assert fake_hopper.count("h2d") == 0  # a loaded step counter moves once, not every step
    assert _step_devices(opt) == {_compensated_step_device(method, state_format, flags)}


def _masters(state_format: str | None, inner: str, flags: str, scaler: Any):
    ps = loops.params(torch.bfloat16)
    opt = mixprec.MixedPrecisionOptimizer(
        INNER[inner](ps, lr=1e-3, **FLAGS[flags]), scaler=scaler, state_format=state_format
    )
    return ps, opt


def _masters_step_device(state_format: str | None, flags: str) -> str:
    """Low-bit states and torch's fused/capturable Adam read the counter on the device, torch's foreach and
    single-tensor Adam on the host."""
    return "cuda" if state_format is not None or flags in ("fused", "capturable") else "cpu"


@pytest.mark.parametrize("scaler", [None, "dynamic"], ids=["no-scaler", "dynamic"])
@pytest.mark.parametrize("flags", FLAGS)
@pytest.mark.parametrize("inner", INNER)
@pytest.mark.parametrize("state_format", FORMATS)
@pytest.mark.parametrize("resume", [False, True], ids=["fresh", "resumed"])
def test_mixed_precision_optimizer_steps_on_cuda(
    fake_hopper, resume, state_format, inner, flags, scaler
) -> None:
    ps, opt = _masters(state_format, inner, flags, scaler)
    if resume:
        _steps(opt, ps, 1)
        saved = _on_host(opt.state_dict())
        if scaler is not None:  # the fake mode keeps no values: the saved scale read as 0.0
            saved["scaler"] = {**saved["scaler"], "scale": 2.0**16}
        ps, opt = _masters(state_format, inner, flags, scaler)
        opt.load_state_dict(saved)
    _steps(opt, ps, 1)
    fake_hopper.reset()
    _steps(opt, ps, 1)
    assert fake_hopper.count("h2d") == 0
    assert _step_devices(opt) == {_masters_step_device(state_format, flags)}


@pytest.mark.parametrize("flags", ["default", "fused"])
def test_apex_fp16_optimizer_steps_on_cuda(fake_hopper, flags) -> None:
    ps = loops.params(torch.float16)
    opt = FP16_Optimizer(torch.optim.AdamW(ps, lr=1e-3, **FLAGS[flags]), dynamic_loss_scale=True)
    _steps(opt, ps)
    assert _step_devices(opt) == {"cuda" if flags == "fused" else "cpu"}


LEVELS = [
    ("O2", {}),
    ("O3", {}),
    ("bf16-true", {}),
    ("bf16-true", {"weight_update": "kahan"}),
    ("bf16-true", {"weight_update": "stochastic"}),
    ("16-true", {}),
]


@pytest.mark.parametrize("flags", ["default", "fused"])
@pytest.mark.parametrize(("level", "overrides"), LEVELS, ids=lambda v: str(v or ""))
def test_every_opt_level_steps_on_cuda(fake_hopper, level, overrides, flags) -> None:
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 32, device="cuda"), torch.nn.ReLU(), torch.nn.Linear(32, 8, device="cuda")
    )
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3, **FLAGS[flags])
    with warnings.catch_warnings(), module_apply_in_place():
        warnings.simplefilter("ignore")  # fp16 on CUDA by default, and the presets' notes
        model, opt = mixprec.initialize(model, inner, level, **overrides)
    _steps(opt, list(model.parameters()))
    assert {s["step"].device.type for s in opt.state.values()} <= {"cuda", "cpu"}


@pytest.mark.parametrize("host", [False, True], ids=["as-saved", "on-host"])
@pytest.mark.parametrize("flags", FLAGS)
@pytest.mark.parametrize("method", METHODS)
def test_a_compensated_state_dict_loads_into_torchs_adamw(fake_hopper, method, flags, host) -> None:
    # torch places a loaded counter by its own policy: on the device for fused/capturable, else as saved
    if not host and method != "nearest" and flags not in ("fused", "capturable"):
        pytest.skip(
            "torch's foreach/single-tensor Adam reads a device counter with .item(), which the fake mode "
            "answers 0.0 (1 - beta**0 then divides by zero); a GPU reads the real count"
        )
    ps, opt = _compensated(method, None, "AdamW", flags)
    _steps(opt, ps, 1)
    saved = opt.state_dict()["optimizer"]
    theirs = torch.optim.AdamW(ps, lr=1e-3, **FLAGS[flags])
    theirs.load_state_dict(_on_host(saved) if host else saved)
    _steps(theirs, ps)
    if flags in ("fused", "capturable"):
        assert _step_devices(theirs) == {"cuda"}
