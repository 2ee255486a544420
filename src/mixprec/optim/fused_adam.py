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
later steps differ only by the moments' storage rounding. Seven copies and one kernel per chunk do what a
dozen bf16 foreach passes do unfused, each pass reading the whole state.

The guard (``guard=True``) skips the whole step, before anything is created or written, when a gradient
is inf/nan or so large (L2 norm over ``sqrt(max / 2)`` of v's dtype, about 1.3e19) that a square could
overflow the second moment: either would make ``exp_avg_sq`` inf or nan and freeze the weight for good
(``m / inf = 0`` every later step). Where it reads the gradients:

* folded into the pass when the whole step holds at most ``workspace.fold_numel`` values (``rounding.FOLD``)
  on one device: every gradient is copied into one fp32 workspace buffer first (the copy the kernel needs
  anyway, done for all chunks before the first kernel), the check is one ``torch.dot`` of that hot copy
  with itself (the squared norm of all gradients together: inf or nan exactly when a gradient is, or the
  squares overflow) and one host read, and the chunks then step from those copies;
* above that, one multi-tensor ``_foreach_norm`` of the bf16 gradients first
  (:func:`~mixprec.optim.guard.grads_fit`, each tensor's norm against the limit), a read the size of such
  a step amortizes.

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

from mixprec.optim.guard import grads_fit, grads_of
from mixprec.optim.rounding import ALIGN, Workspace, narrow, segments, views, widen
from mixprec.optim.updates import fused_adam_, keep_moment_dtypes, new_states

__all__ = ["AdamUnit", "adam_step"]

_F32 = torch.float32


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
    if guard and not (
        _copied_grads_fit(units, workspace, used)
        if folded
        else grads_fit([param for unit in units for param in unit.params], _narrowest_second_moment(units))
    ):
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
    limit = torch.finfo(_narrowest_second_moment(units)).max / 2
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
    for cut in segments([p.numel() for p in unit.params], limit):
        size = sum(stop - start for _, start, stop in cut)
        flat = [[ts[i].view(-1)[a:b] for i, a, b in cut] for ts in tensors]
        work = {role: _consecutive(buffer, cut) for role, buffer in buffers.items()}
        if grads_at is not None:
            work["grad"] = _consecutive(buffers["grad"][done:], cut)
        steps = [unit.states[i]["step"] for i, _, _ in cut]
        plan.append(_Chunk(cut, flat, work, buffers["values"][:size], steps))
        done += size
    used[key] = plan
    return plan


def _consecutive(buffer: torch.Tensor, segments: list[tuple[int, int, int]]) -> list[torch.Tensor]:
    out, start = [], 0
    for _, a, b in segments:
        out.append(buffer[start : start + b - a])
        start += b - a
    return out


def _narrowest_second_moment(units: list[AdamUnit]) -> torch.dtype:
    return min((unit.moment_dtypes[1] for unit in units), key=lambda dtype: torch.finfo(dtype).max)


def _prepare(unit: AdamUnit) -> None:
    """Create missing state in torch's layout (``step``, ``exp_avg``, ``exp_avg_sq`` in the unit's moment
    dtypes) and count the step (:func:`~mixprec.optim.updates.new_states`)."""
    keep_moment_dtypes(unit.states, unit.moment_dtypes)
    new_states(unit.states, unit.params, lambda param: _zero_moments(param, unit.moment_dtypes))


def _zero_moments(param: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> dict[str, torch.Tensor]:
    return {
        key: torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format)
        for key, dtype in zip(("exp_avg", "exp_avg_sq"), dtypes, strict=True)
    }


def _update(unit: AdamUnit, chunk: _Chunk, workspace: Workspace) -> None:
    """The step for one chunk of one unit whose gradients are already copied into ``chunk.work["grad"]``,
    through fp32 workspace copies and torch's fused kernel."""
    group, work = unit.group, chunk.work
    p, m, v = chunk.state[:3]
    t, g32, m32 = work["values"], work["grad"], work["moment"]
    kahan = chunk.state[3] if unit.kahan is not None else None
    widen(t, p, kahan, work.get("kahan", []))
    torch._foreach_copy_(m32, m)
    v32 = work.get("second", v)
    if v32 is not v:
        torch._foreach_copy_(v32, v)
    fused_adam_(group, t, g32, m32, v32, chunk.steps)
    torch._foreach_copy_(m, m32)
    if v32 is not v:
        torch._foreach_copy_(v, v32)
    narrow(p, t, kahan, work.get("kahan", []), chunk.values, unit.generator, workspace)
