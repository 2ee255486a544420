"""The pieces both optimizer wrappers share: the wrapper base class and the loss-scale spec.

:class:`OptimizerWrapper` makes a wrapper an :class:`~torch.optim.Optimizer` whose ``param_groups``, ``state``
and ``defaults`` are the inner optimizer's, holds what the wrappers differ in as methods they override (the
guard a scaler steps them with, their parts for resharding) and adds the ``state_format`` their state dicts
carry; :func:`check_state_format` is the one check of a ``state_format=``; :func:`resolve_scaler` turns
``loss_scale=`` specs into a scaler.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import Optimizer

from mixprec.optim.fused_adam import check_lowbit_params, step_groups
from mixprec.optim.guard import HugeGradientGuard
from mixprec.optim.rounding import Workspace
from mixprec.optim.state_formats import STATE_FORMATS
from mixprec.optim.updates import fast_algorithm
from mixprec.scaling.spec import resolve_scaler

__all__ = [
    "LOW_PRECISION_DTYPES",
    "OptimizerWrapper",
    "ScalerView",
    "check_state_format",
    "first_device",
    "resolve_scaler",
]

#: The low-precision floating dtypes (fp16, bf16) the optimizer wrappers treat as half parameters.
LOW_PRECISION_DTYPES = frozenset({torch.float16, torch.bfloat16})


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

    def scaler_guard(self) -> HugeGradientGuard | None:
        """The huge-gradient guard a loss scaler around this wrapper steps it with (None: the wrapper's own
        update pass checks the gradients); the state dtype's guard by default."""
        return HugeGradientGuard()

    def shard_parts(self) -> tuple[dict[str, Any], list[Any], list[Any], str] | None:
        """What ``mixprec.optim.sharding.full_state_dict`` gathers: this wrapper's state dict, the
        param behind each inner state id, the param behind each entry of its per-param list and that
        list's key; None when the wrapper cannot be resharded."""
        return None

    def _with_state_format(self, parts: dict[str, Any]) -> dict[str, Any]:
        """A wrapper's state dict: its ``parts``, plus ``"state_format"`` when one is set (absent for None:
        such a state dict is as before low-bit states existed)."""
        state_format = getattr(self, "state_format", None)
        return parts if state_format is None else {**parts, "state_format": state_format}

    def gradient_params(self) -> list[torch.Tensor]:
        """The tensors whose ``.grad`` ``step()`` consumes: what a loss scaler must unscale first."""
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


def check_state_format(optimizer: Optimizer, state_format: Any) -> str | None:
    """The ``state_format`` a wrapper of ``optimizer`` may keep Adam's moments in: None, or one of
    ``STATE_FORMATS`` with a fresh ``torch.optim.Adam``/``AdamW`` (any foreach/fused/capturable flag) of
    contiguous params.

    Raises:
        ValueError: an unknown format (naming it and the accepted ones), an optimizer that is itself a
            wrapper (the format goes to that one), not Adam/AdamW (or with amsgrad, differentiable or tensor
            hyperparameters), that already holds state, or a param that is not contiguous.
    """
    if state_format is None:
        return None
    if not (isinstance(state_format, str) and state_format in STATE_FORMATS):
        raise ValueError(
            f"unknown state_format {state_format!r}; accepted: None (the inner optimizer's own state), "
            + ", ".join(repr(f) for f in STATE_FORMATS)
        )
    if isinstance(optimizer, OptimizerWrapper):
        name = type(optimizer).__name__
        raise ValueError(
            f"state_format={state_format!r}: give it to the {name} inside ({name}(..., state_format=...)), "
            "which steps the state"
        )
    if fast_algorithm(optimizer, capturable=True) != "adam":
        raise ValueError(
            f"state_format={state_format!r} needs torch.optim.Adam or AdamW (without amsgrad, "
            f"differentiable, tensor hyperparameters), got {type(optimizer).__name__}"
        )
    if any(optimizer.state.values()):
        raise ValueError(f"state_format={state_format!r}: wrap the optimizer before its first step")
    check_lowbit_params([p for group in optimizer.param_groups for p in group["params"]])
    return state_format


def first_device(optimizer: Optimizer) -> torch.device:
    """Device of the optimizer's first parameter (where the loss scale should live)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            return param.device
    return torch.device("cpu")


class ScalerView:
    """What the loss scaler unscales and steps: the gradients the inner step consumes, and that step.

    For a plain optimizer these are its params (the fp32 masters among them). A wrapper such as
    CompensatedOptimizer reads the model's gradients while its groups hold gradient-less scratch params.
    ``guard`` (:class:`~mixprec.optim.guard.HugeGradientGuard`) may skip the inner step after the scaler
    decided to take it. With a ``state_format`` the step is Adam/AdamW on low-bit moments
    (:func:`mixprec.optim.fused_adam.step_groups`) instead of the inner optimizer's own.
    """

    def __init__(self, optimizer: Optimizer, guard: Any = None, state_format: str | None = None) -> None:
        self.optimizer = optimizer
        self.guard = guard  # a HugeGradientGuard, or None
        self.param_groups: list[dict[str, Any]] = []
        self.state_format = state_format
        self.workspace = Workspace() if state_format is not None else None

    def refresh(self) -> list[torch.Tensor]:
        inner = self.optimizer
        if isinstance(inner, OptimizerWrapper):
            params = inner.gradient_params()
        else:
            params = [p for group in inner.param_groups for p in group["params"]]
        self.param_groups = [{"params": params}]
        return params

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """The inner step, unless the guard finds a gradient that would overflow the optimizer state."""
        if (
            self.guard is not None
            and self.param_groups
            and not self.guard.allows(self.param_groups[0]["params"])
        ):
            return None
        if self.state_format is not None:
            with torch.no_grad():
                step_groups(self.optimizer, self.state_format, self.workspace)  # type: ignore[arg-type]
            return None
        return self.optimizer.step(*args, **kwargs)
