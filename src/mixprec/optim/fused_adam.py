"""Adam/AdamW on bf16 weights through torch's fused CPU/GPU Adam kernel, chunk by chunk: :func:`adam_step`.

The state a bf16 weight needs to train like fp32 state, in the fewest bytes and passes: the first moment in
bf16, the second moment in bf16 where its average can move (``1 - beta2 > 2**-8``) and in fp32 otherwise
(torch's default beta2 = 0.999: 12 bytes per parameter with the weight, gradient and Kahan buffer). Each
chunk of at most ``CHUNK`` elements is copied into fp32 buffers of a reused :class:`Workspace` (small enough
to stay in cache), stepped there by torch's own fused Adam/AdamW kernel (``torch._fused_adamw_``, the kernel
behind ``torch.optim.AdamW(fused=True)``: one pass for decay, both moments, bias corrections and the update),
and written back rounded::

    t = fp32(w) + fp32(c)                    # kahan: what the weight tracks; stochastic: fp32(w)
    g, m = fp32(grad), fp32(exp_avg)         # exp_avg_sq used in place when fp32, else copied too
    torch._fused_adamw_(t, g, m, v, step)    # (_fused_adam_ for Adam): torch's AdamW on the fp32 copies
    exp_avg = bf16(m)  [exp_avg_sq = bf16(v)]
    kahan:       w = round(t);  c = round(t - w)          # t - w is exact in fp32
    stochastic:  w = round_stochastic(t)                  # rounding.RandomBits

One step from fresh state is therefore bit for bit torch's fused AdamW stepping an fp32 copy of ``w + c``;
later steps differ only by the moments' storage rounding. Seven copies and one kernel replace the dozen
bf16 foreach passes of torch-optimi's Kahan AdamW (measured in ``benchmarks/precision_paths.py``).

The guard (``guard=True``) skips the whole step, before anything is created or written, when a gradient
is inf/nan or so large (L2 norm over ``sqrt(max / 2)`` of v's dtype, about 1.3e19) that a square could
overflow the second moment: either would make ``exp_avg_sq`` inf or nan and freeze the weight for good
(``m / inf = 0`` every later step). Where it reads the gradients:

* folded into the pass when the whole step holds at most ``workspace.fold_numel`` values (``rounding.FOLD``)
  on one device: every gradient is copied into one fp32 workspace buffer first (the copy the kernel needs
  anyway, done for all chunks before the first kernel), the check is one ``torch.dot`` of that hot copy
  with itself (the squared norm of all gradients together: inf or nan exactly when a gradient is, or the
  squares overflow) and one host read, and the chunks then step from those copies;
* above that, one multi-tensor ``_foreach_norm`` of the bf16 gradients first (:func:`grads_fit`, each
  tensor's norm against the limit), a read the size of such a step amortizes.

The folded check bounds the norm of all gradients together, at least each tensor's, so it may skip a step
of finite gradients a little earlier (norms near 1e19); a step it lets through is bit for bit the
unfolded one.

Sources: Adam (Kingma & Ba 2015) and torch's fused kernel; Kahan-compensated bf16 weights (Zamirai et al.
2020, "Revisiting BFloat16 Training"; torch-optimi's ``kahan_sum``); bf16 state that freezes when
``1 - beta`` is below half an ulp (the rule in ``updates.moment_dtypes``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mixprec.optim.guard import grads_of, largest_norms
from mixprec.optim.rounding import KEEP_HIGH_16_BITS, POOL, Workspace, add_fresh_bits, views
from mixprec.optim.updates import step_counters

__all__ = ["AdamUnit", "adam_step", "grads_fit"]

_F32 = torch.float32
ALIGN = 64  # elements: a multiple of every vector width torch's kernels use


@dataclass
class AdamUnit:
    """The params of one group, device and dtype, stepped together: what :func:`adam_step` takes a list of.

    ``kahan`` holds the Kahan buffers (bf16, shaped as the params) or is None for stochastic rounding, whose
    bits ``generator`` draws; ``moment_dtypes`` the dtypes of ``exp_avg`` and ``exp_avg_sq`` (from
    ``updates.moment_dtypes``).
    """

    group: dict[str, Any]
    states: list[dict[str, Any]]
    params: list[torch.Tensor]
    kahan: list[torch.Tensor] | None
    moment_dtypes: tuple[torch.dtype, ...]
    generator: torch.Generator | None = None


def adam_step(units: list[AdamUnit], workspace: Workspace, guard: bool) -> bool:
    """One Adam/AdamW step of every unit (contiguous bf16 params with a bf16 ``exp_avg``, each with a grad).

    Args:
        units: the groups to step.
        workspace: the scratch buffers (its ``numel`` bounds every buffer, ``fold_numel`` the gradient
            copies of a folded step).
        guard: skip the step when a gradient is non-finite or too large (see the module docstring).

    Returns:
        False when the guard skipped the step: weights, Kahan buffers and state unchanged (none created).
    """
    used: dict[tuple[Any, ...], Any] = {}
    folded = guard and _foldable(units, workspace)
    if guard and not (_copied_grads_fit(units, workspace, used) if folded else grads_fit(units)):
        return False
    offset = 0  # where the unit's gradient copies start in the folded step's "grad" buffer
    for unit in units:
        _prepare(unit)
        flat_grads = [] if folded else [g.view(-1) for g in grads_of(unit.params)]
        for chunk in _plan(unit, workspace, used, offset if folded else None):
            if not folded:
                pieces = [flat_grads[i][start:stop] for i, start, stop in chunk.segments]
                torch._foreach_copy_(chunk.work["grad"], pieces)
            _update(unit, chunk, workspace)
        offset += sum(p.numel() for p in unit.params)
    workspace.plans = used  # plans of replaced tensors go, and with them their views
    return True


def _foldable(units: list[AdamUnit], workspace: Workspace) -> bool:
    """Whether the whole step's gradients fit the workspace's fold buffer (one device)."""
    total = sum(p.numel() for unit in units for p in unit.params)
    return total <= workspace.fold_numel and len({unit.params[0].device for unit in units}) == 1


def _copied_grads_fit(units: list[AdamUnit], workspace: Workspace, used: dict[tuple[Any, ...], Any]) -> bool:
    """Copy every gradient into the "grad" buffer (unit after unit, in param order: the layout the folded
    plans read) and check the copy: its squared L2 norm (inf/nan for any inf/nan) at most ``max / 2`` of
    the narrowest second-moment dtype. The buffer's views are kept with the plans (keyed by the shapes)."""
    grads = grads_of(p for unit in units for p in unit.params)
    total = sum(g.numel() for g in grads)
    buffer = workspace.get(units[0].params[0].device, _F32, "grad", total)
    key = ("fold", workspace.generation, *(g.shape for g in grads))
    copies = used[key] = workspace.plans.get(key) or views(buffer, grads)
    torch._foreach_copy_(copies, grads)
    limit = min(torch.finfo(unit.moment_dtypes[1]).max / 2 for unit in units)
    return torch.dot(buffer[:total], buffer[:total]).item() <= limit  # nan compares False


@dataclass
class _Chunk:
    """Flat views of one chunk: ``segments`` (param index, start, stop), the state's views and the
    workspace's (by role), and the step counters of the params the segments belong to."""

    segments: list[tuple[int, int, int]]
    state: list[list[torch.Tensor]]  # params, exp_avg, exp_avg_sq, [kahan]
    work: dict[str, list[torch.Tensor]]
    values: torch.Tensor  # the flat fp32 "values" buffer of this chunk (stochastic rounding's bits)
    steps: list[torch.Tensor]


def _plan(
    unit: AdamUnit, workspace: Workspace, used: dict[tuple[Any, ...], Any], grads_at: int | None
) -> list[_Chunk]:
    """The chunks of ``unit``, built once and reused while its tensors and the workspace stay the same
    (the plan holds views of them, so a tensor it names cannot be freed and its address reused).

    ``grads_at``: None, every chunk's gradient copies reuse the start of the "grad" buffer; else the
    folded step's copies of this unit's gradients start there, chunk after chunk."""
    tensors = [unit.params, [s["exp_avg"] for s in unit.states], [s["exp_avg_sq"] for s in unit.states]]
    tensors += [unit.kahan] if unit.kahan is not None else []
    key = (workspace.generation, grads_at, *((t.data_ptr(), t.numel()) for ts in tensors for t in ts))
    key += tuple(id(s["step"]) for s in unit.states)
    if key in workspace.plans:
        used[key] = workspace.plans[key]
        return used[key]
    total = sum(p.numel() for p in unit.params)
    limit = min(max(workspace.numel, ALIGN), total)
    roles = ["values", "grad", "moment"] + (["kahan"] if unit.kahan is not None else [])
    roles += ["second"] if unit.moment_dtypes[1] != _F32 else []
    buffers = {role: workspace.get(unit.params[0].device, _F32, role, limit) for role in roles}
    if grads_at is not None:
        buffers["grad"] = workspace.get(unit.params[0].device, _F32, "grad", grads_at + total)[grads_at:]
    key = (workspace.generation, *key[1:])  # a buffer that grew starts a new generation
    plan, done = [], 0
    for segments in _segments([p.numel() for p in unit.params], limit):
        size = sum(stop - start for _, start, stop in segments)
        flat = [[ts[i].view(-1)[a:b] for i, a, b in segments] for ts in tensors]
        work = {role: _consecutive(buffer, segments) for role, buffer in buffers.items()}
        if grads_at is not None:
            work["grad"] = _consecutive(buffers["grad"][done:], segments)
        steps = [unit.states[i]["step"] for i, _, _ in segments]
        plan.append(_Chunk(segments, flat, work, buffers["values"][:size], steps))
        done += size
    used[key] = plan
    return plan


def _segments(sizes: list[int], limit: int, align: int = ALIGN) -> list[list[tuple[int, int, int]]]:
    """``(index, start, stop)`` pieces of tensors of ``sizes``, grouped into chunks of at most ``limit``.

    A tensor is cut only ``align`` elements from its start: the kernel's vector lanes then see every element
    where they see it in the whole tensor, and the result is bit for bit the unchunked one (low-bit states
    cut at their block boundaries, a multiple of ``ALIGN``).
    """
    out: list[list[tuple[int, int, int]]] = [[]]
    room = limit
    for i, numel in enumerate(sizes):
        start = 0
        while start < numel:
            take = min(numel - start, room)
            if take < numel - start:
                take -= take % align
            if take:
                out[-1].append((i, start, start + take))
                start, room = start + take, room - take
            if room == 0 or (room < align and start < numel):
                out.append([])
                room = limit
    return [chunk for chunk in out if chunk]


def _consecutive(buffer: torch.Tensor, segments: list[tuple[int, int, int]]) -> list[torch.Tensor]:
    out, start = [], 0
    for _, a, b in segments:
        out.append(buffer[start : start + b - a])
        start += b - a
    return out


def grads_fit(units: list[AdamUnit]) -> bool:
    """Whether every gradient is finite and small enough that its square fits the second moment's dtype:
    each group's largest L2 norm (:func:`~mixprec.optim.guard.largest_norms`, one host sync) at most
    ``sqrt(max / 2)`` of the narrowest second-moment dtype."""
    limit = min((torch.finfo(unit.moment_dtypes[1]).max / 2) ** 0.5 for unit in units)
    norms = largest_norms(grads_of(param for unit in units for param in unit.params))
    return all(norm <= limit for norm in norms.values())  # nan compares False


def _prepare(unit: AdamUnit) -> None:
    """Create missing state in torch's layout (``step``, ``exp_avg``, ``exp_avg_sq``) and count the step;
    the counters on the params' device, where the fused kernel reads them (``updates.step_counters``)."""
    for state, param in zip(unit.states, unit.params, strict=True):
        if not state:
            state["step"] = torch.zeros((), dtype=_F32, device=param.device)
            for key, dtype in zip(("exp_avg", "exp_avg_sq"), unit.moment_dtypes, strict=True):
                state[key] = torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format)
        for key, dtype in zip(("exp_avg", "exp_avg_sq"), unit.moment_dtypes, strict=True):
            if state[key].dtype != dtype:  # state loaded from elsewhere: continue in this state dtype
                state[key] = state[key].to(dtype)
    step_counters(unit.states, unit.params[0].device)  # torch: step_t += 1 first


def _update(unit: AdamUnit, chunk: _Chunk, workspace: Workspace) -> None:
    """The step for one chunk of one unit whose gradients are already copied into ``chunk.work["grad"]``,
    through fp32 workspace copies and torch's fused kernel."""
    group, work = unit.group, chunk.work
    p, m, v = chunk.state[:3]
    t, g32, m32 = work["values"], work["grad"], work["moment"]
    torch._foreach_copy_(t, p)
    if unit.kahan is not None:
        torch._foreach_copy_(work["kahan"], chunk.state[3])
        torch._foreach_add_(t, work["kahan"])
    torch._foreach_copy_(m32, m)
    v32 = work.get("second", v)
    if v32 is not v:
        torch._foreach_copy_(v32, v)
    kernel = torch._fused_adamw_ if group.get("decoupled_weight_decay", False) else torch._fused_adam_
    (beta1, beta2), options = group["betas"], {"maximize": group.get("maximize", False)}
    kernel(t, g32, m32, v32, [], chunk.steps, lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
           weight_decay=group["weight_decay"], amsgrad=False, **options)  # fmt: skip
    torch._foreach_copy_(m, m32)
    if v32 is not v:
        torch._foreach_copy_(v, v32)
    if unit.kahan is not None:
        torch._foreach_copy_(p, t)  # w = round(t)
        torch._foreach_copy_(work["kahan"], p)
        torch._foreach_sub_(t, work["kahan"])  # t - w, exact in fp32: w is t's neighbour
        torch._foreach_copy_(chunk.state[3], t)
    else:
        _round_stochastic(p, t, chunk.values, unit.generator, workspace)


def _round_stochastic(p, values, flat, generator, workspace) -> None:
    """``p = round_stochastic(values)``; ``flat`` is the fp32 buffer the ``values`` views cover."""
    bits = flat.view(torch.int32)
    if flat.numel() < POOL // 4:  # small chunks: fresh bits cost little, and no pool is made
        add_fresh_bits(
            bits, generator, workspace.get(p[0].device, torch.int64, "bits", (flat.numel() + 3) // 4)
        )
    else:
        workspace.random_bits(p[0].device).add_(bits, generator)
    bits.bitwise_and_(KEEP_HIGH_16_BITS)  # carry into bf16's last bit with the dropped fraction
    torch._foreach_copy_(p, values)  # exact: the low 16 bits are zero
