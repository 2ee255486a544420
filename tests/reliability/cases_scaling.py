"""Battery cases for loss scaling: GradScaler and its rules, their state dicts and call order."""

from __future__ import annotations

import copy
import math
import pickle
from typing import Any

import torch

import mixprec
from mixprec.scaling import SkipMonitor

from .battery import CALL_ORDER, Case

# Bad values by name; each argument takes the ones that are bad for it.
BAD: dict[str, Any] = {
    "str": "2",
    "None": None,
    "nan": math.nan,
    "inf": math.inf,
    "-1": -1.0,
    "0": 0,
    "True": True,
    "1e39": 1e39,
    "list": [2.0],
}
POSITIVE = ("str", "None", "nan", "inf", "-1", "0", "True", "list")
COUNT = ("str", "None", "nan", "-1", "0", "True", "list")

CTOR_ARGS: dict[str, tuple[tuple[str, Any], ...]] = {
    "init_scale": (*((k, BAD[k]) for k in (*POSITIVE, "1e39")), ("1e-50", 1e-50)),
    "growth_factor": (*((k, BAD[k]) for k in POSITIVE), ("1.0", 1.0), ("0.5", 0.5)),
    "backoff_factor": (*((k, BAD[k]) for k in POSITIVE), ("1.0", 1.0), ("2.0", 2.0)),
    "growth_interval": (*((k, BAD[k]) for k in COUNT), ("1.5", 1.5)),
    "hysteresis": (*((k, BAD[k]) for k in COUNT), ("1.5", 1.5)),
    "min_scale": (*((k, BAD[k]) for k in POSITIVE if k != "None"), ("1e-50", 1e-50)),
    "max_scale": (*((k, BAD[k]) for k in POSITIVE if k != "None"), ("1e39", 1e39)),
}
SCALER_ONLY: dict[str, tuple[tuple[str, Any], ...]] = {
    "warn_after_skips": (("str", "5"), ("0", 0), ("-1", -1), ("1.5", 1.5), ("True", True)),
    "growth": (("bogus", "bogus"), ("3", 3)),
    "sync": (("maybe", "maybe"), ("2", 2)),
    "device": (("nonsense", "nonsense"), ("1.5", 1.5)),
    "enabled": (("'no'", "no"), ("None", None)),
    "allow_fp16_grads": (("'no'", "no"), ("2", 2)),
    "rule": (("'dynamic'", "dynamic"), ("class", mixprec.DynamicScale)),
    "process_group": (("'world'", "world"),),
}
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


def model_and_opt() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def used_scaler(rule: Any = None) -> dict[str, Any]:
    """A scaler after one full iteration (its state tensors exist), with the model and optimizer."""
    model, opt = model_and_opt()
    scaler = mixprec.GradScaler("cpu") if rule is None else mixprec.GradScaler("cpu", rule=rule)
    scaler.scale(model(torch.ones(3, 4)).sum()).backward()
    scaler.step(opt)
    scaler.update()
    return {"scaler": scaler, "model": model, "opt": opt}


def mid_iteration(stage: str) -> dict[str, Any]:
    """A used scaler with a fresh backward, then ``stage`` ("scaled", "unscaled", "stepped")."""
    ctx = used_scaler()
    scaler, model, opt = ctx["scaler"], ctx["model"], ctx["opt"]
    scaler.scale(model(torch.ones(3, 4)).sum()).backward()
    if stage in ("unscaled", "stepped"):
        scaler.unscale_(opt)
    if stage == "stepped":
        scaler.step(opt)
    return ctx


def _scaler(ctx: dict[str, Any]) -> Any:
    return ctx["scaler"]


def _ctor_cases() -> list[Case]:
    cases = []
    for name, values in {**CTOR_ARGS, **SCALER_ONLY}.items():
        for label, value in values:
            cases.append(
                Case(
                    f"GradScaler({name}={label})",
                    lambda _, n=name, v=value: mixprec.GradScaler(**{n: v}),
                    names=(name,),
                )
            )
    for cls in (mixprec.DynamicScale, mixprec.HeadroomScale):
        for name, values in CTOR_ARGS.items():
            for label, value in values:
                cases.append(
                    Case(
                        f"{cls.__name__}({name}={label})",
                        lambda _, c=cls, n=name, v=value: c(**{n: v}),
                        names=(name,),
                    )
                )
    cases += [
        Case(
            "GradScaler(min_scale=4, max_scale=2)",
            lambda _: mixprec.GradScaler(min_scale=4.0, max_scale=2.0),
            names=("min_scale", "max_scale"),
        ),
        Case(
            "GradScaler(init_scale=1, min_scale=2)",
            lambda _: mixprec.GradScaler(init_scale=1.0, min_scale=2.0),
            names=("init_scale",),
        ),
        Case(
            "GradScaler(rule=..., init_scale=2)",
            lambda _: mixprec.GradScaler(rule=mixprec.NoScale(), init_scale=2.0),
            names=("init_scale",),
        ),
        Case("HeadroomScale(format='fp17')", lambda _: mixprec.HeadroomScale(format="fp17"), names=("fp17",)),
        Case("HeadroomScale(format=3)", lambda _: mixprec.HeadroomScale(format=3), names=("format",)),
        Case("HeadroomScale(margin=0.5)", lambda _: mixprec.HeadroomScale(margin=0.5), names=("margin",)),
        Case(
            "HeadroomScale(margin=nan)", lambda _: mixprec.HeadroomScale(margin=math.nan), names=("margin",)
        ),
        Case("HeadroomScale(bogus=1)", lambda _: mixprec.HeadroomScale(bogus=1), names=("bogus",)),
        Case(
            "DynamicScale(raise_at_min_scale='no')",
            lambda _: mixprec.DynamicScale(raise_at_min_scale="no"),
            names=("raise_at_min_scale",),
        ),
        Case("StaticScale(scale=nan)", lambda _: mixprec.StaticScale(math.nan), names=("scale",)),
        Case("StaticScale(scale=0)", lambda _: mixprec.StaticScale(0.0), names=("scale",)),
        Case("StaticScale(scale=1e39)", lambda _: mixprec.StaticScale(1e39), names=("scale",)),
        Case("StaticScale(scale='2')", lambda _: mixprec.StaticScale("2"), names=("scale",)),
        Case("SkipMonitor(warn_after=0)", lambda _: SkipMonitor(0), names=("warn_after",)),
    ]
    return cases


def _method_cases() -> list[Case]:
    def on_used(name: str, call: Any, names: tuple[str, ...], **kw: Any) -> Case:
        return Case(name, call, names=names, setup=used_scaler, target=_scaler, **kw)

    cases = [
        on_used("scale('loss')", lambda c: c["scaler"].scale("loss"), ("outputs",)),
        on_used("scale(None)", lambda c: c["scaler"].scale(None), ("outputs",)),
        on_used("scale(3.0)", lambda c: c["scaler"].scale(3.0), ("outputs",)),
        on_used("unscale_('opt')", lambda c: c["scaler"].unscale_("opt"), ("optimizer",)),
        on_used("unscale_(model)", lambda c: c["scaler"].unscale_(c["model"]), ("optimizer",)),
        on_used("step('opt')", lambda c: c["scaler"].step("opt"), ("optimizer",)),
        on_used("step(None)", lambda c: c["scaler"].step(None), ("optimizer",)),
        on_used(
            "set_growth_factor(nan)", lambda c: c["scaler"].set_growth_factor(math.nan), ("growth_factor",)
        ),
        on_used("set_growth_factor(0.5)", lambda c: c["scaler"].set_growth_factor(0.5), ("growth_factor",)),
        on_used("set_backoff_factor(2)", lambda c: c["scaler"].set_backoff_factor(2.0), ("backoff_factor",)),
        on_used("set_growth_interval(0)", lambda c: c["scaler"].set_growth_interval(0), ("growth_interval",)),
        on_used(
            "set_growth_interval('9')", lambda c: c["scaler"].set_growth_interval("9"), ("growth_interval",)
        ),
    ]
    for label, value in (
        *((k, BAD[k]) for k in (*POSITIVE, "1e39") if k != "None"),
        ("2-elem", torch.ones(2)),
        ("requires_grad", torch.ones((), requires_grad=True)),
    ):
        cases.append(
            Case(
                f"update(new_scale={label})",
                lambda c, v=value: _update_after_step(c, v),
                names=("new_scale",),
                setup=lambda: mid_iteration("stepped"),
                target=_scaler,
            )
        )
    cases.append(
        Case(
            "update(1e39) then a clean iteration",
            _update_huge_then_step,
            names=("new_scale",),
            setup=lambda: mid_iteration("stepped"),
            target=lambda c: None,
        )
    )
    return cases


def _update_after_step(ctx: dict[str, Any], value: Any) -> None:
    ctx["scaler"].update(value)


def _update_huge_then_step(ctx: dict[str, Any]) -> None:
    """update(1e39) must refuse and leave the scaler able to run the next iteration."""
    scaler, model, opt = ctx["scaler"], ctx["model"], ctx["opt"]
    try:
        scaler.update(1e39)
    except (ValueError, TypeError) as error:
        scaler.update()
        scaler.scale(model(torch.ones(3, 4)).sum()).backward()
        scaler.step(opt)
        scaler.update()
        raise ValueError(f"refused and recovered: {error}") from error


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
    """Every scaling case."""
    return _ctor_cases() + _method_cases() + _state_cases() + _order_cases() + _roundtrip_cases()
