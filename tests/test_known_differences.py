"""Each behaviour docs/known-differences.md lists, with torch's own behaviour beside it in the same
process: if torch changes, or mixprec does, the test says which line of that page is out of date."""

from __future__ import annotations

import warnings

import pytest
import torch

import mixprec


def _outcome(call) -> tuple[str, list[str]]:
    """``("ok" or the exception type name, [warning messages])`` of ``call()``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            call()
            result = "ok"
        except Exception as error:
            result = type(error).__name__
    return result, [str(w.message) for w in caught]


@pytest.mark.parametrize("device", [torch.device("cpu"), "CPU"])
def test_autocast_takes_a_torch_device_and_any_case_where_torch_raises(device) -> None:
    assert _outcome(lambda: torch.autocast(device))[0] in ("ValueError", "RuntimeError")
    with mixprec.autocast(device):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16


def test_autocast_refuses_a_dtype_cpu_cannot_run_where_torch_warns_and_turns_off() -> None:
    result, warned = _outcome(lambda: torch.autocast("cpu", dtype=torch.float64))
    assert result == "ok" and "not supported. Disabling autocast" in warned[0]
    with pytest.raises(ValueError, match="float64"):
        mixprec.autocast("cpu", dtype=torch.float64)


def test_autocast_float32_on_cpu_is_a_region_with_autocast_off_without_torch_warning() -> None:
    torch_result = _outcome(lambda: torch.autocast("cpu", dtype=torch.float32))
    assert torch_result[0] == "ok" and torch_result[1]
    seen = []

    def enter() -> None:
        with mixprec.autocast("cpu", dtype=torch.float32):
            seen.append(torch.is_autocast_enabled("cpu"))

    assert _outcome(enter) == ("ok", []) and seen == [False]


@pytest.mark.parametrize(("kwargs", "error"), [({"enabled": 1}, TypeError), ({"dtype": 3}, TypeError)])
def test_autocast_argument_types_are_checked_where_torch_takes_them(kwargs, error) -> None:
    assert _outcome(lambda: torch.autocast("cpu", **kwargs))[0] == "ok"
    with pytest.raises(error):
        mixprec.autocast("cpu", **kwargs)


def test_a_dtype_name_is_the_dtype_where_torch_takes_the_string_unchecked() -> None:
    assert _outcome(lambda: torch.autocast("cpu", dtype="bfloat16"))[0] == "ok"
    with mixprec.autocast("cpu", dtype="bfloat16"):
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16


def test_grad_scaler_takes_its_device_from_the_first_tensor_where_torch_defaults_to_cuda() -> None:
    if not torch.cuda.is_available():
        result, warned = _outcome(lambda: torch.amp.GradScaler())
        assert result == "ok" and "CUDA is not available" in warned[0]
    scaler = mixprec.GradScaler()
    weight = torch.nn.Parameter(torch.ones(2))
    scaler.scale(weight.sum()).backward()
    assert scaler.is_enabled() and scaler.get_scale() == 2.0**16 and weight.grad.tolist() == [2.0**16] * 2


@pytest.mark.parametrize("kwargs", [{"init_scale": -1.0}, {"growth_interval": 0}])
def test_grad_scaler_validates_arguments_torch_accepts(kwargs) -> None:
    assert _outcome(lambda: torch.amp.GradScaler("cpu", **kwargs))[0] == "ok"
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        mixprec.GradScaler("cpu", **kwargs)


def _overflow(scaler, steps: int) -> float:
    weight = torch.nn.Parameter(torch.ones(1))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    for _ in range(steps):
        optimizer.zero_grad()
        scaler.scale(weight.sum() * float("inf")).backward()
        scaler.step(optimizer)
        scaler.update()
    return scaler.get_scale()


def test_the_scale_stops_at_the_smallest_normal_float32_where_torch_reaches_zero_and_warns() -> None:
    assert _overflow(torch.amp.GradScaler("cpu", init_scale=1.0), 200) == 0.0
    with pytest.warns(RuntimeWarning, match="the last 50 optimizer steps were all skipped"):
        floor = _overflow(mixprec.GradScaler("cpu", init_scale=1.0), 200)
    assert floor == torch.finfo(torch.float32).tiny
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _overflow(mixprec.GradScaler("cpu", warn_after_skips=None), 60)  # the warning can be turned off


def test_a_positional_closure_is_refused_where_torch_passes_it_on() -> None:
    calls: list[str] = []

    def step(scaler) -> None:
        weight = torch.nn.Parameter(torch.ones(1))
        optimizer = torch.optim.SGD([weight], lr=0.1)
        scaler.scale(weight.sum()).backward()
        scaler.step(optimizer, lambda: calls.append("closure"))

    assert _outcome(lambda: step(torch.amp.GradScaler("cpu")))[0] == "ok" and calls == ["closure"]
    assert _outcome(lambda: step(mixprec.GradScaler("cpu")))[0] == "GradScalerError" and calls == ["closure"]


def test_scaler_errors_are_caught_by_except_clauses_written_for_torch() -> None:
    scaler = mixprec.GradScaler("cpu")
    for caught in (RuntimeError, AssertionError):
        with pytest.raises(caught, match="No inf checks"):
            scaler.scale(torch.ones(1, requires_grad=True).sum())
            scaler.update()
