"""Foreach Adam, AdamW and SGD steps that update bf16/fp16 weights in place, compensated or rounded.

:class:`~mixprec.optim.compensated.CompensatedOptimizer` runs these for ``torch.optim.Adam``, ``AdamW`` and
``SGD`` (anything else goes through its generic fp32-scratch path). The optimizer object stays torch's: its
``param_groups`` hold the model's own low-precision parameters, its ``state`` the moments under torch's key
names, so LR schedulers, ``state_dict`` and hooks see a plain torch optimizer. Only ``step`` is replaced.

Adam/AdamW on bf16 weights with Kahan or stochastic rounding take the fused path
(``mixprec.optim.fused_adam``: bf16 first moment, second moment in bf16 or fp32 per
:func:`moment_dtypes`, fp32 arithmetic in the workspace, the non-finite check inside the pass). The rest is
torch's single-tensor algorithm (``torch/optim/adam.py``, ``sgd.py``), per parameter, on whole lists at
once (``torch._foreach_*``). How the update ``u`` reaches a low-precision weight ``w`` depends on the dtype
its optimizer state is kept in::

    fp32 state ("fp32_copy"):  t = fp32(w); t <- t + u exactly as torch steps an fp32 copy; then
        kahan:       t += c; w = round(t); c = round(t - w)        # c: bf16/fp16 buffer per weight
        stochastic:  w = round_stochastic(t)                         # 16 random bits per value
        nearest:     w = round(t)
    bf16 state ("kahan_low"):  the moments, the update and the Kahan fold in bf16 (torch-optimi's sequence):
        kahan:       c = round(c + u); old = w; w = round(w + c); c = round(c + (old - w))
        stochastic:  t = fp32(w) + u; w = round_stochastic(t)
        nearest:     w = round(w + u)

With fp32 state the result is bit for bit what stepping an fp32 scratch copy of each weight with the torch
optimizer and rounding it back computes (test: ``tests/optim/test_optim_equivalence.py``). With bf16 state
every state operation rounds its result to bf16 once (``lerp_``, ``mul_``, ``addcmul_``, ...).

Sources: Adam (Kingma & Ba 2015) and SGD as torch implements them; Kahan-compensated bf16 updates (Zamirai
et al. 2020, "Revisiting BFloat16 Training"; torchdistx AnyPrecisionAdamW; torch-optimi's ``kahan_sum``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mixprec.optim.guard import grads_of
from mixprec.optim.rounding import Workspace, chunks, kahan_fold, round_stochastic_into, views
from mixprec.optim.state_formats import TorchMoments

__all__ = [
    "FAST_OPTIMIZERS",
    "contiguous",
    "fast_algorithm",
    "fused_adam_",
    "moment_dtypes",
    "new_states",
    "round_into",
    "step_counters",
    "step_group",
]

FAST_OPTIMIZERS: dict[type, str] = {
    torch.optim.Adam: "adam",
    torch.optim.AdamW: "adam",
    torch.optim.SGD: "sgd",
}
_UNSUPPORTED = {"adam": ("amsgrad", "differentiable", "capturable"), "sgd": ("differentiable",)}
_SCALAR_KEYS = ("lr", "betas", "weight_decay", "momentum", "eps", "dampening")
_LOW = (torch.float16, torch.bfloat16)
# A bf16 value moves under x <- (1 - d) x only if d exceeds half its ulp: at most 2**-8 of x. An average
# decaying by less (Adam's beta2 = 0.999) would freeze in bf16, so its state stays fp32.
BF16_HALF_ULP = 2.0**-8


def fast_algorithm(optimizer: torch.optim.Optimizer, *, capturable: bool = False) -> str | None:
    """ "adam" or "sgd" when :func:`step_group` can step ``optimizer`` exactly as torch would, else None.

    Only these exact classes qualify (a subclass may change ``step``), with float hyperparameters and
    without amsgrad, differentiable or (unless ``capturable``) capturable. ``capturable=True`` is for the
    low-bit state path (``mixprec.optim.fused_adam``), which steps through torch's fused kernel whatever
    the foreach/fused/capturable flags say, its counters on the device as a capturable step keeps them.
    """
    algorithm = FAST_OPTIMIZERS.get(type(optimizer))
    if algorithm is None:
        return None
    refused = [key for key in _UNSUPPORTED[algorithm] if not (capturable and key == "capturable")]
    for group in optimizer.param_groups:
        if any(group.get(key, False) for key in refused):
            return None
        values = [group.get(key) for key in _SCALAR_KEYS]
        if any(torch.is_tensor(v) or (isinstance(v, tuple) and any(map(torch.is_tensor, v))) for v in values):
            return None
    return algorithm


def moment_dtypes(param_dtype: torch.dtype, algorithm: str, group: dict[str, Any]) -> tuple[torch.dtype, ...]:
    """The dtype each moving average of a ``param_dtype`` weight is kept in, when not forced.

    Adam: ``(exp_avg, exp_avg_sq)``; SGD: ``(momentum_buffer,)``. For bf16 weights an average is bf16 when it
    moves by more than half a bf16 ulp per step (``1 - beta`` > 2**-8), else fp32: at torch's default Adam
    betas (0.9, 0.999), ``exp_avg`` bf16 and ``exp_avg_sq`` fp32. fp16 weights always get fp32 state:
    fp16's range cannot hold squared gradients (1e-4**2 flushes to 0).
    """
    if algorithm == "adam":
        rates = [1 - group["betas"][0], 1 - group["betas"][1]]
    else:
        rates = [1 - group["momentum"] if group["momentum"] else 1.0]
    if param_dtype != torch.bfloat16:
        return tuple(torch.float32 for _ in rates)
    return tuple(torch.bfloat16 if rate > BF16_HALF_ULP else torch.float32 for rate in rates)


def contiguous(*lists: list[torch.Tensor]) -> bool:
    return all(t.is_contiguous() for tensors in lists for t in tensors)


def step_group(
    algorithm: str,
    group: dict[str, Any],
    states: list[dict[str, Any]],
    params: list[torch.Tensor],
    kahan: list[torch.Tensor] | None,
    method: str,
    state_dtype: torch.dtype,
    generator: torch.Generator | None,
    workspace: Workspace,
) -> None:
    """One optimizer step for ``params`` (one group, device and dtype; each has a ``.grad``), unfused.

    Args:
        algorithm: "adam" or "sgd" (from :func:`fast_algorithm`).
        group: the torch param group (hyperparameters).
        states: ``optimizer.state[p]`` per param, created here on the first step in torch's layout.
        params: the weights, updated in place; fp32 weights are stepped exactly as torch steps them.
        kahan: Kahan buffers (param dtype, same shapes) for method "kahan", else None.
        method: "kahan", "stochastic" or "nearest".
        state_dtype: dtype of the optimizer state (fp32, or bf16 for bf16 weights).
        generator: draws the stochastic-rounding bits (method "stochastic").
        workspace: reused scratch for the Kahan fold of bf16-state updates.
    """
    low = params[0].dtype in _LOW
    fp32_copy = low and state_dtype == torch.float32
    if not low or (not fp32_copy and method == "nearest"):
        mode, target = "in_place", params  # fp32 weights, or bf16 weights rounded once per step
    elif fp32_copy or method == "stochastic":
        mode, target = ("fp32_copy" if fp32_copy else "stochastic"), [p.float() for p in params]
    else:  # bf16 state and weights: the update accumulates in the Kahan buffer
        assert kahan is not None, "method 'kahan' steps with its buffers"
        mode, target = "kahan_low", kahan
    decay_base = target if mode in ("in_place", "fp32_copy") else params
    grads = [g if g.dtype == state_dtype else g.to(state_dtype) for g in grads_of(params)]
    step = _adam if algorithm == "adam" else _sgd
    step(group, states, grads, target, decay_base, additive=mode == "kahan_low", fold=state_dtype in _LOW)
    if mode == "kahan_low":
        _kahan_fold_through(params, kahan, workspace)  # type: ignore[arg-type]
    elif mode != "in_place":
        round_into(method, params, target, kahan, generator)


def _kahan_fold_through(params: list[torch.Tensor], kahan: list[torch.Tensor], workspace: Workspace) -> None:
    """:func:`~mixprec.optim.rounding.kahan_fold` over whole tensors, its temporary in the workspace."""
    if not contiguous(params, kahan):
        kahan_fold(params, kahan, [torch.empty_like(p) for p in params])
        return
    limit = min(workspace.numel_on(params[0].device), sum(p.numel() for p in params))
    buffer = workspace.get(params[0].device, params[0].dtype, "denom", limit)
    for (p, c), _ in chunks([params, kahan], limit):
        kahan_fold(p, c, views(buffer, p))


def step_counters(states: list[dict[str, Any]], device: torch.device) -> list[torch.Tensor]:
    """Each state's ``step`` counted up by one (torch's ``step_t += 1``): an fp32 0-dim tensor on ``device``.

    ``device`` is where the step reads it: a param's device for torch's fused kernels (which a GPU refuses
    a host counter: torch's fused and capturable Adam keep theirs there too), the host for a step that
    computes its bias corrections on the host (as torch's foreach Adam does, with no device sync). A counter
    found elsewhere, made by another path or loaded from a state_dict (torch leaves a loaded counter where
    it was saved, in its default dtype), is moved once and stays.
    """
    counters = []
    for state in states:
        step = state["step"]
        if step.device != device or step.dtype != torch.float32:
            step = state["step"] = step.to(device=device, dtype=torch.float32)
        counters.append(step)
    if counters:
        torch._foreach_add_(counters, 1.0)
    return counters


def new_states(
    states: list[dict[str, Any]],
    params: list[torch.Tensor],
    moments: Callable[[torch.Tensor], dict[str, torch.Tensor]],
    counters_on: torch.device | None = None,
) -> list[torch.Tensor]:
    """Create each missing Adam state (torch's ``step`` counter, an fp32 0-dim tensor, then
    ``moments(param)``: the path's zero moments) and count the step (:func:`step_counters`); returns the
    counters. They live on ``counters_on``, by default the params' device, where torch's fused kernel reads
    them (the foreach path keeps them on the host, its bias corrections being host numbers)."""
    for state, param in zip(states, params, strict=True):
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=counters_on or param.device)
            state.update(moments(param))
    return step_counters(states, counters_on or params[0].device)  # torch: step_t += 1 first


def fused_adam_(
    group: dict[str, Any],
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
) -> None:
    """torch's fused Adam (AdamW when the group's ``decoupled_weight_decay`` is set) on fp32 lists, with
    the group's hyperparameters: the kernel behind ``torch.optim.AdamW(fused=True)``, without amsgrad."""
    kernel = torch._fused_adamw_ if group.get("decoupled_weight_decay", False) else torch._fused_adam_
    (beta1, beta2), maximize = group["betas"], group.get("maximize", False)
    kernel(params, grads, exp_avgs, exp_avg_sqs, [], steps, lr=group["lr"], beta1=beta1,
           beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"], amsgrad=False,
           maximize=maximize)  # fmt: skip


_HOST = torch.device("cpu")


def adam_states(states: list[dict[str, Any]], like: list[torch.Tensor]) -> list[float]:
    """Create Adam state as torch does (in the dtype of ``like``), count the step; returns step numbers.

    The counters live on the host (:func:`step_counters`): the bias corrections are host numbers here, so
    reading them costs no device sync.
    """
    if not like:
        return []
    moments = TorchMoments((like[0].dtype, like[0].dtype))
    moments.keep(states)
    return torch.stack(new_states(states, like, moments.new, counters_on=_HOST)).tolist()


def _decay_and_grads(group, grads, target, decay_base, additive):
    """Weight decay as torch applies it; returns the gradients to use (new tensors where they change)."""
    lr, wd = group["lr"], group["weight_decay"]
    if group.get("maximize", False):
        grads = torch._foreach_neg(grads)
    if wd != 0:
        if group.get("decoupled_weight_decay", False):  # AdamW: w *= 1 - lr * wd, before the step
            if additive:
                torch._foreach_add_(target, decay_base, alpha=-lr * wd)
            else:
                torch._foreach_mul_(target, 1 - lr * wd)
        else:
            grads = torch._foreach_add(grads, decay_base, alpha=wd)
    return grads


def _adam(group, states, grads, target, decay_base, additive, fold):
    """torch's single-tensor Adam/AdamW (no amsgrad) on lists; the step lands in ``target``.

    ``fold`` (bf16 state): ``m / (sqrt(v) / s + eps)`` as ``s * m / (sqrt(v) + eps * s)``, ``s`` the square
    root of the second bias correction: equal in exact arithmetic, one pass over the state fewer.
    """
    grads = _decay_and_grads(group, grads, target, decay_base, additive)
    beta1, beta2 = group["betas"]
    steps = adam_states(states, grads)
    exp_avgs = [s["exp_avg"] for s in states]
    exp_avg_sqs = [s["exp_avg_sq"] for s in states]
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
    roots = [(1 - beta2**step) ** 0.5 for step in steps]
    step_sizes = [group["lr"] / (1 - beta1**step) for step in steps]
    denom = torch._foreach_sqrt(exp_avg_sqs)
    if fold:
        torch._foreach_add_(denom, [group["eps"] * root for root in roots])
        torch._foreach_addcdiv_(
            target, exp_avgs, denom, [-a * r for a, r in zip(step_sizes, roots, strict=True)]
        )
    else:
        torch._foreach_div_(denom, roots)
        torch._foreach_add_(denom, group["eps"])
        torch._foreach_addcdiv_(target, exp_avgs, denom, [-a for a in step_sizes])


def _sgd(group, states, grads, target, decay_base, additive, fold):
    """torch's single-tensor SGD (momentum, dampening, nesterov) on lists; the step lands in ``target``."""
    grads = _decay_and_grads(group, grads, target, decay_base, additive)
    momentum = group["momentum"]
    if momentum != 0:
        buffers = []
        for state, grad in zip(states, grads, strict=True):
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = state["momentum_buffer"] = grad.detach().clone()
            else:
                if buf.dtype != grad.dtype:  # state loaded from elsewhere: continue in this state dtype
                    buf = state["momentum_buffer"] = buf.to(grad.dtype)
                buf.mul_(momentum).add_(grad, alpha=1 - group["dampening"])
            buffers.append(buf)
        grads = torch._foreach_add(grads, buffers, alpha=momentum) if group["nesterov"] else buffers
    del fold  # no bias correction to fold
    torch._foreach_add_(target, grads, alpha=-group["lr"])


def round_into(method, params, values, kahan, generator) -> None:
    """Round the fp32 ``values`` (``w + u``) into the weights; ``values`` is used as workspace."""
    if method == "kahan":
        torch._foreach_add_(values, kahan)  # v = w + update + what earlier roundings dropped
        torch._foreach_copy_(params, values)  # new = round-to-nearest(v)
        torch._foreach_sub_(values, params)  # v - new, exact in fp32: new is v's neighbour
        torch._foreach_copy_(kahan, values)
    elif method == "stochastic":
        for weight, value in zip(params, values, strict=True):
            round_stochastic_into(weight, value, generator)
    else:
        torch._foreach_copy_(params, values)
