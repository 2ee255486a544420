"""The huge-gradient guard: a finite gradient whose square overflows never reaches the optimizer state.

One step with ``|g| = 1e30`` is finite in fp32 and bf16, so the loss scaler's inf/nan check lets it
through, but Adam's ``exp_avg_sq += (1 - beta2) * g * g`` becomes inf; from then on every update is
``exp_avg / inf = 0`` and the weights never move again (torch behaves the same). The guard wraps the
inner step (as optax wraps an update in ``apply_if_finite``)::

    norm  = max L2 norm of the gradients the inner step consumes (after unscaling; >= every |g|)
    limit = sqrt(largest finite value of the state dtype)    # 1.8e19 for fp32 and bf16 state
    if norm > limit: skip the inner step, count it, warn     # state, masters and weights untouched
    else:            inner.step()

What it covers: every optimizer state that holds ``g * g`` of one step (Adam, AdamW, NAdam, RAdam,
RMSprop, Adadelta; Adagrad's first step) stays finite, and a step that would have put such a square into
it is skipped instead. What it does not cover: state that adds up squares over many steps (Adagrad's
``state_sum`` after many gradients near the limit) and updates that are finite but huge (SGD with
``|g| = 1e18``): those behave as in torch. The limit compares gradients of the state's range, so fp16
weights with fp32 state (``"16-true"``) never reach it (fp16's largest gradient is 65504).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable

import torch

__all__ = ["HugeGradientGuard", "grads_fit", "grads_of", "largest_norms", "square_limit"]


def square_limit(dtype: torch.dtype) -> float:
    """The largest ``|g|`` whose square is finite in ``dtype`` (``sqrt(torch.finfo(dtype).max)``)."""
    return math.sqrt(torch.finfo(dtype).max)


class HugeGradientGuard:
    """Skips an inner step whose gradients would overflow the optimizer state (see the module doc).

    Args:
        state_dtype: None (the state has each parameter's dtype, as torch's optimizers make it) or the
            dtype every state tensor has (``torch.float32`` for :class:`CompensatedOptimizer`'s state).

    Attributes:
        skipped_steps: inner steps skipped so far.
        last_step_skipped: whether the latest checked step was skipped.
        last_norm: the largest gradient L2 norm of the latest skipped step (0.0 before any).
    """

    def __init__(self, state_dtype: torch.dtype | None = None) -> None:
        self.state_dtype = state_dtype
        self.skipped_steps = 0
        self.last_step_skipped = False
        self.last_norm = 0.0

    def allows(self, params: Iterable[torch.Tensor]) -> bool:
        """Whether the step may run on these params' (unscaled) gradients; counts and warns when not.

        One ``_foreach_norm`` per device and dtype and one host read per device for the whole step (see
        :func:`largest_norms`): a tensor's L2 norm bounds each of its values, so the guard may skip a step
        a little before a single square would overflow, never after.
        """
        grads = [p.grad for p in params if p.grad is not None]
        norms = largest_norms(g for g in grads if g.is_floating_point() and not g.is_sparse)
        over = [
            (norm, limit)
            for (_, dtype), norm in norms.items()
            if not norm <= (limit := square_limit(self.state_dtype or dtype))  # nan compares False
        ]
        self.last_step_skipped = bool(over)
        if over:
            self.skipped_steps += 1
            self.last_norm, limit = max(over)
            warnings.warn(
                f"skipped an optimizer step: a gradient of L2 norm up to {self.last_norm:.3g} may hold a "
                f"value over {limit:.3g}, the largest whose square the optimizer state can hold (Adam's "
                f"exp_avg_sq would become inf and freeze the weights); {self.skipped_steps} such step(s) "
                "skipped so far",
                RuntimeWarning,
                stacklevel=4,
            )
        return not self.last_step_skipped


def grads_of(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The gradient of each of ``params``: the steps are given only parameters that have one."""
    grads = []
    for i, param in enumerate(params):
        if param.grad is None:
            raise ValueError(f"parameter {i} of the step has no gradient; a step takes params with a .grad")
        grads.append(param.grad)
    return grads


def grads_fit(params: Iterable[torch.Tensor], state_dtype: torch.dtype = torch.float32) -> bool:
    """Whether every gradient of ``params`` is finite and its square fits a ``state_dtype`` second moment:
    each group's largest L2 norm (:func:`largest_norms`, one host sync) at most ``sqrt(max / 2)`` of
    ``state_dtype`` (about 1.3e19 for fp32 and bf16), so that ``beta2 * v + (1 - beta2) * g * g`` stays
    finite. The check every update path of the compensated optimizer makes before it writes anything."""
    limit = (torch.finfo(state_dtype).max / 2) ** 0.5
    norms = largest_norms(grads_of(params))
    return all(norm <= limit for norm in norms.values())  # nan compares False


def largest_norms(grads: Iterable[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], float]:
    """The largest L2 norm of ``grads`` per ``(device, dtype)``: one ``torch._foreach_norm`` per group
    and one host read per device. A norm is inf or nan when a tensor holds inf or nan, and bounds
    every ``|g|`` of its tensor. Empty tensors are left out; no gradients give ``{}``.

    The one non-finite / overflow check of the master-weight paths (this guard, the compensated updates,
    the fused Adam path above ``rounding.FOLD`` values, which below it checks its own fp32 gradient copies);
    the inf-norm kernel would be exact but is ~30x slower on a CPU.
    """
    buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for grad in grads:
        if grad.numel():
            buckets.setdefault((grad.device, grad.dtype), []).append(grad)
    if not buckets:
        return {}
    maxima = [torch.stack(torch._foreach_norm(group, 2)).max().float() for group in buckets.values()]
    # One device-to-host read per device (not per dtype group): the maxima are stacked where they are.
    by_device: dict[torch.device, list[int]] = {}
    for i, (device, _) in enumerate(buckets):
        by_device.setdefault(device, []).append(i)
    values: list[float] = [0.0] * len(maxima)
    for idx in by_device.values():
        for i, v in zip(idx, torch.stack([maxima[i] for i in idx]).cpu().tolist(), strict=True):
            values[i] = v
    return dict(zip(buckets, values, strict=True))
