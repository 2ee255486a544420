"""apex-style opt levels (O0-O3) and Lightning/Accelerate-style presets: :func:`~mixprec.initialize`.

=====  ===================  =========  ===============  ==============  =============  ===================
level  weights              autocast   BatchNorm        master weights  loss scale     inputs / outputs
=====  ===================  =========  ===============  ==============  =============  ===================
O0     fp32                 no         fp32             no              none           as given
O1     fp32                 yes        fp32             no (fp32 already) dynamic      as given
O2     ``dtype``            no         fp32             fp32 copies     dynamic        cast in, fp32 out
O3     ``dtype``            no         ``dtype``        no              static 1       cast in, as computed
=====  ===================  =========  ===============  ==============  =============  ===================

``dtype`` defaults per device: fp16 on CUDA, bf16 elsewhere. Presets name a level, a dtype and overrides:
``"32-true"`` (O0), ``"16-mixed"`` / ``"bf16-mixed"`` (O1; bf16 with a static scale of 1), ``"16-true"`` /
``"bf16-true"`` (O3).

A static scale of 1 does not scale, but a step whose gradients hold inf/nan is still skipped: that is the
default of every preset without dynamic scaling, so a NaN never reaches the weights, the masters or the
Kahan buffers. With ``weight_update="kahan"``/``"stochastic"`` at that scale the check runs inside the
compensated update pass instead of the scaler (:class:`~mixprec.optim.compensated.CompensatedOptimizer`'s
``skip_nonfinite``, which also skips a gradient whose square would overflow Adam's second moment); under
any other scale it runs in both. ``loss_scale=None`` opts out (no check, no skip, as torch).

Casting never touches modules kept in fp32 (BatchNorm under ``keep_batchnorm_fp32``) and refuses a cast
that would turn a finite value into inf. fp16 weights without masters (O3, "16-true") are stepped through
:class:`~mixprec.optim.compensated.CompensatedOptimizer` with ``method="nearest"``: the optimizer state
stays fp32, since torch's Adam on fp16 state divides by an ``eps`` that is 0 in fp16 (NaN rows).
:func:`~mixprec.initialize` checks everything before it changes the model; if wrapping fails it undoes
the cast.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mixprec import formats
from mixprec._tree import map_tensors
from mixprec.amp.casting import cast_model, cast_with_undo
from mixprec.optim import CompensatedOptimizer, MixedPrecisionOptimizer
from mixprec.optim.compensated import has_stepped
from mixprec.scaling import resolve_scaler

__all__ = [
    "OPT_LEVELS",
    "PRESETS",
    "OptLevel",
    "PrecisionForward",
    "cast_model",
    "initialize",
    "resolve_level",
]


@dataclass(frozen=True)
class OptLevel:
    """One row of the opt-level table; :func:`~mixprec.initialize`'s overrides replace fields by name."""

    cast_model: bool
    autocast: bool
    keep_batchnorm_fp32: bool
    master_weights: bool
    loss_scale: Any
    cast_inputs: bool
    outputs_fp32: bool
    min_loss_scale: float | None = None
    max_loss_scale: float | None = None
    weight_update: str = "nearest"  # "kahan" / "stochastic": compensated pure low-precision weights


#: apex's opt levels O0-O3, each an ``OptLevel`` of what :func:`mixprec.initialize` does to the model
#: and optimizer.
OPT_LEVELS: dict[str, OptLevel] = {
    "O0": OptLevel(cast_model=False, autocast=False, keep_batchnorm_fp32=False, master_weights=False,
                   loss_scale=None, cast_inputs=False, outputs_fp32=False),
    "O1": OptLevel(cast_model=False, autocast=True, keep_batchnorm_fp32=False, master_weights=False,
                   loss_scale="dynamic", cast_inputs=False, outputs_fp32=False),
    "O2": OptLevel(cast_model=True, autocast=False, keep_batchnorm_fp32=True, master_weights=True,
                   loss_scale="dynamic", cast_inputs=True, outputs_fp32=True),
    "O3": OptLevel(cast_model=True, autocast=False, keep_batchnorm_fp32=False, master_weights=False,
                   loss_scale=1.0, cast_inputs=True, outputs_fp32=False),
}  # fmt: skip

#: The Lightning-style presets, name -> (opt level, dtype or None for the device default, overrides).
PRESETS: dict[str, tuple[str, torch.dtype | None, dict[str, Any]]] = {
    "32-true": ("O0", None, {}),
    "16-mixed": ("O1", torch.float16, {}),
    "bf16-mixed": ("O1", torch.bfloat16, {"loss_scale": 1.0}),  # no scaling; inf/nan steps skipped
    "16-true": ("O3", torch.float16, {}),
    "bf16-true": ("O3", torch.bfloat16, {}),
}

DEFAULT_HALF_DTYPE: dict[str, torch.dtype] = {"cuda": torch.float16}  # any other device: bfloat16
_HALF_DTYPES = (torch.float16, torch.bfloat16)
_WEIGHT_UPDATES = ("nearest", "kahan", "stochastic")
OVERRIDES = ("keep_batchnorm_fp32", "master_weights", "loss_scale", "min_loss_scale", "max_loss_scale",
             "weight_update", "cast_inputs", "outputs_fp32")  # fmt: skip


def _level_spelled(opt_level: object) -> str | None:
    """The level or preset ``opt_level`` spells in another case or with a zero for the O ("o2", "02",
    "BF16-Mixed"), or None."""
    if not isinstance(opt_level, str):
        return None
    text = opt_level.strip()
    if text.lower() in PRESETS:
        return text.lower()
    level = "O" + text[1:] if text[:1] in ("o", "0", "O") else text
    return level if level in OPT_LEVELS else None


def resolve_level(
    opt_level: str, dtype: torch.dtype | str | None, device_type: str, **overrides: Any
) -> tuple[OptLevel, torch.dtype]:
    """The level's row with overrides applied, and the half dtype it uses.

    Returns:
        ``(level, dtype)``.

    Raises:
        ValueError: for an unknown level/preset or dtype, or overrides that contradict the level.
        TypeError: for an unknown override name.
    """
    if opt_level in PRESETS:
        opt_level, preset_dtype, preset_overrides = PRESETS[opt_level]
        dtype = dtype if dtype is not None else preset_dtype
        overrides = {**preset_overrides, **overrides}
    if opt_level not in OPT_LEVELS:
        choices = [*OPT_LEVELS, *PRESETS]
        lightning = str(opt_level).replace("fp16", "16")  # Lightning's names drop fp16's "fp"
        close = [lightning] if lightning in PRESETS else difflib.get_close_matches(lightning, choices, n=2)
        spelled = _level_spelled(opt_level)
        close = [spelled] if spelled is not None else close
        hint = f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""
        if spelled in OPT_LEVELS:  # apex takes only the exact "O2": so does mixprec, with the hint
            hint = f" (did you mean {spelled!r}? a level is a capital letter O and a digit, as in apex)"
        raise ValueError(
            f"unknown opt_level {opt_level!r}{hint}; accepted: O0, O1, O2, O3 or a preset {list(PRESETS)}"
        )
    unknown = sorted(set(overrides) - set(OVERRIDES))
    if unknown:
        close = [c for u in unknown for c in difflib.get_close_matches(u, OVERRIDES, n=1)]
        hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
        raise TypeError(f"unknown override(s) {unknown}{hint}; accepted: {list(OVERRIDES)}")
    level = dataclasses.replace(OPT_LEVELS[opt_level], **overrides)
    _check(level, opt_level, overrides)
    half: torch.dtype | None
    if dtype is None:
        half = DEFAULT_HALF_DTYPE.get(device_type, torch.bfloat16)
    else:  # the dtype names every mixprec dtype argument takes; a Format record too
        half = dtype.dtype if isinstance(dtype, formats.Format) else formats.as_dtype(dtype, "dtype")
    if half is None or half not in _HALF_DTYPES:
        raise ValueError(
            f"dtype must be a half-precision type, got {dtype!r}; accepted: {list(_HALF_DTYPES)}"
        )
    if level.weight_update == "stochastic" and half != torch.bfloat16:
        raise ValueError(f"weight_update='stochastic' rounds to bfloat16 only, got dtype {half}; use 'kahan'")
    return level, half


def _check(level: OptLevel, name: str, overrides: dict[str, Any]) -> None:
    for flag in ("keep_batchnorm_fp32", "master_weights"):
        if flag in overrides and not isinstance(overrides[flag], bool):
            raise TypeError(
                f"{flag} must be a bool, got {type(overrides[flag]).__name__}: {overrides[flag]!r}"
            )
    if "keep_batchnorm_fp32" in overrides and not level.cast_model:
        raise ValueError(f"keep_batchnorm_fp32 applies to levels that cast the model (O2, O3), not {name}")
    if level.weight_update not in _WEIGHT_UPDATES:
        raise ValueError(f"unknown weight_update {level.weight_update!r}; accepted: {list(_WEIGHT_UPDATES)}")
    if level.weight_update != "nearest" and (level.master_weights or not level.cast_model):
        raise ValueError(
            f"weight_update={level.weight_update!r} compensates low-precision weights without masters; "
            f"{name} with master_weights={level.master_weights} has none to compensate (use 'bf16-true')"
        )


def _check_optimizer_owns(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The optimizer must step the model's parameters: a foreign one would train nothing of it."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        return  # the type is refused with its own message further on
    own = {id(p) for p in model.parameters()}
    stepped = [p for g in optimizer.param_groups for p in g["params"]]
    if stepped and not any(id(p) in own for p in stepped):
        raise ValueError(
            "optimizer holds none of the model's parameters: build it on model.parameters() "
            f"({len(stepped)} foreign tensors given)"
        )


def _cast_floats(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with floating tensors (in tuples, namedtuples, lists and dicts too) cast to ``dtype``."""
    return map_tensors(value, lambda tensor: tensor.to(dtype) if tensor.is_floating_point() else tensor)


class PrecisionForward:
    """A model's ``forward`` under an opt level: inputs cast on entry, autocast around, outputs to fp32.

    Installed as ``model.forward`` by :func:`~mixprec.initialize`; it also marks the model as initialized.
    """

    def __init__(
        self,
        forward: Callable[..., Any],
        opt_level: str,
        level: OptLevel,
        device_type: str,
        dtype: torch.dtype,
    ) -> None:
        self.forward = forward
        self.opt_level = opt_level
        self.level = level
        self.device_type = device_type
        self.dtype = dtype

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.level.cast_inputs:
            args, kwargs = _cast_floats(args, self.dtype), _cast_floats(kwargs, self.dtype)
        with self._region():
            output = self.forward(*args, **kwargs)
        return _cast_floats(output, torch.float32) if self.level.outputs_fp32 else output

    def _region(self) -> contextlib.AbstractContextManager[Any]:
        if not self.level.autocast:
            return contextlib.nullcontext()
        from mixprec.autocast import autocast

        return autocast(self.device_type, dtype=self.dtype)


def _refuse_prepared(model: nn.Module, optimizer: torch.optim.Optimizer, level: OptLevel) -> None:
    """Errors before anything is changed: wrong types, a model or optimizer prepared already, a cast that
    would replace the parameters the optimizer holds, or an optimizer a compensated update cannot take."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model.__dict__.get("forward"), PrecisionForward):
        previous = model.__dict__["forward"].opt_level
        raise RuntimeError(
            f"model was already prepared by mixprec.initialize ({previous!r}); do it once per model"
        )
    if isinstance(optimizer, MixedPrecisionOptimizer):
        raise RuntimeError("optimizer is already a MixedPrecisionOptimizer; pass the inner torch optimizer")
    if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(optimizer, CompensatedOptimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if level.cast_model and torch.__future__.get_overwrite_module_params_on_conversion():
        raise RuntimeError(
            "torch.__future__.set_overwrite_module_params_on_conversion(True) makes casting replace the "
            "parameters the optimizer holds; turn it off for initialize()"
        )


def _weight_update(level: OptLevel, half: torch.dtype) -> str | None:
    """The CompensatedOptimizer method for pure low-precision weights, or None for the torch optimizer."""
    if level.weight_update != "nearest":
        return level.weight_update
    if level.cast_model and not level.master_weights and half == torch.float16:
        return "nearest"  # fp16 weights: keep the optimizer state (and eps) in fp32
    return None


def _unit_scale(spec: Any) -> bool:
    return isinstance(spec, (int, float)) and not isinstance(spec, bool) and spec == 1


def initialize(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    opt_level: str = "O1",
    *,
    dtype: torch.dtype | str | None = None,
    **overrides: Any,
) -> tuple[nn.Module, MixedPrecisionOptimizer]:
    """Prepare ``model`` and ``optimizer`` for an opt level (O0-O3) or preset ("bf16-mixed", ...).

    The model should be on its device and the optimizer built on its parameters. The model is changed in
    place (cast, ``forward`` wrapped) and returned; the optimizer comes back wrapped.

    Args:
        model: the model; it may be prepared once.
        optimizer: a torch optimizer over the model's parameters.
        opt_level: "O0", "O1", "O2", "O3", "32-true", "16-mixed", "bf16-mixed", "16-true" or "bf16-true".
        dtype: half type for O1-O3 (torch dtype or name); default fp16 on CUDA, bf16 elsewhere.
        **overrides: ``keep_batchnorm_fp32``, ``master_weights``, ``loss_scale`` (a loss-scale spec: None,
            "dynamic", a number or a GradScaler, read by :func:`mixprec.scaling.resolve_scaler`),
            ``min_loss_scale``, ``max_loss_scale``, ``weight_update`` ("nearest", "kahan",
            "stochastic"; for pure low-precision weights) and the table's other columns.

    Returns:
        ``(model, optimizer)``; the optimizer has ``backward(loss)``, ``step()``, ``zero_grad()`` and
        ``state_dict()``.

    Raises:
        ValueError: unknown level, dtype or override value; a cast that would overflow; an optimizer that
            already holds state under a compensated update.
        TypeError: unknown override name; a model or optimizer of the wrong type.
        RuntimeError: the model or optimizer was already prepared.

    Everything is checked before the model changes; a call that raises leaves model and optimizer as they
    were, so a corrected retry works.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    param = next(model.parameters(), None)
    device_type = param.device.type if param is not None else "cpu"
    level, half = resolve_level(opt_level, dtype, device_type, **overrides)
    _refuse_prepared(model, optimizer, level)
    _check_optimizer_owns(model, optimizer)
    scaler = resolve_scaler(level.loss_scale, device_type, min_scale=level.min_loss_scale,
                            max_scale=level.max_loss_scale)  # fmt: skip
    method = _weight_update(level, half)
    held = [p for g in optimizer.param_groups for p in g["params"]]
    if method is not None and any(has_stepped(optimizer, p) for p in held):
        raise ValueError(
            f"weight_update={method!r} needs the optimizer before its first step: it already holds state"
        )
    undo = cast_with_undo(model, half, level.keep_batchnorm_fp32) if level.cast_model else None
    try:
        inner = optimizer
        if method is not None:
            guard = level.weight_update != "nearest" and level.loss_scale is not None
            inner = CompensatedOptimizer(optimizer, method, skip_nonfinite=guard)
            if guard and _unit_scale(level.loss_scale):  # the update pass checks: no separate read
                scaler = resolve_scaler(None, device_type)
        wrapped = MixedPrecisionOptimizer(inner, scaler=scaler, master_weights=level.master_weights)
    except Exception:
        if undo is not None:
            undo()
        raise
    model.forward = PrecisionForward(model.forward, str(opt_level), level, device_type, half)
    return model, wrapped
