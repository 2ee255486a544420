"""Battery cases for the master-weight side: MixedPrecisionOptimizer, CompensatedOptimizer, initialize."""

from __future__ import annotations

import math
from typing import Any

import torch

import mixprec

from .battery import BAD_INPUT, Case
from .cases_scaler_state import check_roundtrip

OWNER = "master"


def _parts() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
    return {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1)}


def _prepared(level: str, **overrides: Any) -> dict[str, Any]:
    ctx = _parts()
    model, opt = mixprec.initialize(ctx["model"], ctx["opt"], level, **overrides)
    x = torch.randn(3, 4)
    opt.backward(model(x).float().sum())
    opt.step()
    opt.zero_grad()
    return {"model": model, "opt": opt}


def _mpo() -> dict[str, Any]:
    ctx = _parts()
    ctx["model"].to(torch.bfloat16)
    ctx["opt"] = torch.optim.SGD(ctx["model"].parameters(), lr=0.1)
    wrapped = mixprec.MixedPrecisionOptimizer(ctx["opt"])
    wrapped.backward(ctx["model"](torch.randn(3, 4, dtype=torch.bfloat16)).float().sum())
    wrapped.step()
    return {"model": ctx["model"], "opt": wrapped}


def _compensated() -> dict[str, Any]:
    ctx = _parts()
    ctx["model"].to(torch.bfloat16)
    opt = mixprec.CompensatedOptimizer(torch.optim.SGD(ctx["model"].parameters(), lr=0.1))
    ctx["model"](torch.randn(3, 4, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    return {"model": ctx["model"], "opt": opt}


def _ctor_cases() -> list[Case]:
    def ctor(case_id: str, call: Any, names: tuple[str, ...]) -> Case:
        return Case(case_id, call, names=names, setup=_parts, owner=OWNER, raises=(*BAD_INPUT, RuntimeError))

    MPO, CO, init = mixprec.MixedPrecisionOptimizer, mixprec.CompensatedOptimizer, mixprec.initialize
    return [
        ctor("MixedPrecisionOptimizer('x')", lambda c: MPO("x"), ("optimizer",)),
        ctor("MixedPrecisionOptimizer(scaler='bogus')", lambda c: MPO(c["opt"], scaler="bogus"), ("bogus",)),
        ctor("MixedPrecisionOptimizer(scaler=3j)", lambda c: MPO(c["opt"], scaler=3j), ("scale",)),
        ctor("MixedPrecisionOptimizer(scaler=nan)", lambda c: MPO(c["opt"], scaler=math.nan), ("scale",)),
        ctor(
            "MixedPrecisionOptimizer(master_weights='no')",
            lambda c: MPO(c["opt"], master_weights="no"),
            ("master_weights",),
        ),
        ctor("CompensatedOptimizer('x')", lambda c: CO("x"), ("optimizer",)),
        ctor("CompensatedOptimizer(method='bogus')", lambda c: CO(c["opt"], "bogus"), ("method",)),
        ctor("CompensatedOptimizer(seed='x')", lambda c: CO(c["opt"], "stochastic", seed="x"), ("seed",)),
        ctor(
            "CompensatedOptimizer(scratch_numel=0)",
            lambda c: CO(c["opt"], scratch_numel=0),
            ("scratch_numel",),
        ),
        ctor("initialize('x', opt)", lambda c: init("x", c["opt"]), ("model",)),
        ctor("initialize(model, 'x')", lambda c: init(c["model"], "x"), ("optimizer",)),
        ctor("initialize(opt_level='O9')", lambda c: init(c["model"], c["opt"], "O9"), ("O9",)),
        ctor("initialize(opt_level=3)", lambda c: init(c["model"], c["opt"], 3), ("opt_level",)),
        ctor("initialize(dtype='fp17')", lambda c: init(c["model"], c["opt"], "O2", dtype="fp17"), ("fp17",)),
        ctor(
            "initialize(dtype=torch.int32)",
            lambda c: init(c["model"], c["opt"], "O2", dtype=torch.int32),
            ("dtype",),
        ),
        ctor("initialize(bogus=1)", lambda c: init(c["model"], c["opt"], "O2", bogus=1), ("bogus",)),
        ctor(
            "initialize(weight_update='bogus')",
            lambda c: init(c["model"], c["opt"], "O3", weight_update="bogus"),
            ("weight_update",),
        ),
        ctor(
            "initialize(loss_scale='bogus')",
            lambda c: init(c["model"], c["opt"], "O2", loss_scale="bogus"),
            ("bogus",),
        ),
        ctor(
            "initialize(loss_scale=nan)",
            lambda c: init(c["model"], c["opt"], "O2", loss_scale=math.nan),
            ("loss_scale",),
        ),
        ctor(
            "initialize(min_loss_scale=-1)",
            lambda c: init(c["model"], c["opt"], "O2", min_loss_scale=-1.0),
            ("min",),
        ),
        ctor(
            "initialize(keep_batchnorm_fp32='x')",
            lambda c: init(c["model"], c["opt"], "O2", keep_batchnorm_fp32="x"),
            ("keep_batchnorm_fp32",),
        ),
        ctor(
            "initialize(wrapped optimizer)",
            lambda c: init(c["model"], MPO(c["opt"], scaler=None), "O2"),
            ("optimizer",),
        ),
        ctor(
            "initialize(optimizer of another model)",
            lambda c: init(c["model"], torch.optim.SGD(torch.nn.Linear(2, 2).parameters()), "O2"),
            ("optimizer",),
        ),
    ]


def _state_cases() -> list[Case]:
    def loading(case_id: str, setup: Any, make: Any, names: tuple[str, ...]) -> Case:
        return Case(
            case_id,
            lambda c: c["opt"].load_state_dict(make(c["opt"].state_dict())),
            names=names,
            setup=setup,
            owner=OWNER,
        )

    def bad_scaler(sd: dict[str, Any]) -> dict[str, Any]:
        masters = [m + 1 for m in sd["master_params"]]
        return {**sd, "master_params": masters, "scaler": {**sd["scaler"], "growth_factor": 0.5}}

    def bad_inner(sd: dict[str, Any]) -> dict[str, Any]:
        return {**sd, "compensation": [c + 1 for c in sd["compensation"]], "generators": "x"}

    def grown(sd: dict[str, Any]) -> dict[str, Any]:
        return {**sd, "optimizer": {**sd["optimizer"], "param_groups": sd["optimizer"]["param_groups"] * 2}}

    cases = [
        loading("MixedPrecisionOptimizer.load_state_dict({})", _mpo, lambda sd: {}, ("optimizer",)),
        loading("MixedPrecisionOptimizer.load_state_dict('x')", _mpo, lambda sd: "x", ("state_dict",)),
        loading(
            "MixedPrecisionOptimizer.load_state_dict(torch optimizer's)",
            _mpo,
            lambda sd: sd["optimizer"],
            ("master_params",),
        ),
        loading(
            "MixedPrecisionOptimizer.load_state_dict(bad scaler part)", _mpo, bad_scaler, ("growth_factor",)
        ),
        loading("MixedPrecisionOptimizer.load_state_dict(extra param group)", _mpo, grown, ("param",)),
        loading("CompensatedOptimizer.load_state_dict({})", _compensated, lambda sd: {}, ("method",)),
        loading(
            "CompensatedOptimizer.load_state_dict(bad generators)", _compensated, bad_inner, ("generators",)
        ),
        loading("CompensatedOptimizer.load_state_dict(extra param group)", _compensated, grown, ("param",)),
        loading(
            "CompensatedOptimizer.load_state_dict(method='x')",
            _compensated,
            lambda sd: {**sd, "method": "x"},
            ("method",),
        ),
    ]
    for key in ("optimizer", "master_params", "scaler"):
        cases.append(
            loading(
                f"MixedPrecisionOptimizer.load_state_dict(without {key})",
                _mpo,
                lambda sd, k=key: {n: v for n, v in sd.items() if n != k},
                (key,),
            )
        )
    for key in ("method", "optimizer", "compensation", "generators"):
        cases.append(
            loading(
                f"CompensatedOptimizer.load_state_dict(without {key})",
                _compensated,
                lambda sd, k=key: {n: v for n, v in sd.items() if n != k},
                (key,),
            )
        )
    return cases


def _roundtrip_cases() -> list[Case]:
    def opt_state(opt: Any) -> Any:
        return opt.state_dict()

    def sum_all(ctx: dict[str, Any]) -> None:
        for group in ctx["opt"].param_groups:
            for param in group["params"]:
                param.sum()

    setups = {
        "MixedPrecisionOptimizer": _mpo,
        "CompensatedOptimizer": _compensated,
        "initialize O2": lambda: _prepared("O2"),
        "initialize bf16-true + kahan": lambda: _prepared("bf16-true", weight_update="kahan"),
        "initialize bf16-true + stochastic": lambda: _prepared("bf16-true", weight_update="stochastic"),
    }
    cases = [
        Case(
            f"deepcopy/pickle {name}",
            lambda c: check_roundtrip(c["opt"], opt_state),
            setup=make,
            owner=OWNER,
            roundtrip=True,
            isolate=True,
        )
        for name, make in setups.items()
    ]
    cases.append(
        Case(
            "read param_groups tensors, bf16-true + kahan",
            sum_all,
            owner=OWNER,
            roundtrip=True,
            setup=lambda: _prepared("bf16-true", weight_update="kahan"),
            isolate=True,
        )
    )
    return cases


def cases() -> list[Case]:
    """Every master-side case."""
    return _ctor_cases() + _state_cases() + _roundtrip_cases()
