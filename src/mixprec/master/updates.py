"""Foreach Adam, AdamW and SGD steps that update bf16/fp16 weights in place, compensated or rounded.

:class:`~mixprec.master.compensated.CompensatedOptimizer` runs these for ``torch.optim.Adam``, ``AdamW`` and
``SGD`` (anything else goes through its generic fp32-scratch path). The optimizer object stays torch's: its
``param_groups`` hold the model's own low-precision parameters, its ``state`` the moments under torch's key
names, so LR schedulers, ``state_dict`` and hooks see a plain torch optimizer. Only ``step`` is replaced.

The math is torch's single-tensor algorithm (``torch/optim/adam.py``, ``sgd.py``), per parameter, on whole
lists at once (``torch._foreach_*``). How the update ``u`` reaches a low-precision weight ``w`` depends on the
dtype its optimizer state is kept in (:func:`state_dtype`)::

    fp32 state ("exact"):   t = fp32(w); t <- t + u exactly as torch steps an fp32 copy; then
        kahan:       t += c; w = round(t); c = round(t - w)        # c: bf16/fp16 buffer per weight
        stochastic:  w = round_stochastic(t)                         # 16 random bits per value
        nearest:     w = round(t)
    bf16 state ("low"):     the moments, the update and the Kahan fold in bf16 (torch-optimi's sequence;
                            Adam's second bias correction folded into the scalars):
        kahan:       c = round(c + u); old = w; w = round(w + c); c = round(c + (old - w))
        stochastic:  t = fp32(w) + u; w = round_stochastic(t)
        nearest:     w = round(w + u)

With fp32 state the result is bit for bit what the original scratch-copy wrapper computed (test:
``tests/master/test_master_equivalence.py``). With bf16 state every state operation rounds its result to
bf16 once (``lerp_``, ``mul_``, ``addcmul_``, ``sqrt``, ... each round to nearest), which is the documented
difference: 4 instead of 8 bytes of Adam state per weight, and no fp32 pass over the model.

Sources: Adam (Kingma & Ba 2015) and SGD as torch implements them; Kahan-compensated bf16 updates (Zamirai
et al. 2020, "Revisiting BFloat16 Training"; torchdistx AnyPrecisionAdamW; torch-optimi's ``kahan_sum``).
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec.master.lowp import Workspace, adam_low, adam_states, contiguous, kahan_fold_chunked

__all__ = ["FAST_OPTIMIZERS", "fast_kind", "round_stochastic_into", "state_dtype", "step_group"]

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
_KEEP_HIGH_16_BITS = -65536  # 0xFFFF0000 as int32: clears the low 16 bits of an fp32 pattern


def fast_kind(optimizer: torch.optim.Optimizer) -> str | None:
    """ "adam" or "sgd" when :func:`step_group` can step ``optimizer`` exactly as torch would, else None.

    Only these exact classes qualify (a subclass may change ``step``), with float hyperparameters and
    without amsgrad, differentiable or capturable.
    """
    kind = FAST_OPTIMIZERS.get(type(optimizer))
    if kind is None:
        return None
    for group in optimizer.param_groups:
        if any(group.get(key, False) for key in _UNSUPPORTED[kind]):
            return None
        values = [group.get(key) for key in _SCALAR_KEYS]
        if any(torch.is_tensor(v) or (isinstance(v, tuple) and any(map(torch.is_tensor, v))) for v in values):
            return None
    return kind


def state_dtype(param_dtype: torch.dtype, kind: str, group: dict[str, Any]) -> torch.dtype:
    """The dtype the optimizer state of a ``param_dtype`` weight is kept in, when not forced.

    bf16 for bf16 weights when every moving average of the method moves by more than half a bf16 ulp per
    step (Adam: ``1 - beta1`` and ``1 - beta2`` > 2**-8; SGD: ``1 - momentum`` > 2**-8), else fp32. fp16
    weights always get fp32 state: fp16's range cannot hold squared gradients (1e-4**2 flushes to 0).
    """
    if param_dtype != torch.bfloat16:
        return torch.float32
    if kind == "adam":
        rates = [1 - group["betas"][0], 1 - group["betas"][1]]
    else:
        rates = [1 - group["momentum"]] if group["momentum"] else []
    return torch.bfloat16 if all(rate > BF16_HALF_ULP for rate in rates) else torch.float32


def step_group(
    kind: str,
    group: dict[str, Any],
    states: list[dict[str, Any]],
    params: list[torch.Tensor],
    comps: list[torch.Tensor] | None,
    method: str,
    sdt: torch.dtype,
    generator: torch.Generator | None,
    workspace: Workspace,
) -> None:
    """One optimizer step for ``params`` (one group, device and dtype; each has a ``.grad``).

    Args:
        kind: "adam" or "sgd" (from :func:`fast_kind`).
        group: the torch param group (hyperparameters).
        states: ``optimizer.state[p]`` per param, created here on the first step in torch's layout.
        params: the weights, updated in place; fp32 weights are stepped exactly as torch steps them.
        comps: Kahan buffers (param dtype, same shapes) for method "kahan", else None.
        method: "kahan", "stochastic" or "nearest".
        sdt: dtype of the optimizer state (fp32, or bf16 for bf16 weights).
        generator: draws the stochastic-rounding bits (method "stochastic").
        workspace: reused scratch for the bf16-state paths (:mod:`mixprec.master.lowp`).
    """
    low = params[0].dtype in _LOW
    grads = [p.grad for p in params]
    if (
        low
        and sdt == params[0].dtype
        and method != "nearest"
        and kind == "adam"
        and contiguous(params, grads)
    ):
        adam_low(group, states, params, comps if method == "kahan" else None, generator, workspace)
        return
    exact = low and sdt == torch.float32
    if not low or (not exact and method == "nearest"):
        mode, target = "direct", params  # fp32 weights, or bf16 weights rounded once per step
    elif exact or method == "stochastic":
        mode, target = ("exact" if exact else "stochastic"), [p.float() for p in params]
    else:
        mode, target = "kahan", comps  # bf16 state and weights: the update accumulates in the buffer
    decay_base = target if mode in ("direct", "exact") else params
    grads = [p.grad if p.grad.dtype == sdt else p.grad.to(sdt) for p in params]
    step = _adam if kind == "adam" else _sgd
    temp = step(group, states, grads, target, decay_base, additive=mode == "kahan", fold=sdt in _LOW)
    if mode == "kahan" and contiguous(params, comps):  # type: ignore[arg-type]
        kahan_fold_chunked(params, comps, workspace)  # type: ignore[arg-type]
    elif mode == "kahan":
        _kahan_fold_low(params, comps, temp)  # type: ignore[arg-type]
    elif mode != "direct":
        _finish(method, params, target, comps, generator)


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
    return denom


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
    return None


def _kahan_fold_low(params, comps, temp) -> None:
    """``w, c = round(w + c), c + (w - round(w + c))``, all in the weights' dtype (``temp``: workspace)."""
    if temp is None:
        temp = [torch.empty_like(p) for p in params]
    torch._foreach_copy_(temp, params)
    torch._foreach_add_(params, comps)
    torch._foreach_sub_(temp, params)
    torch._foreach_add_(comps, temp)


def _finish(method, params, values, comps, generator) -> None:
    """Round the fp32 ``values`` (``w + u``) into the weights; ``values`` is used as workspace."""
    if method == "kahan":
        torch._foreach_add_(values, comps)  # v = w + update + what earlier roundings dropped
        torch._foreach_copy_(params, values)  # new = round-to-nearest(v)
        torch._foreach_sub_(values, params)  # v - new, exact in fp32: new is v's neighbour
        torch._foreach_copy_(comps, values)
    elif method == "stochastic":
        for weight, value in zip(params, values, strict=True):
            round_stochastic_into(weight, value, generator)
    else:
        torch._foreach_copy_(params, values)


def round_stochastic_into(weight: torch.Tensor, value: torch.Tensor, generator: torch.Generator) -> None:
    """``weight = value`` rounded to bf16 stochastically; ``value`` (fp32) is used as workspace.

    Adds 16 uniform random bits below bf16's last bit of the fp32 pattern and truncates: the carry into
    bf16's last bit happens with probability (dropped fraction), so the rounding is unbiased.
    """
    bits = value.view(torch.int32)
    noise = torch.randint(0, 2**16, value.shape, dtype=torch.int32, device=value.device, generator=generator)
    bits.add_(noise).bitwise_and_(_KEEP_HIGH_16_BITS)
    weight.copy_(value)  # exact: the low 16 bits are zero
