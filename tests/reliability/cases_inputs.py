"""Battery cases: Policy's dtype-valued fields, and fp8 (``mixprec.float8``) inputs and state.

Policy: every dtype field refuses a name or value that is not fp32/bf16/fp16 at construction (good names
are normalised: ``test_inputs.py``). fp8: the config's bounds, ``module_filter_fn``'s contract, delayed
scaling checkpoints that do not fit or would poison the scales (validated before any tensor of the model
loads) and inputs ``nn.Linear`` refuses too.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import nn

import mixprec
from mixprec.float8 import Float8Config, Float8Linear, convert_to_float8_training

from .battery import Case

DTYPE_FIELDS = ("compute_dtype", "param_dtype", "output_dtype")
BAD_DTYPES: tuple[tuple[str, Any, type[BaseException]], ...] = (
    ("'fp17'", "fp17", ValueError),
    ("''", "", ValueError),
    ("'float64'", "float64", ValueError),
    ("'int8'", "int8", ValueError),
    ("torch.float64", torch.float64, ValueError),
    ("torch.int32", torch.int32, ValueError),
    ("torch.complex64", torch.complex64, ValueError),
    ("3", 3, TypeError),
    ("1.5", 1.5, TypeError),
    ("b'bf16'", b"bf16", TypeError),
)


def policy_cases() -> list[Case]:
    cases = []
    for field in DTYPE_FIELDS:
        for label, value, error in BAD_DTYPES:
            cases.append(
                Case(
                    f"every dtype field: Policy({field}={label})",
                    lambda _, f=field, v=value: mixprec.Policy(**{f: v}),
                    names=(field,),
                    raises=(error,),
                    owner="policy",
                )
            )
    for label, value, _ in BAD_DTYPES:
        if value != "":  # '' is not a dtype name but a (bad) policy string: its own error
            cases.append(
                Case(
                    f"Policy(module_overrides=(('fc', {label}),))",
                    lambda _, v=value: mixprec.Policy(module_overrides=(("fc", v),)),
                    names=("fc",),
                    raises=(ValueError, TypeError),
                    owner="policy",
                )
            )
    return cases


OWNER = "float8"
DELAYED = Float8Config(scaling="delayed", amax_history_len=4)


def _converted() -> dict[str, Any]:
    torch.manual_seed(0)
    model = convert_to_float8_training(
        nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)), config=DELAYED
    )
    for _ in range(2):
        model(torch.randn(3, 4)).sum().backward()
    return {"model": model, "state": copy.deepcopy(model.state_dict())}


def _poisoned(key: str, value: Any) -> Any:
    def make(ctx: dict[str, Any]) -> dict[str, Any]:
        state = {k: v.clone() for k, v in ctx["state"].items()}
        state["0.weight"] = state["0.weight"] + 1  # loads first if nothing checks ahead
        if callable(value):
            state[key] = value(state[key])
        else:
            state[key] = value
        return state

    return make


def _set(index: tuple[int, int], number: float) -> Any:
    def change(history: torch.Tensor) -> torch.Tensor:
        history[index] = number
        return history

    return change


def config_cases() -> list[Case]:
    values = {
        "margin": (200, 15, -1, 10**6),
        "amax_history_len": (10**12, 2**16 + 1, 0),
    }
    return [
        Case(
            f"Float8Config({field}={value})",
            lambda _, f=field, v=value: Float8Config(**{f: v}),
            names=(field,),
            owner=OWNER,
        )
        for field, options in values.items()
        for value in options
    ]


def filter_cases() -> list[Case]:
    returns = {"a tensor": torch.tensor(False), "'False'": "False", "None": None, "0": 0, "a list": []}
    arities = {
        "lambda: True": lambda: True,
        "lambda m: True": lambda m: True,
        "lambda m, f, x: True": lambda m, f, x: True,
    }
    cases = [
        Case(
            f"convert_to_float8_training(module_filter_fn returning {label})",
            lambda c, r=result: convert_to_float8_training(c["model"], module_filter_fn=lambda m, f: r),
            names=("module_filter_fn",),
            setup=lambda: {"model": nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))},
            owner=OWNER,
        )
        for label, result in returns.items()
    ]
    cases += [
        Case(
            f"convert_to_float8_training(module_filter_fn={label})",
            lambda c, fn=fn: convert_to_float8_training(c["model"], module_filter_fn=fn),
            names=("module_filter_fn",),
            setup=lambda: {"model": nn.Sequential(nn.Linear(4, 4))},
            owner=OWNER,
        )
        for label, fn in arities.items()
    ]
    return cases


def state_cases() -> list[Case]:
    bad = {
        "amax_history of another amax_history_len": ("0.amax_history", torch.zeros(3, 7)),
        "amax_history with inf": ("2.amax_history", _set((0, 0), math.inf)),
        "amax_history with nan": ("0.amax_history", _set((2, 1), math.nan)),
        "amax_history with -inf": ("2.amax_history", _set((1, 3), -math.inf)),
        "amax_history with a negative amax": ("0.amax_history", _set((1, 0), -1.0)),
        "amax_history of 2 rows": ("0.amax_history", torch.zeros(2, 4)),
        "amax_history as a list": ("0.amax_history", [[0.0] * 4] * 3),
        "amax_history of ints": ("0.amax_history", torch.zeros(3, 4, dtype=torch.int64)),
    }
    cases = [
        Case(
            f"Float8 model.load_state_dict({label})",
            lambda c, m=_poisoned(key, value): c["model"].load_state_dict(m(c)),  # noqa: B008
            names=("amax_history",),
            setup=_converted,
            target=lambda c: c["model"],
            owner=OWNER,
        )
        for label, (key, value) in bad.items()
    ]

    def single() -> dict[str, Any]:
        layer = Float8Linear(4, 4, config=DELAYED)
        layer(torch.randn(2, 4)).sum().backward()
        return {"model": layer}

    for label, value in {"inf": _set((0, 0), math.inf), "another length": torch.zeros(3, 9)}.items():
        cases.append(
            Case(
                f"Float8Linear.load_state_dict(amax_history {label})",
                lambda c, v=value: c["model"].load_state_dict(
                    {**{k: t + 1 for k, t in c["model"].state_dict().items() if k != "amax_history"},
                     "amax_history": v(c["model"].amax_history.clone()) if callable(v) else v}
                ),
                names=("amax_history",),
                setup=single,
                owner=OWNER,
            )
        )  # fmt: skip
    return cases


def forward_cases() -> list[Case]:
    inputs = {"int64": torch.ones(2, 4, dtype=torch.int64), "bool": torch.ones(2, 4, dtype=torch.bool)}
    return [
        Case(
            f"Float8Linear(input of {label})",
            lambda c, x=x: c["model"](x),
            names=("input", label),
            setup=lambda: {"model": Float8Linear(4, 2, config=DELAYED)},
            raises=(TypeError,),
            owner=OWNER,
        )
        for label, x in inputs.items()
    ]


def cases() -> list[Case]:
    """Every Policy dtype and fp8 case."""
    return policy_cases() + config_cases() + filter_cases() + state_cases() + forward_cases()
