"""fp32 master weights behind a half-precision model: :class:`MixedPrecisionOptimizer`.

In fp16 ``1 + 1e-4 == 1`` (in bf16 even ``1 + 1e-3 == 1``): an update smaller than half the gap to a weight's
neighbour is rounded away, so a half-precision model that steps its own weights stalls. The cure (Micikevicius
et al. 2018; apex's ``FP16_Optimizer``) keeps an fp32 master copy of every half-precision parameter and lets
the optimizer step the masters. One iteration::

    backward(loss):  (loss * scale).backward()          # scaled grads land on the half-precision params
    step():
        master.grad <- fp32(param.grad)                  # one foreach copy
        scaler.unscale_(inner)                           # master.grad /= scale, found_inf recorded
        scaler.step(inner)                               # inner.step() on the masters unless found_inf
        scaler.update()                                  # back off after inf/nan, grow after a clean run
        param <- half(master)                            # one foreach copy (a no-op after a skipped step)

Parameters that already are fp32 (BatchNorm kept fp32, or every parameter under O1) are their own masters.
The skip decision is the only host sync, inside ``scaler.step``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.optim import Optimizer

__all__ = ["LOW_PRECISION_DTYPES", "MixedPrecisionOptimizer", "OptimizerWrapper", "resolve_scaler"]

LOW_PRECISION_DTYPES = frozenset({torch.float16, torch.bfloat16})

_SCALER_METHODS = ("scale", "unscale_", "step", "update", "get_scale", "state_dict", "load_state_dict")
_ACCEPTED_SCALERS = (
    "None (no loss scaling), 'dynamic', a positive finite number (static scale) or a GradScaler"
)
_STATE_KEYS = ("optimizer", "master_params", "scaler")


def resolve_scaler(
    spec: Any, device_type: str, *, min_scale: float | None = None, max_scale: float | None = None
) -> Any:
    """Turn a loss-scale spec into a scaler object with ``torch.amp.GradScaler``'s API.

    Args:
        spec: None (no scaling, no skipping: a disabled scaler), ``"dynamic"`` (mixprec's GradScaler, starting
            at 2**16 clamped into the bounds), a positive number (a static scale: it never changes, but a step
            with inf/nan gradients is still skipped; at 1.0 fp16 gradients are accepted, as unscaling is a
            no-op) or a ready scaler, returned as is.
        device_type: where the scale tensor lives ("cuda", "cpu", ...).
        min_scale: lower bound of a dynamic scale.
        max_scale: upper bound of a dynamic scale.

    Raises:
        ValueError: for any other spec, or bounds given with a spec they do not apply to.
    """
    if all(callable(getattr(spec, name, None)) for name in _SCALER_METHODS):
        _no_bounds(min_scale, max_scale, "a ready GradScaler (configure it directly)")
        return spec
    from mixprec.scaling import GradScaler, NoScale, StaticScale

    if spec is None:
        _no_bounds(min_scale, max_scale, "loss_scale=None")
        return GradScaler(device_type, enabled=False)
    if spec == "dynamic":
        init_scale = min(max(2.0**16, min_scale or 0.0), max_scale or math.inf)
        return GradScaler(device_type, init_scale, min_scale=min_scale, max_scale=max_scale)
    if isinstance(spec, (int, float)) and not isinstance(spec, bool) and math.isfinite(spec) and spec > 0:
        _no_bounds(min_scale, max_scale, f"a static loss_scale ({spec})")
        if spec == 1:
            return GradScaler(device_type, rule=NoScale(), allow_fp16_grads=True)
        return GradScaler(device_type, rule=StaticScale(float(spec)))
    raise ValueError(f"unknown loss scale {spec!r}; accepted: {_ACCEPTED_SCALERS}")


def _no_bounds(min_scale: float | None, max_scale: float | None, what: str) -> None:
    if min_scale is not None or max_scale is not None:
        raise ValueError(
            f"min/max loss scale ({min_scale}, {max_scale}) apply to 'dynamic' scaling only, not to {what}"
        )


class OptimizerWrapper(Optimizer):
    """Base for an optimizer that wraps another: ``param_groups``, ``state`` and ``defaults`` are the inner's.

    Being an :class:`~torch.optim.Optimizer` lets LR schedulers, step hooks and ``isinstance`` checks accept
    the wrapper; forwarding the three attributes means a scheduler that sets ``group["lr"]`` on the wrapper
    steers the inner optimizer, and there is no second copy of state to drift.
    """

    def __init__(self, optimizer: Optimizer) -> None:
        if not isinstance(optimizer, Optimizer):
            raise TypeError(
                f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}: {optimizer!r}"
            )
        self.optimizer = optimizer
        # Optimizer.__setstate__ creates the hook tables and patches step for profiling/hooks without
        # creating param_groups or state of our own (Optimizer.__init__ would).
        Optimizer.__setstate__(self, {})

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    def gradient_params(self) -> list[torch.Tensor]:
        """The tensors whose ``.grad`` :meth:`step` consumes: what a loss scaler must unscale first."""
        return [p for group in self.param_groups for p in group["params"]]

    def _zero_grads(self, model_params: list[torch.Tensor], set_to_none: bool) -> None:
        """Clear the model's gradients (not in the inner optimizer's groups) and then the inner's."""
        for param in model_params:
            if set_to_none:
                param.grad = None
            elif param.grad is not None:
                param.grad.detach_().zero_()
        self.optimizer.zero_grad(set_to_none)

    def __getstate__(self) -> dict[str, Any]:
        # Hooks are not state (torch drops them too); everything else is the wrapper's own fields.
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_optimizer_")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        Optimizer.__setstate__(self, {})


def _first_device(optimizer: Optimizer) -> torch.device:
    """Device of the optimizer's first parameter (where the loss scale should live)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            return param.device
    return torch.device("cpu")


class _ScalerView:
    """What the loss scaler unscales and steps: the gradients the inner step consumes, and that step.

    For a plain optimizer these are its params (the fp32 masters among them). A wrapper such as
    CompensatedOptimizer reads the model's gradients while its groups hold gradient-less scratch params.
    """

    def __init__(self, optimizer: Optimizer) -> None:
        self.optimizer = optimizer
        self.param_groups: list[dict[str, Any]] = []

    def refresh(self) -> list[torch.Tensor]:
        inner = self.optimizer
        if isinstance(inner, OptimizerWrapper):
            params = inner.gradient_params()
        else:
            params = [p for group in inner.param_groups for p in group["params"]]
        self.param_groups = [{"params": params}]
        return params

    def step(self, *args: Any, **kwargs: Any) -> Any:
        return self.optimizer.step(*args, **kwargs)


class MixedPrecisionOptimizer(OptimizerWrapper):
    """Loss scaling and fp32 master weights around a torch optimizer whose params may be half precision.

    The wrapped optimizer is taken over: in its ``param_groups`` every fp16/bf16 parameter is replaced by an
    fp32 master copy (existing optimizer state moves to the master, cast to fp32). ``param_groups`` of the
    wrapper are those groups, so LR schedulers and per-group options work on the wrapper unchanged.

    Args:
        optimizer: a torch optimizer built on the model's parameters.
        scaler: None (no scaling), ``"dynamic"`` (default, mixprec's GradScaler), a number (static scale) or
            a GradScaler-like object.
        master_weights: keep fp32 copies of half-precision params (True), or step them in place (False, apex
            O3 / "bf16-true").

    Raises:
        TypeError: if ``optimizer`` is not an Optimizer or is already a MixedPrecisionOptimizer.
        ValueError: for an unknown scaler spec.
    """

    def __init__(self, optimizer: Optimizer, *, scaler: Any = "dynamic", master_weights: bool = True) -> None:
        if isinstance(optimizer, MixedPrecisionOptimizer):
            raise TypeError("optimizer is already a MixedPrecisionOptimizer; wrap the inner optimizer once")
        super().__init__(optimizer)
        self.master_weights = master_weights
        self.model_params: list[torch.Tensor] = []
        self.master_params: list[torch.Tensor] = []
        self.scaler = resolve_scaler(scaler, _first_device(optimizer).type)
        self._scaler_view = _ScalerView(optimizer)
        self._grads_ready = False
        for group in optimizer.param_groups:
            self._adopt(group)

    def _adopt(self, group: dict[str, Any]) -> None:
        group["params"] = [self._master_for(p) for p in group["params"]]

    def _master_for(self, param: torch.Tensor) -> torch.Tensor:
        if not (self.master_weights and param.dtype in LOW_PRECISION_DTYPES):
            return param
        master = torch.nn.Parameter(param.detach().to(torch.float32, copy=True), param.requires_grad)
        state = self.optimizer.state.pop(param, None)
        if state:
            self.optimizer.state[master] = {
                k: v.float() if torch.is_tensor(v) and v.dtype == param.dtype else v for k, v in state.items()
            }
        self.model_params.append(param)
        self.master_params.append(master)
        return master

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the inner optimizer, with fp32 masters for its half-precision params."""
        self.optimizer.add_param_group(param_group)
        self._adopt(self.optimizer.param_groups[-1])

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without scaling). Reading it syncs with the device."""
        return float(self.scaler.get_scale())

    @property
    def skipped_steps(self) -> int:
        """Steps skipped so far because a gradient was inf/nan (0 for a scaler that does not count)."""
        return int(getattr(self.scaler, "skipped_steps", 0))

    @property
    def last_step_skipped(self) -> bool:
        """Whether the latest ``step()`` was skipped: step LR schedulers only when it was not."""
        return bool(getattr(self.scaler, "last_step_skipped", False))

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Scale ``loss`` and run backward; ``kwargs`` go to ``Tensor.backward`` (e.g. ``retain_graph``)."""
        self.scaler.scale(loss).backward(**kwargs)

    def _prepare_grads(self) -> None:
        """Copy the model's gradients to the masters and unscale them, once per step."""
        if self._grads_ready:
            return
        pairs = [
            (m, p.grad)
            for p, m in zip(self.model_params, self.master_params, strict=True)
            if p.grad is not None
        ]
        for master, _ in pairs:
            if master.grad is None:
                master.grad = torch.empty_like(master)
        if pairs:
            torch._foreach_copy_([m.grad for m, _ in pairs], [g for _, g in pairs])
        self._scaler_view.refresh()
        self.scaler.unscale_(self._scaler_view)
        self._grads_ready = True

    def clip_master_grads(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Unscale and clip the gradients the optimizer will use.

        Returns:
            The total norm of the unscaled gradients before clipping, as a tensor (no host sync); inf or nan
            when the step is going to be skipped.
        """
        self._prepare_grads()
        params = [p for p in self._scaler_view.param_groups[0]["params"] if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)

    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        """Unscale, skip on inf/nan (the scale backs off), step the masters and copy them to the model."""
        if closure is not None:
            raise ValueError(
                "MixedPrecisionOptimizer.step does not take a closure; call backward(loss) first"
            )
        self._prepare_grads()
        self.scaler.step(self._scaler_view)
        self.scaler.update()
        if self.model_params:
            with torch.no_grad():
                torch._foreach_copy_(self.model_params, self.master_params)
        self._grads_ready = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's and the masters' gradients."""
        self._zero_grads(self.model_params, set_to_none)
        self._grads_ready = False

    def state_dict(self) -> dict[str, Any]:
        """Inner optimizer state, fp32 masters (references, as torch does) and scaler state."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "master_params": [m.detach() for m in self.master_params],
            "scaler": self.scaler.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved; the model's half-precision weights are set from the masters.

        Raises:
            ValueError: when keys are missing or the saved masters do not match this optimizer's.
        """
        missing = [k for k in _STATE_KEYS if k not in state_dict]
        if missing:
            raise ValueError(f"state_dict lacks {missing}; a MixedPrecisionOptimizer state has {_STATE_KEYS}")
        saved = state_dict["master_params"]
        shapes = [tuple(t.shape) for t in saved]
        if shapes != [tuple(m.shape) for m in self.master_params]:
            raise ValueError(
                f"saved master params {shapes} do not match this optimizer's "
                f"{[tuple(m.shape) for m in self.master_params]}"
            )
        self.optimizer.load_state_dict(state_dict["optimizer"])
        if saved:
            with torch.no_grad():
                torch._foreach_copy_(
                    self.master_params,
                    [t.to(m.device) for t, m in zip(saved, self.master_params, strict=True)],
                )
                torch._foreach_copy_(self.model_params, self.master_params)
        self.scaler.load_state_dict(state_dict["scaler"])
        self._grads_ready = False
