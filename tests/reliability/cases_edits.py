"""Battery cases: a wrapped optimizer edited after wrapping, on every master-weight path.

Each way a user edits an optimizer (``add_param_group``, ``param_groups`` edited by hand before a step,
``load_state_dict`` of another layout) must either behave as on the plain torch optimizer (tested in
``test_edits.py``) or raise naming what is wrong, with model and optimizer unchanged. torch.optim refuses a
parameter in two groups (``ValueError: some parameters appear in more than one parameter group``); under O2
the groups hold fp32 masters, so the model's own parameter must count as held too.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .battery import Case
from .cases_scaler_state import check_roundtrip
from .paths import PATHS, Path, prepared, train_step

OWNER = "master-edits"
DUPLICATE = ("more than one parameter group",)


def _with_grads(path: Path) -> dict[str, Any]:
    """Stepped once, with the next step's gradients already there."""
    ctx = prepared(path)
    ctx["opt"].zero_grad()
    ctx["opt"].backward((ctx["model"](ctx["x"]).float() - ctx["y"]).pow(2).mean())
    return ctx


def _first_param(ctx: dict[str, Any]) -> torch.Tensor:
    return next(ctx["model"].parameters())


def _hand_edited(path: Path, pick: Any) -> Any:
    def setup() -> dict[str, Any]:
        ctx = _with_grads(path)
        ctx["opt"].param_groups[0]["params"].append(pick(ctx))
        return ctx

    return setup


def _other_layout(path: Path, how: str) -> dict[str, Any]:
    """A state dict of the same path on another layout: another width, or the params in two groups."""
    torch.manual_seed(0)
    if how == "width":
        net = nn.Sequential(nn.Linear(8, 12), nn.Tanh(), nn.Linear(12, 1))
        opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    else:
        net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        opt = torch.optim.Adam(net[0].parameters(), lr=1e-2)
        opt.add_param_group({"params": list(net[2].parameters())})
    net, opt = path.build(net, opt)
    torch.manual_seed(1)
    train_step(net, opt, torch.randn(32, 8), torch.randn(32, 1))
    return opt.state_dict()


def _path_cases(path: Path) -> list[Case]:
    def case(what: str, call: Any, names: tuple[str, ...], setup: Any = None, **kw: Any) -> Case:
        return Case(
            f"{path.name}: {what}",
            call,
            names=names,
            setup=setup or (lambda: _with_grads(path)),
            owner=OWNER,
            **kw,
        )

    def add(group: Any) -> Any:
        return lambda c: c["opt"].add_param_group(group(c))

    def fresh(c: dict[str, Any]) -> nn.Parameter:
        return nn.Parameter(torch.zeros(3, dtype=path.grad_dtype))

    def load(how: str) -> Any:
        return lambda c: c["opt"].load_state_dict(_other_layout(path, how))

    def grown() -> dict[str, Any]:
        ctx = prepared(path)
        ctx["opt"].add_param_group({"params": [nn.Parameter(torch.ones(3, dtype=path.grad_dtype))]})
        ctx["opt"].param_groups[0]["params"].append(nn.Parameter(torch.ones(2, dtype=path.grad_dtype)))
        train_step(ctx["model"], ctx["opt"], ctx["x"], ctx["y"])
        return ctx

    return [
        case("add_param_group(a param it holds)", add(lambda c: {"params": [_first_param(c)]}), DUPLICATE),
        case(
            "add_param_group(a param it holds, lr=1.0)",
            add(lambda c: {"params": _first_param(c), "lr": 1.0}),
            DUPLICATE,
        ),
        case("add_param_group(a new param twice)", add(lambda c: {"params": [fresh(c)] * 2}), ("more than",)),
        case(
            "add_param_group(the tensors its groups hold)",
            add(lambda c: {"params": list(c["opt"].param_groups[0]["params"][:1])}),
            DUPLICATE,
        ),
        case("add_param_group('x')", add(lambda c: "x"), ("param_group",), raises=(TypeError,)),
        case("add_param_group({'params': ['x']})", add(lambda c: {"params": ["x"]}), ("tensor",)),
        case(
            "param_groups[0]['params'].append(a model param it holds); step()",
            lambda c: c["opt"].step(),
            DUPLICATE,
            setup=_hand_edited(path, _first_param),
        ),
        case(
            "param_groups[0]['params'].append(a tensor it steps); step()",
            lambda c: c["opt"].step(),
            ("more than one",),
            setup=_hand_edited(path, lambda c: c["opt"].param_groups[0]["params"][0]),
        ),
        case("load_state_dict(of another width)", load("width"), ("param",)),
        case("load_state_dict(of the params in two groups)", load("groups"), ("param",)),
        case(
            "deepcopy/pickle after add_param_group and a hand edit",
            lambda c: check_roundtrip(c["opt"], lambda o: o.state_dict()),
            (),
            setup=grown,
            roundtrip=True,
            isolate=True,
        ),
    ]


def cases() -> list[Case]:
    """Every optimizer-edit case, on every path of :data:`tests.reliability.paths.PATHS`."""
    return [case for path in PATHS for case in _path_cases(path)]
