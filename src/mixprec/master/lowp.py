"""bf16 weights with bf16 state: Adam/AdamW and the Kahan fold, chunk by chunk through a reused workspace.

Temporaries (Adam's denominator, the Kahan fold's old weights, stochastic rounding's fp32 values and random
bits) live in a :class:`Workspace` of at most ``CHUNK`` elements per buffer that survives between steps: the
update allocates nothing per step, and no scratch the size of the model exists. Each chunk is a list of
consecutive slices of the flattened tensors (a big tensor spans chunks, small ones share one), so the
foreach ops see the same values as on whole tensors; only the grouping differs.

Stochastic rounding here draws its 16 bits per value from 64-bit draws (four values per draw, ~3x faster
than one ``randint`` per value); with fp32 state (:mod:`mixprec.master.updates`) it keeps the original
per-value draws, bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["CHUNK", "Workspace", "adam_low", "adam_states", "contiguous", "kahan_fold", "kahan_fold_chunked"]

CHUNK = 2**22  # most elements per workspace buffer (8 MiB in bf16); never more than the tensors stepped
_KEEP_HIGH_16_BITS = -65536


class Workspace:
    """Scratch buffers reused across steps, one per (device, dtype, role), at most ``numel`` elements each."""

    def __init__(self, numel: int = CHUNK) -> None:
        self.numel = numel
        self.buffers: dict[tuple[str, torch.dtype, int], torch.Tensor] = {}

    def get(self, device: torch.device, dtype: torch.dtype, role: int, numel: int) -> torch.Tensor:
        """A buffer of at least ``numel`` elements (grown, never shrunk, while the optimizer lives)."""
        key = (str(device), dtype, role)
        buffer = self.buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = self.buffers[key] = torch.empty(numel, dtype=dtype, device=device)
        return buffer

    def __getstate__(self) -> dict[str, Any]:
        return {"numel": self.numel, "buffers": {}}  # scratch, not state: recreated on demand


def adam_states(states: list[dict[str, Any]], like: list[torch.Tensor]) -> list[float]:
    """Create Adam state as torch does (in the dtype of ``like``), count the step; returns step numbers."""
    for state, grad in zip(states, like, strict=True):
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
        for key in ("exp_avg", "exp_avg_sq"):
            if state[key].dtype != grad.dtype:  # state loaded from elsewhere: continue in this state dtype
                state[key] = state[key].to(grad.dtype)
    counters = [s["step"] for s in states]
    torch._foreach_add_(counters, 1.0)  # torch: step_t += 1 per parameter; one call here
    return torch.stack(counters).tolist() if counters else []


def contiguous(*lists: list[torch.Tensor]) -> bool:
    return all(t.is_contiguous() for tensors in lists for t in tensors)


def chunks(
    lists: list[list[torch.Tensor]], limit: int
) -> Iterator[tuple[list[list[torch.Tensor]], list[int]]]:
    """Slices of the aligned ``lists`` (same numel per index) with at most ``limit`` elements per chunk.

    Yields ``(views per list, owner index per view)``.
    """
    views: list[list[torch.Tensor]] = [[] for _ in lists]
    owners: list[int] = []
    size = 0
    for i in range(len(lists[0])):
        flats = [tensors[i].view(-1) for tensors in lists]
        numel, start = flats[0].numel(), 0
        while start < numel:
            take = min(numel - start, limit - size)
            for out, flat in zip(views, flats, strict=True):
                out.append(flat[start : start + take])
            owners.append(i)
            size, start = size + take, start + take
            if size == limit:
                yield views, owners
                views, owners, size = [[] for _ in lists], [], 0
    if owners:
        yield views, owners


def _slices(buffer: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    out, start = [], 0
    for t in like:
        out.append(buffer[start : start + t.numel()])
        start += t.numel()
    return out


def kahan_fold(params: list[torch.Tensor], comps: list[torch.Tensor], temp: list[torch.Tensor]) -> None:
    """``w, c = round(w + c), c + (w - round(w + c))`` in the weights' dtype; ``temp`` is workspace."""
    torch._foreach_copy_(temp, params)
    torch._foreach_add_(params, comps)
    torch._foreach_sub_(temp, params)
    torch._foreach_add_(comps, temp)


def kahan_fold_chunked(params: list[torch.Tensor], comps: list[torch.Tensor], workspace: Workspace) -> None:
    """:func:`kahan_fold` over whole tensors, through the workspace."""
    size = min(workspace.numel, sum(p.numel() for p in params))
    buffer = workspace.get(params[0].device, params[0].dtype, 0, size)
    for (p, c), _ in chunks([params, comps], size):
        kahan_fold(p, c, _slices(buffer, p))


def _grads(group: dict[str, Any], g: list[torch.Tensor], p: list[torch.Tensor], buffer: Any):
    """Adam's gradients: negated under ``maximize``, plus ``wd * w`` for L2 decay (into ``buffer()``)."""
    maximize, wd = group.get("maximize", False), group["weight_decay"]
    l2 = wd != 0 and not group.get("decoupled_weight_decay", False)
    if not (maximize or l2):
        return g
    out = _slices(buffer(), g)
    torch._foreach_copy_(out, g)
    if maximize:
        torch._foreach_neg_(out)
    if l2:
        torch._foreach_add_(out, p, alpha=wd)
    return out


def adam_low(
    group: dict[str, Any],
    states: list[dict[str, Any]],
    params: list[torch.Tensor],
    comps: list[torch.Tensor] | None,
    generator: torch.Generator | None,
    workspace: Workspace,
) -> None:
    """Adam/AdamW for bf16 weights and bf16 state: Kahan into ``comps``, or stochastic rounding (None)."""
    grads = [p.grad for p in params]
    steps = adam_states(states, grads)
    (beta1, beta2), lr, wd = group["betas"], group["lr"], group["weight_decay"]
    decoupled = wd != 0 and group.get("decoupled_weight_decay", False)
    roots = [(1 - beta2**step) ** 0.5 for step in steps]
    scales = [-lr / (1 - beta1**step) * root for step, root in zip(steps, roots, strict=True)]
    eps = [group["eps"] * root for root in roots]
    lists = [params, grads, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]]
    device, dtype = params[0].device, params[0].dtype
    size = min(workspace.numel, sum(p.numel() for p in params))
    temp_buffer = workspace.get(device, dtype, 0, size)
    for views, owners in chunks([*lists, comps] if comps is not None else lists, size):
        p, g, m, v = views[:4]
        g = _grads(group, g, p, lambda: workspace.get(device, dtype, 1, size))
        torch._foreach_lerp_(m, g, 1 - beta1)
        torch._foreach_mul_(v, beta2)
        torch._foreach_addcmul_(v, g, g, value=1 - beta2)
        denom = _slices(temp_buffer, p)
        for out, second in zip(denom, v, strict=True):
            torch.sqrt(second, out=out)  # one pass instead of copy + sqrt_ (foreach has no out=)
        torch._foreach_add_(denom, [eps[i] for i in owners])
        if comps is not None:
            c = views[4]
            if decoupled:
                torch._foreach_add_(c, p, alpha=-lr * wd)
            torch._foreach_addcdiv_(c, m, denom, [scales[i] for i in owners])
            kahan_fold(p, c, denom)
        else:
            _stochastic(group, p, m, denom, [scales[i] for i in owners], generator, workspace, size)


def _stochastic(group, p, m, denom, scales, generator, workspace, size) -> None:
    """``w = round_stochastic(w * (1 - lr * wd) + scale * m / denom)`` with the update in fp32."""
    total = sum(t.numel() for t in p)
    flat = workspace.get(p[0].device, torch.float32, 2, size)[:total]
    values = _slices(flat, p)
    torch._foreach_copy_(values, p)
    wd = group["weight_decay"]
    if wd != 0 and group.get("decoupled_weight_decay", False):
        torch._foreach_mul_(values, 1 - group["lr"] * wd)
    torch._foreach_addcdiv_(values, m, denom, scales)
    draws = workspace.get(p[0].device, torch.int64, 3, size // 4 + 1)[: (total + 3) // 4]
    draws.random_(-(2**63), 2**63 - 1, generator=generator)
    noise = draws.view(torch.int16)[:total]  # uniform in [-2**15, 2**15)
    bits = flat.view(torch.int32)
    bits.add_(noise).add_(2**15).bitwise_and_(_KEEP_HIGH_16_BITS)  # carry with the dropped fraction
    torch._foreach_copy_(p, values)  # exact: the low 16 bits are zero
