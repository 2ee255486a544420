"""Checks that let the wrappers' ``load_state_dict`` validate everything before changing anything.

Each ``check_*`` raises ``TypeError``/``ValueError`` naming the key that is missing or wrong, and mutates
nothing; the loaders then apply a state that is known to fit.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.optim import Optimizer

from mixprec._generators import DeviceGenerators
from mixprec.optim.sharding import local
from mixprec.optim.state_formats import ORIGINS, check_origins, expected_layout

__all__ = ["check_compensated_state", "check_inner_state", "check_scaler_state", "load_inner_state"]

_SHAPED_STATE = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg")


def _require(state_dict: Any, keys: tuple[str, ...], what: str, plain_hint: str = "") -> None:
    """Refuse a non-dict or one without ``keys``; ``plain_hint`` is added when it is a torch optimizer's
    own state_dict (``state`` and ``param_groups`` only), saying how to migrate it."""
    if not isinstance(state_dict, dict):
        raise TypeError(f"{what} state_dict must be a dict, got {type(state_dict).__name__}")
    missing = [k for k in keys if k not in state_dict]
    if missing:
        plain = plain_hint and set(state_dict) == {"state", "param_groups"}
        raise ValueError(
            f"{what} state_dict lacks {missing}; it has {sorted(map(str, state_dict))}"
            + (f": that is a torch optimizer's own state_dict; {plain_hint}" if plain else "")
        )


#: How a plain torch optimizer's state_dict reaches a MixedPrecisionOptimizer (the wrapper moves the
#: state of each model parameter onto its fp32 master when it wraps an optimizer that holds state).
_MIGRATE = (
    "to migrate it, load it into the torch optimizer before mixprec.initialize wraps it "
    "(optimizer.load_state_dict(sd), then initialize: its state moves onto the fp32 masters)"
)


def check_inner_state(optimizer: Optimizer, state_dict: Any) -> None:
    """Validate a torch optimizer's state dict against ``optimizer`` (groups, sizes, state shapes)."""
    _require(state_dict, ("state", "param_groups"), "optimizer")
    groups, state = state_dict["param_groups"], state_dict["state"]
    if not isinstance(groups, list) or not all(isinstance(g, dict) and "params" in g for g in groups):
        raise ValueError("optimizer state_dict['param_groups'] must be a list of dicts with 'params'")
    if not isinstance(state, dict):
        raise ValueError(f"optimizer state_dict['state'] must be a dict, got {type(state).__name__}")
    ours = optimizer.param_groups
    if len(groups) != len(ours):
        raise ValueError(f"optimizer state_dict has {len(groups)} param groups, this optimizer {len(ours)}")
    for i, (saved, group) in enumerate(zip(groups, ours, strict=True)):
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(
                f"param group {i} of the optimizer state_dict has {len(saved['params'])} params, "
                f"this optimizer's {len(group['params'])}"
            )
        for index, param in zip(saved["params"], group["params"], strict=True):
            param = local(param)  # FSDP2: the state of this rank's shard
            for key, value in state.get(index, {}).items():
                if key in _SHAPED_STATE and torch.is_tensor(value) and value.shape != param.shape:
                    raise ValueError(
                        f"optimizer state {index}[{key!r}] has shape {tuple(value.shape)}, "
                        f"its param {tuple(param.shape)}"
                    )


def load_inner_state(optimizer: Optimizer, state_dict: dict[str, Any]) -> None:
    """``optimizer.load_state_dict``, keeping each state tensor in the dtype it was saved in.

    torch casts loaded state to its parameter's dtype, which would turn the fp32 state of a bf16 weight
    into bf16; the saved dtype is the one the wrapper chose, so it is restored.
    """
    optimizer.load_state_dict(state_dict)
    saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for index, param in zip(saved_ids, params, strict=True):
        for key, value in state_dict["state"].get(index, {}).items():
            loaded = optimizer.state[param].get(key)
            if torch.is_tensor(value) and torch.is_tensor(loaded) and loaded.dtype != value.dtype:
                optimizer.state[param][key] = value.to(device=loaded.device)


def check_scaler_state(scaler: Any, state_dict: Any) -> None:
    """Raise what ``scaler.load_state_dict(state_dict)`` would, changing nothing.

    mixprec's GradScaler validates without loading (``validate_state_dict``); a scaler without that method
    (torch's own, handed to ``initialize``) is checked by loading into a copy of it.
    """
    validate = getattr(scaler, "validate_state_dict", None)
    if callable(validate):
        validate(state_dict)
    else:
        copy.deepcopy(scaler).load_state_dict(state_dict)


def check_saved_format(inner: Optimizer, fmt: str | None, saved: Any, state: Any, what: str) -> None:
    """Refuse a state dict saved with another ``state_format`` (``saved``), or whose moments do not have
    the layout ``fmt`` stores (:func:`mixprec.optim.state_formats.expected_layout`); changes nothing."""
    if saved != fmt:
        raise ValueError(
            f"{what} state_dict was saved with state_format={saved!r}, this optimizer uses "
            f"state_format={fmt!r}; build the optimizer with state_format={saved!r} to load it "
            "(nothing was changed)"
        )
    if not (
        isinstance(state, dict)
        and isinstance(state.get("state"), dict)
        and isinstance(state.get("param_groups"), list)
    ):
        return  # a CompensatedOptimizer's dict (checked on its own), or malformed: check_inner_state says
    ids = [i for g in state["param_groups"] if isinstance(g, dict) for i in g.get("params", [])]
    params = [p for g in inner.param_groups for p in g["params"]]
    for index, param in zip(ids, params, strict=False):
        saved_state = state["state"].get(index, {})
        if not saved_state:
            continue
        param = local(param)
        origins = None
        if fmt in ("int8", "fp8") and ORIGINS in saved_state:
            origins = check_origins(saved_state[ORIGINS], param.numel())
        layout = expected_layout(fmt, param, origins)
        for key, (shape, dtype) in layout.items():
            value = saved_state.get(key)
            if not torch.is_tensor(value) or tuple(value.shape) != shape or value.dtype != dtype:
                got = (tuple(value.shape), value.dtype) if torch.is_tensor(value) else value
                raise ValueError(
                    f"optimizer state {index}[{key!r}] is {got}; state_format={fmt!r} stores {shape} {dtype}"
                )
        if fmt is None and any(str(k).endswith("_scale") for k in saved_state):
            raise ValueError(
                f"optimizer state {index} holds block scales ({sorted(map(str, saved_state))}): it was saved "
                "with a low-bit state_format, this optimizer uses state_format=None"
            )


def check_compensated_state(optimizer: Any, state_dict: Any) -> None:
    """Validate a :class:`CompensatedOptimizer` state dict (its generator states as
    :meth:`~mixprec._generators.DeviceGenerators.check_state` does)."""
    _require(state_dict, ("method", "optimizer", "compensation", "generators"), "CompensatedOptimizer")
    check_saved_format(
        optimizer.optimizer,
        getattr(optimizer, "state_format", None),
        state_dict.get("state_format"),
        state_dict["optimizer"],
        "CompensatedOptimizer",
    )
    if state_dict["method"] != optimizer.method:
        raise ValueError(
            f"state_dict was saved with method {state_dict['method']!r}, this is {optimizer.method!r}"
        )
    saved = state_dict["compensation"]
    if not isinstance(saved, (list, tuple)) or not all(torch.is_tensor(t) for t in saved):
        raise ValueError("state_dict['compensation'] must be a list of tensors")
    if [(t.shape, t.dtype) for t in saved] != [(c.shape, c.dtype) for c in optimizer.compensation]:
        raise ValueError(
            "saved compensation buffers do not match this optimizer's parameters: "
            f"{[(tuple(t.shape), t.dtype) for t in saved]} vs "
            f"{[(tuple(c.shape), c.dtype) for c in optimizer.compensation]}"
        )
    DeviceGenerators.check_state(state_dict["generators"], "state_dict['generators']")
    skipped = state_dict.get("skipped_steps", 0)  # absent from state dicts saved before it was kept
    if isinstance(skipped, bool) or not isinstance(skipped, int) or skipped < 0:
        raise ValueError(f"state_dict['skipped_steps'] must be an int >= 0, got {skipped!r}")
    check_inner_state(optimizer.optimizer, state_dict["optimizer"])


def load_mixed_precision_state(optimizer: Any, state_dict: Any) -> None:
    """:meth:`MixedPrecisionOptimizer.load_state_dict`: validate every part, then apply them all.

    Should applying fail after all (a device error, say), the inner optimizer's previous state is put back.
    """
    _require(state_dict, ("optimizer", "master_params", "scaler"), "MixedPrecisionOptimizer", _MIGRATE)
    saved = state_dict["master_params"]
    if not isinstance(saved, (list, tuple)) or not all(torch.is_tensor(t) for t in saved):
        raise ValueError("state_dict['master_params'] must be a list of tensors")
    shapes = [tuple(t.shape) for t in saved]
    if shapes != [tuple(m.shape) for m in optimizer.master_params]:
        raise ValueError(
            f"saved master params {shapes} do not match this optimizer's "
            f"{[tuple(m.shape) for m in optimizer.master_params]}"
        )
    if not all(t.is_floating_point() for t in saved):
        raise ValueError("saved master params must be floating-point tensors")
    inner = optimizer.optimizer
    check_saved_format(
        inner,
        getattr(optimizer, "state_format", None),
        state_dict.get("state_format"),
        state_dict["optimizer"],
        "MixedPrecisionOptimizer",
    )
    if hasattr(inner, "compensation"):  # a CompensatedOptimizer inside
        check_compensated_state(inner, state_dict["optimizer"])
    else:
        check_inner_state(inner, state_dict["optimizer"])
    check_scaler_state(optimizer.scaler, state_dict["scaler"])
    targets = optimizer.master_params
    masters = [t.to(device=m.device, dtype=torch.float32) for t, m in zip(saved, targets, strict=True)]
    previous = inner.state_dict()
    try:
        inner.load_state_dict(state_dict["optimizer"]) if hasattr(
            inner, "compensation"
        ) else load_inner_state(inner, state_dict["optimizer"])
    except Exception:
        inner.load_state_dict(previous)
        raise
    with torch.no_grad():
        if masters:
            torch._foreach_copy_(optimizer.master_params, masters)
            torch._foreach_copy_([local(p) for p in optimizer.model_params], optimizer.master_params)
    optimizer.scaler.load_state_dict(state_dict["scaler"])
