"""Battery cases for loss scaling: GradScaler and its rules, their constructors and methods."""

from __future__ import annotations

import math
from typing import Any

import torch

import mixprec
from mixprec.scaling import SkipMonitor

from .battery import Case

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


def cases() -> list[Case]:
    """Every scaling case."""
    return _ctor_cases() + _method_cases()
