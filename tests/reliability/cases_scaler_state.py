"""Battery cases for loss scaling: state dicts, call order, deepcopy/pickle round trips."""

from __future__ import annotations

import copy
import math
import pickle
from typing import Any

import torch

import mixprec
from mixprec.scaling import SkipMonitor

from .battery import CALL_ORDER, Case
from .cases_scaling import _scaler, mid_iteration, model_and_opt, used_scaler

REQUIRED_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
BAD_STATE_VALUES: tuple[tuple[str, Any], ...] = (
    ("scale", math.nan),
    ("scale", "x"),
    ("scale", -1.0),
    ("scale", 1e39),
    ("growth_factor", 0.5),
    ("growth_factor", "x"),
    ("backoff_factor", 2.0),
    ("growth_interval", 0),
    ("growth_interval", 1.5),
    ("_growth_tracker", -1),
    ("_growth_tracker", "x"),
    ("_growth_tracker", 1.5),
    ("hysteresis", 0),
    ("_hysteresis_tracker", -1),
    ("_hysteresis_tracker", "x"),
    ("min_scale", 1e-50),
    ("min_scale", "x"),
    ("max_scale", -1.0),
    ("raise_at_min_scale", "x"),
    ("skipped_steps", "x"),
    ("skipped_steps", -1),
    ("_skip_run", "x"),
    ("rule", "StaticScale"),
    ("rule", 3),
)


def _state_cases() -> list[Case]:
    def loading(name: str, make: Any, names: tuple[str, ...], rule: Any = None, **kw: Any) -> Case:
        return Case(
            name,
            lambda c: c["scaler"].load_state_dict(make(c["scaler"].state_dict())),
            names=names,
            setup=lambda: used_scaler(rule() if rule else None),
            target=_scaler,
            **kw,
        )

    cases = [
        loading("load_state_dict('x')", lambda sd: "x", ("state_dict",)),
        loading("load_state_dict(None)", lambda sd: None, ("state_dict",)),
        loading("load_state_dict({})", lambda sd: {}, ("state dict",), raises=(RuntimeError,)),
        loading("load_state_dict(optimizer's)", lambda sd: {"state": {}, "param_groups": []}, ("scale",)),
        loading(
            "load_state_dict({scale: 8, growth_factor: 0.5})",
            lambda sd: {**sd, "scale": 8.0, "growth_factor": 0.5},
            ("growth_factor",),
        ),
        loading(
            "load_state_dict({_growth_tracker: 5, backoff_factor: 3})",
            lambda sd: {**sd, "_growth_tracker": 5, "backoff_factor": 3.0},
            ("backoff_factor",),
        ),
        loading(
            "load_state_dict(skipped_steps=9, _skip_run='x')",
            lambda sd: {**sd, "skipped_steps": 9, "_skip_run": "x"},
            ("_skip_run",),
        ),
        loading(
            "load_state_dict(min_scale=4, max_scale=2)",
            lambda sd: {**sd, "min_scale": 4.0, "max_scale": 2.0},
            ("min_scale",),
        ),
        loading(
            "HeadroomScale: load_state_dict(headroom_format='fp17')",
            lambda sd: {**sd, "headroom_format": "fp17"},
            ("headroom_format",),
            rule=mixprec.HeadroomScale,
        ),
        loading(
            "HeadroomScale: load_state_dict(headroom_margin=0.5)",
            lambda sd: {**sd, "headroom_margin": 0.5},
            ("headroom_margin",),
            rule=mixprec.HeadroomScale,
        ),
        loading(
            "HeadroomScale: load_state_dict(_overflow_scale='x')",
            lambda sd: {**sd, "_overflow_scale": "x"},
            ("_overflow_scale",),
            rule=mixprec.HeadroomScale,
        ),
        loading(
            "StaticScale: load_state_dict(scale=nan)",
            lambda sd: {**sd, "scale": math.nan},
            ("scale",),
            rule=lambda: mixprec.StaticScale(4.0),
        ),
        loading(
            "NoScale: load_state_dict(scale=2)",
            lambda sd: {**sd, "scale": 2.0},
            ("scale",),
            rule=mixprec.NoScale,
        ),
    ]
    for key in REQUIRED_KEYS:
        cases.append(
            loading(
                f"load_state_dict(without {key})",
                lambda sd, k=key: {n: v for n, v in sd.items() if n != k},
                (key,),
            )
        )
    for key, value in BAD_STATE_VALUES:
        cases.append(
            loading(f"load_state_dict({key}={value!r})", lambda sd, k=key, v=value: {**sd, k: v}, (key,))
        )
    return cases


def _order_cases() -> list[Case]:
    def fresh() -> dict[str, Any]:
        model, opt = model_and_opt()
        model(torch.ones(3, 4)).sum().backward()
        return {"scaler": mixprec.GradScaler("cpu"), "model": model, "opt": opt}

    def order(name: str, setup: Any, call: Any, names: tuple[str, ...]) -> Case:
        return Case(name, call, names=names, setup=setup, target=_scaler, raises=CALL_ORDER)

    def no_grads() -> dict[str, Any]:
        ctx = mid_iteration("scaled")
        ctx["opt"].zero_grad()
        return ctx

    def closure_step(ctx: dict[str, Any]) -> Any:
        return ctx["scaler"].step(ctx["opt"], closure=lambda: 0.0)

    return [
        order(
            "unscale_ before scale", fresh, lambda c: c["scaler"].unscale_(c["opt"]), ("unscale_", "scale")
        ),
        order("step before scale", fresh, lambda c: c["scaler"].step(c["opt"]), ("step", "scale")),
        order("update before scale", fresh, lambda c: c["scaler"].update(), ("update", "scale")),
        order(
            "unscale_ twice",
            lambda: mid_iteration("unscaled"),
            lambda c: c["scaler"].unscale_(c["opt"]),
            ("unscale_",),
        ),
        order(
            "step twice", lambda: mid_iteration("stepped"), lambda c: c["scaler"].step(c["opt"]), ("step",)
        ),
        order(
            "unscale_ after step",
            lambda: mid_iteration("stepped"),
            lambda c: c["scaler"].unscale_(c["opt"]),
            ("unscale_", "step"),
        ),
        order(
            "update without step",
            lambda: mid_iteration("scaled"),
            lambda c: c["scaler"].update(),
            ("update",),
        ),
        order("step(closure=...)", lambda: mid_iteration("scaled"), closure_step, ("closure",)),
        order(
            "step(positional closure)",
            lambda: mid_iteration("scaled"),
            lambda c: c["scaler"].step(c["opt"], lambda: 0.0),
            ("closure",),
        ),
        order("step without any .grad", no_grads, lambda c: c["scaler"].step(c["opt"]), ("grad",)),
        order(
            "pickle mid-iteration",
            lambda: mid_iteration("unscaled"),
            lambda c: pickle.dumps(c["scaler"]),
            ("pickle",),
        ),
        order(
            "deepcopy mid-iteration",
            lambda: mid_iteration("unscaled"),
            lambda c: copy.deepcopy(c["scaler"]),
            ("update",),
        ),
        order(
            "rule.update before any scale",
            lambda: {"scaler": mixprec.DynamicScale()},
            lambda c: c["scaler"].update(torch.zeros(())),
            ("update",),
        ),
    ]


def check_roundtrip(obj: Any, state: Any) -> None:
    """deepcopy and pickle give objects whose ``state(obj)`` equals the original's."""
    expected = state(obj)
    for copied in (copy.deepcopy(obj), pickle.loads(pickle.dumps(obj))):
        got = state(copied)
        if not _equal(got, expected):
            raise AssertionError(f"round trip changed the state: {got} != {expected}")


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (
            type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
        )
    return a == b or (a != a and b != b)


def _roundtrip_cases() -> list[Case]:
    def state_dict(obj: Any) -> Any:
        return obj.state_dict()

    objects = {
        "GradScaler (new)": lambda: mixprec.GradScaler("cpu"),
        "GradScaler (used)": lambda: used_scaler()["scaler"],
        "GradScaler (disabled)": lambda: mixprec.GradScaler("cpu", enabled=False),
        "GradScaler(HeadroomScale) (used)": lambda: used_scaler(mixprec.HeadroomScale())["scaler"],
        "GradScaler(StaticScale) (used)": lambda: used_scaler(mixprec.StaticScale(8.0))["scaler"],
        "DynamicScale": mixprec.DynamicScale,
        "NoScale": mixprec.NoScale,
    }
    cases = [
        Case(f"deepcopy/pickle {name}", lambda c: check_roundtrip(c, state_dict), setup=make, roundtrip=True)
        for name, make in objects.items()
    ]
    cases.append(
        Case(
            "deepcopy/pickle SkipMonitor",
            lambda c: check_roundtrip(c, state_dict),
            setup=SkipMonitor,
            roundtrip=True,
        )
    )
    return cases


def cases() -> list[Case]:
    """Every state, order and round-trip case of the scaler."""
    return _state_cases() + _order_cases() + _roundtrip_cases()
