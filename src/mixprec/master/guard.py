"""The huge-gradient guard: a finite gradient whose square overflows never reaches the optimizer state.

One step with ``|g| = 1e30`` is finite in fp32 and bf16, so the loss scaler's inf/nan check lets it
through, but Adam's ``exp_avg_sq += (1 - beta2) * g * g`` becomes inf; from then on every update is
``exp_avg / inf = 0`` and the weights never move again (torch behaves the same). The guard wraps the
inner step (as optax wraps an update in ``apply_if_finite``)::

    amax  = max |g| over the gradients the inner step consumes (after unscaling)
    limit = sqrt(largest finite value of the state dtype)    # 1.8e19 for fp32 and bf16 state
    if amax > limit: skip the inner step, count it, warn     # state, masters and weights untouched
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

__all__ = ["HugeGradientGuard", "square_limit"]


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
        last_amax: the largest ``|g|`` of the latest skipped step (0.0 before any).
    """

    def __init__(self, state_dtype: torch.dtype | None = None) -> None:
        self.state_dtype = state_dtype
        self.skipped_steps = 0
        self.last_step_skipped = False
        self.last_amax = 0.0

    def allows(self, params: Iterable[torch.Tensor]) -> bool:
        """Whether the step may run on these params' (unscaled) gradients; counts and warns when not.

        One ``aminmax`` pass over the gradients and one host read for the whole step.
        """
        buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for param in params:
            grad = param.grad
            if grad is not None and grad.is_floating_point() and not grad.is_sparse:
                buckets.setdefault((grad.device, grad.dtype), []).append(grad)
        if not buckets:
            self.last_step_skipped = False
            return True
        limits, amaxes = [], []
        for (_, dtype), grads in buckets.items():
            limits.append(square_limit(self.state_dtype or dtype))
            # aminmax per tensor: a single vectorised pass (the inf-norm kernel is ~30x slower on a CPU)
            bounds = torch.stack([torch.stack(torch.aminmax(g)) for g in grads]).float()
            amaxes.append(bounds.abs().max().cpu())
        values = torch.stack(amaxes).tolist()  # the one host sync (per device)
        over = [(a, limit) for a, limit in zip(values, limits, strict=True) if not a <= limit]
        self.last_step_skipped = bool(over)
        if over:
            self.skipped_steps += 1
            self.last_amax, limit = max(over)
            warnings.warn(
                f"skipped an optimizer step: a gradient of |g| up to {self.last_amax:.3g} exceeds "
                f"{limit:.3g}, the largest value whose square the optimizer state can hold (Adam's "
                f"exp_avg_sq would become inf and freeze the weights); {self.skipped_steps} such step(s) "
                "skipped so far",
                RuntimeWarning,
                stacklevel=4,
            )
        return not self.last_step_skipped
