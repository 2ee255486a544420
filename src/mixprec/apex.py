"""apex's ``amp`` and ``FP16_Optimizer`` names on mixprec's own masters and scaler.

Code written for NVIDIA apex runs with one import changed::

    from mixprec.apex import amp                  # was: from apex import amp
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 1.0)   # unscaled fp32 master grads
    optimizer.step()

    from mixprec.apex import FP16_Optimizer       # was: from apex.fp16_utils import FP16_Optimizer
    optimizer = FP16_Optimizer(optimizer, dynamic_loss_scale=True)
    optimizer.backward(loss); optimizer.clip_master_grads(1.0); optimizer.step()

Nothing here is a second implementation: :meth:`amp.initialize <mixprec.apex.Amp.initialize>` is
:func:`mixprec.initialize` (apex's defaults: fp16, dynamic scale from 2**16 up to 2**24) and
:class:`FP16_Optimizer` is a :class:`~mixprec.MixedPrecisionOptimizer` with a
:class:`~mixprec.GradScaler`, so a loop written either way trains bit for bit alike. Signatures follow
apex's ``apex/amp/frontend.py``, ``apex/amp/handle.py`` and ``apex/fp16_utils/fp16_optimizer.py``. What
apex did that mixprec does not raises :class:`NotImplementedError` naming the replacement;
docs/known-differences.md lists where the two behave differently (a static scale skips inf/nan steps here).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from mixprec.amp import initialize
from mixprec.formats import as_dtype
from mixprec.optim import MixedPrecisionOptimizer
from mixprec.optim.wrapper import first_device
from mixprec.scaling import DynamicScale, GradScaler

__all__ = ["FP16_Optimizer", "amp"]

_APEX_DYNAMIC_ARGS = ("init_scale", "scale_factor", "scale_window")
_APEX_LEVELS = ("O0", "O1", "O2", "O3")
_HALF_TYPES = [torch.float16, torch.bfloat16]


def _unsupported(what: str, instead: str) -> NotImplementedError:
    return NotImplementedError(f"mixprec.apex does not support {what}; instead, {instead}")


def _bool_flag(name: str, value: Any) -> bool | None:
    """apex takes True/False, the strings "True"/"False", or None (the level's default)."""
    if value in (None, True, False):
        return value
    if value in ("True", "False"):
        return value == "True"
    raise TypeError(f"{name} must be True, False, 'True', 'False' or None, got {value!r}")


def _loss_scale(value: Any) -> Any:
    """apex's ``loss_scale`` in mixprec's loss-scale spec: a string holding a number (apex parses its options
    from text) becomes the number; anything else is passed on as it is, for
    :func:`mixprec.scaling.resolve_scaler` to accept or refuse with the message every entry point gives."""
    if isinstance(value, str) and value != "dynamic":
        try:
            return float(value)
        except ValueError:
            return value
    return value


class Amp:
    """apex's ``amp`` module: the scalers of the latest :meth:`initialize` are its state, as in apex."""

    def __init__(self) -> None:
        self.optimizers: list[MixedPrecisionOptimizer] = []
        self.enabled = True  # the latest initialize's ``enabled``: False makes scale_loss yield the loss

    def initialize(
        self,
        models: nn.Module | list[nn.Module],
        optimizers: torch.optim.Optimizer | list[torch.optim.Optimizer] | None = None,
        enabled: bool = True,
        opt_level: str = "O1",
        cast_model_type: torch.dtype | None = None,
        patch_torch_functions: bool | None = None,
        keep_batchnorm_fp32: bool | str | None = None,
        master_weights: bool | None = None,
        loss_scale: float | str | None = None,
        cast_model_outputs: torch.dtype | None = None,
        num_losses: int = 1,
        verbosity: int = 1,
        min_loss_scale: float | None = None,
        max_loss_scale: float = 2.0**24,
    ) -> Any:
        """``mixprec.initialize(model, optimizer, opt_level, dtype=cast_model_type or float16, ...)``.

        Returns ``(model, optimizer)`` (lists where lists were given, as apex); the optimizer is a
        :class:`~mixprec.MixedPrecisionOptimizer` whose ``step()``/``zero_grad()`` are called as before.
        ``enabled=False`` returns them unchanged, and :meth:`scale_loss` then yields the loss itself, so
        one loop runs with ``enabled=args.fp16`` either way (as apex).
        ``verbosity`` is accepted and ignored (mixprec prints nothing).

        Raises:
            TypeError: ``enabled`` that is not a bool (``amp.initialize(model, optimizer, "O2")`` gives the
                level as ``enabled``, as apex's signature reads; the message says to pass ``opt_level=``).
            NotImplementedError: several models or optimizers, ``num_losses > 1``, an inference-only call
                (no optimizer), ``patch_torch_functions`` against the level, ``cast_model_outputs`` other
                than float32; each message names the replacement.
            ValueError, TypeError: what :func:`mixprec.initialize` refuses (unknown level, bad values).
        """
        if isinstance(enabled, str) and enabled not in ("True", "False"):  # initialize(model, opt, "O2")
            raise TypeError(
                f"enabled must be True or False, got {enabled!r}: amp.initialize's third argument is apex's "
                f"enabled, not the level; pass opt_level={enabled!r} by keyword"
            )
        if not _bool_flag("enabled", enabled):
            self.optimizers, self.enabled = [], False  # no scaler: state_dict() is {}, not an earlier run's
            return models if optimizers is None else (models, optimizers)
        model, optimizer, as_lists = _single(models, optimizers)
        if num_losses != 1:
            raise _unsupported(f"num_losses={num_losses}", "use one mixprec.GradScaler per loss")
        if patch_torch_functions is not None and patch_torch_functions != (opt_level == "O1"):
            raise _unsupported(
                f"patch_torch_functions={patch_torch_functions} with {opt_level!r}",
                "choose opt_level='O1' (mixprec.autocast) or 'O2'/'O3' (a cast model)",
            )
        overrides = _overrides(keep_batchnorm_fp32, master_weights, loss_scale, cast_model_outputs)
        scale = overrides.get("loss_scale", "dynamic" if opt_level in ("O1", "O2") else None)
        if scale == "dynamic":
            overrides.update(min_loss_scale=min_loss_scale, max_loss_scale=max_loss_scale)
        if opt_level not in _APEX_LEVELS:
            raise ValueError(f"unexpected opt_level {opt_level!r}; apex's levels are {list(_APEX_LEVELS)}")
        dtype = torch.float16 if cast_model_type is None or opt_level == "O0" else _cast_type(cast_model_type)
        model, optimizer = initialize(model, optimizer, opt_level, dtype=dtype, **overrides)
        self.optimizers, self.enabled = [optimizer], True
        return ([model], [optimizer]) if as_lists else (model, optimizer)

    @contextlib.contextmanager
    def scale_loss(
        self,
        loss: torch.Tensor,
        optimizers: MixedPrecisionOptimizer | list[MixedPrecisionOptimizer],
        loss_id: int = 0,
        model: nn.Module | None = None,
        delay_unscale: bool = False,
        delay_overflow_check: bool = False,
    ) -> Iterator[torch.Tensor]:
        """Yield ``loss.float() * loss_scale``; on exit unscale the gradients into the params the
        optimizer steps (the fp32 masters under O2), unless ``delay_unscale`` (gradient accumulation).
        After ``initialize(..., enabled=False)``: yield ``loss`` itself, as apex.

        Raises:
            RuntimeError: an optimizer not returned by :meth:`initialize`, or a second backward whose
                gradients would miss the already-unscaled masters (use ``delay_unscale=True`` before).
            NotImplementedError: ``loss_id`` other than 0, ``delay_overflow_check=True``.
        """
        if not self.enabled:
            yield loss
            return
        if loss_id != 0:
            raise _unsupported(f"loss_id={loss_id}", "use one mixprec.GradScaler per loss")
        if delay_overflow_check:
            raise _unsupported("delay_overflow_check=True", "leave it False: the check is one fused pass")
        opts = optimizers if isinstance(optimizers, (list, tuple)) else [optimizers]
        for opt in opts:
            if not isinstance(opt, MixedPrecisionOptimizer):
                raise RuntimeError(
                    f"amp.scale_loss needs the optimizer amp.initialize returned, got {type(opt).__name__}"
                )
            if opt.grads_unscaled:
                raise RuntimeError(
                    "amp.scale_loss: the gradients were already unscaled since the last step; pass "
                    "delay_unscale=True to every scale_loss before the last one of the iteration"
                )
        yield opts[0].scaler.scale(loss.float())
        if not delay_unscale:
            for opt in opts:
                opt.unscale_grads()

    @staticmethod
    def master_params(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
        """The params ``optimizer`` steps (the fp32 masters under O2), as apex's generator."""
        for group in optimizer.param_groups:
            yield from group["params"]

    def state_dict(self, destination: dict | None = None) -> dict[str, dict[str, float | int]]:
        """apex's format: ``{"loss_scaler0": {"loss_scale": float, "unskipped": int}}``."""
        out = {} if destination is None else destination
        for i, opt in enumerate(self.optimizers):
            state = opt.scaler.state_dict()
            out[f"loss_scaler{i}"] = {
                "loss_scale": opt.loss_scale,
                "unskipped": state.get("_growth_tracker", 0),
            }
        return out

    def load_state_dict(self, state_dict: dict[str, dict[str, float | int]]) -> None:
        """Restore :meth:`state_dict`'s (or apex's) loss scalers; all are checked before any changes.

        Raises:
            ValueError: another number of loss scalers, missing keys or a non-positive scale.
        """
        names = [f"loss_scaler{i}" for i in range(len(self.optimizers))]
        if not isinstance(state_dict, dict) or sorted(state_dict) != names:
            raise ValueError(f"amp state_dict must hold exactly {names}, got {state_dict!r}")
        merged = []
        for name, opt in zip(names, self.optimizers, strict=True):
            entry = state_dict[name]
            if not isinstance(entry, dict) or {"loss_scale", "unskipped"} - set(entry):
                raise ValueError(
                    f"amp state_dict[{name!r}] needs 'loss_scale' and 'unskipped', got {entry!r}"
                )
            merged.append(_scaler_state(opt.scaler, entry))
        for opt, state in zip(self.optimizers, merged, strict=True):
            opt.scaler.load_state_dict(state)

    @staticmethod
    def register_half_function(module: Any, name: str) -> None:
        raise _unsupported("amp.register_*_function", "edit the policy: Policy().with_ops(lower=[name])")

    register_float_function = register_promote_function = register_half_function

    @staticmethod
    def disable_casts() -> None:
        raise _unsupported("amp.disable_casts()", "use torch.autocast(device, enabled=False) around the code")


def _single(models: Any, optimizers: Any) -> tuple[nn.Module, torch.optim.Optimizer, bool]:
    as_lists = isinstance(models, (list, tuple))
    model_list = list(models) if as_lists else [models]
    opt_list = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
    if optimizers is None:
        raise _unsupported("amp.initialize without an optimizer", "call model.half() for inference")
    if len(model_list) != 1 or len(opt_list) != 1:
        raise _unsupported(
            f"{len(model_list)} models and {len(opt_list)} optimizers in one amp.initialize",
            "call mixprec.initialize(model, optimizer, ...) once per pair",
        )
    return model_list[0], opt_list[0], as_lists


def _cast_type(value: Any) -> torch.dtype:
    """apex's ``cast_model_type`` (or a dtype name mixprec takes), refused under its own name."""
    dtype = as_dtype(value, "cast_model_type")
    if dtype not in _HALF_TYPES:
        raise ValueError(
            f"cast_model_type must be a half-precision type, got {value!r}; accepted: {_HALF_TYPES}"
        )
    return dtype


def _overrides(keep_bn: Any, master_weights: Any, loss_scale: Any, outputs: Any) -> dict[str, Any]:
    if outputs not in (None, torch.float32):
        raise _unsupported(f"cast_model_outputs={outputs}", "cast the outputs in your loss function")
    given = {
        "keep_batchnorm_fp32": _bool_flag("keep_batchnorm_fp32", keep_bn),
        "master_weights": _bool_flag("master_weights", master_weights),
        "loss_scale": _loss_scale(loss_scale),
        "outputs_fp32": True if outputs is not None else None,
    }
    return {k: v for k, v in given.items() if v is not None}


def _scaler_state(scaler: Any, entry: dict[str, Any]) -> dict[str, Any]:
    scale = _loss_scale(entry["loss_scale"])
    unskipped = entry["unskipped"]
    positive = isinstance(scale, (int, float)) and not isinstance(scale, bool) and 0 < scale < math.inf
    if not positive or not isinstance(unskipped, int) or isinstance(unskipped, bool) or unskipped < 0:
        raise ValueError(f"amp loss scaler state must be a positive scale and a count >= 0, got {entry!r}")
    state = {**scaler.state_dict(), "scale": float(scale)}
    if "_growth_tracker" in state:
        state["_growth_tracker"] = unskipped
    return state


amp = Amp()


class FP16_Optimizer(MixedPrecisionOptimizer):
    """apex's ``FP16_Optimizer``: fp32 masters and a loss scaler around a torch optimizer.

    Args:
        init_optimizer: a torch optimizer on a half-precision model (fp32 params are their own masters).
        static_loss_scale: the loss scale when ``dynamic_loss_scale`` is False (default 1.0): any loss-scale
            spec :func:`mixprec.scaling.resolve_scaler` accepts, or a string holding a number.
        dynamic_loss_scale: dynamic scaling (a :class:`~mixprec.GradScaler` floored at 1, as apex's).
        dynamic_loss_args: apex's ``DynamicLossScaler`` arguments: ``init_scale`` (default 2**32),
            ``scale_factor`` (2.0), ``scale_window`` (1000 clean steps before growing).
        verbose: accepted and ignored (mixprec prints nothing).

    Raises:
        TypeError: unknown ``dynamic_loss_args`` keys, or what MixedPrecisionOptimizer refuses.
        ValueError: a ``static_loss_scale`` that is not a loss-scale spec (the message lists the accepted
            ones), ``dynamic_loss_args`` without ``dynamic_loss_scale``, or a value there that is not a
            number (``init_scale`` >= 1, ``scale_factor`` > 1) or an int (``scale_window`` >= 1).
    """

    def __init__(
        self,
        init_optimizer: torch.optim.Optimizer,
        static_loss_scale: float = 1.0,
        dynamic_loss_scale: bool = False,
        dynamic_loss_args: dict[str, Any] | None = None,
        verbose: bool = True,
    ) -> None:
        if dynamic_loss_scale:
            scaler: Any = _dynamic_scaler(init_optimizer, dynamic_loss_args or {})
        elif dynamic_loss_args is not None:
            raise ValueError("dynamic_loss_args apply with dynamic_loss_scale=True only")
        else:
            scaler = _loss_scale(static_loss_scale)
        super().__init__(init_optimizer, scaler=scaler, master_weights=True)
        self.dynamic_loss_scale = isinstance(getattr(self.scaler, "rule", None), DynamicScale)  # as it scales

    def backward(  # type: ignore[override]  # apex FP16_Optimizer's own signature
        self, loss: torch.Tensor, update_master_grads: bool = True, retain_graph: bool = False
    ) -> None:
        """``(loss.float() * loss_scale).backward()``; then :meth:`update_master_grads` unless told not to.

        Raises:
            RuntimeError: the master gradients were already updated in this iteration (several losses:
                pass ``update_master_grads=False`` to every backward but the last, as apex advises).
        """
        if self.grads_unscaled:
            raise RuntimeError(
                "FP16_Optimizer.backward: the master gradients were already updated since the last step; "
                "pass update_master_grads=False to every backward of the iteration but the last"
            )
        super().backward(loss.float(), retain_graph=retain_graph)
        if update_master_grads:
            self.update_master_grads()

    def update_master_grads(self) -> None:
        """Copy the model's gradients to the fp32 masters, unscaled (after ``backward(..., False)``)."""
        self.unscale_grads()

    def clip_master_grads(  # type: ignore[override]  # apex returns -1 on overflow
        self, max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor | int:
        """Clip the masters' unscaled gradients; the norm before clipping, or -1 on overflow (apex's)."""
        norm = super().clip_master_grads(max_norm, norm_type)
        return norm if bool(torch.isfinite(norm)) else -1

    @property
    def overflow(self) -> bool:
        """apex's flag, which apex-era loops read after ``step()`` to hold the LR schedule
        (``if not optimizer.overflow: lr_scheduler.step()``): whether that step was skipped. Between
        ``backward`` (or :meth:`update_master_grads`) and ``step()``, as apex set it there: whether the
        unscaled master gradients hold inf/nan (one pass and a host read, as apex's check)."""
        if not self.grads_unscaled:
            return self.last_step_skipped
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        return bool(grads) and not bool(torch.stack([torch.isfinite(g).all() for g in grads]).all())

    @property
    def loss_scale(self) -> float:  # type: ignore[override]
        """The current loss scale; setting it replaces the scale (as apex's ``cur_scale``).

        Raises:
            ValueError: on setting a value that is not a finite number > 0 (the scale is unchanged).
        """
        return float(self.scaler.get_scale())

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        self.scaler.load_state_dict({**self.scaler.state_dict(), "scale": _loss_scale(value)})

    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        """Step the masters unless the gradients overflowed, then copy them to the model."""
        if closure is not None:
            raise _unsupported("step(closure)", "call optimizer.backward(loss) and then optimizer.step()")
        super().step()


def _dynamic_scaler(optimizer: torch.optim.Optimizer, args: dict[str, Any]) -> GradScaler:
    unknown = sorted(set(args) - set(_APEX_DYNAMIC_ARGS))
    if unknown:
        raise TypeError(f"unknown dynamic_loss_args {unknown}; accepted: {list(_APEX_DYNAMIC_ARGS)}")
    init_scale = args.get("init_scale", 2.0**32)
    factor, window = args.get("scale_factor", 2.0), args.get("scale_window", 1000)
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 1 < factor < math.inf:
        raise ValueError(f"dynamic_loss_args['scale_factor'] must be a finite number > 1, got {factor!r}")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"dynamic_loss_args['scale_window'] must be an int >= 1, got {window!r}")
    return GradScaler(  # checks init_scale under its own name
        first_device(optimizer).type,
        init_scale=init_scale,
        growth_factor=factor,
        backoff_factor=1.0 / factor,
        growth_interval=window,
        min_scale=1.0,
    )
