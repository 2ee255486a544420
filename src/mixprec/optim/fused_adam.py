"""The one Adam/AdamW step engine: torch's fused CPU/GPU Adam kernel on fp32 copies of chunks.

Every fused Adam step of both wrappers goes through :func:`adam_step`: ``CompensatedOptimizer``'s bf16
Adam/AdamW (Kahan or stochastic rounding, moments in torch's layout) and, with ``state_format=``, both
wrappers' low-bit moments (:func:`step_groups`). How the moments are stored is data the engine reads, a
``state_formats.TorchMoments`` or ``CodedMoments`` (where a tensor may be cut, whether chunk views are
kept, which moment is stepped in place, how a chunk's moments are decoded into fp32 and encoded back);
the loop is the same. Each chunk of at most ``workspace.numel_on(device)`` values (a big tensor spans
chunks, small ones share one) is copied into fp32 buffers of a reused :class:`Workspace` (on a CPU small
enough to stay in cache, on a CUDA device big enough that its kernels outlast their launches: see
``mixprec.optim.rounding``), stepped there by torch's own fused Adam/AdamW kernel
(``torch._fused_adamw_``, the kernel behind ``torch.optim.AdamW(fused=True)``: one pass for decay, both
moments, bias corrections and the update), and written back::

    t = fp32(w) + fp32(c)                    # kahan: what the weight tracks; else fp32(w); fp32 w: w itself
    g = fp32(grad);  m, v = decode(exp_avg), decode(exp_avg_sq)   # an fp32 moment of torch's layout: itself
    torch._fused_adamw_(t, g, m, v, step)    # (_fused_adam_ for Adam): torch's AdamW on the fp32 copies
    exp_avg, exp_avg_sq = encode(m), encode(v)                    # bf16(m), or the block codes
    kahan:       w = round(t);  c = round(t - w)          # t - w is exact in fp32
    stochastic:  w = round_stochastic(t)                  # bits drawn per chunk (rounding.round_stochastic)
    nearest:     w = round(t)

In torch's layout (the first moment in bf16, the second in bf16 where its average can move,
``1 - beta2 > 2**-8``, and in fp32 otherwise) one step from fresh state is bit for bit torch's fused AdamW
stepping an fp32 copy of ``w + c``; later steps differ only by the moments' storage rounding. Seven copies
and one kernel per chunk do what a dozen bf16 foreach passes do unfused, each pass reading the whole state.
With a low-bit format the update uses the moments at full precision within the step (as torchao's low-bit
AdamW does) and only what is carried to the next step is quantized; no fp32 copy of a whole moment, weight
or gradient exists.

On CUDA (eager, Triton importable, bf16 or fp32 params, ``MIXPREC_FUSED_OPTIM`` not ``0``) a unit in torch's
layout or a state format skips the chunks: :mod:`mixprec.optim._triton_adam` steps each tensor in one Triton
pass (decoding and encoding block-coded moments in it), bit for bit this engine with torch's CUDA fused
kernel, rounded as above; the gradients are then checked unfolded.

The guard (``guard=True``) skips the whole step, before anything is created or written, when a gradient
is inf/nan or so large (L2 norm over ``sqrt(max / 2)`` of v's dtype, about 1.3e19) that a square could
overflow the second moment: either would make ``exp_avg_sq`` inf or nan and freeze the weight for good
(``m / inf = 0`` every later step). Where it reads the gradients:

* folded into the pass when the whole step holds at most ``workspace.fold_numel_on(device)`` values
  (``rounding.FOLD`` on a CPU, ``rounding.CUDA_FOLD`` on a CUDA device) on one device: every gradient
  is copied into one fp32 workspace buffer first (the copy the kernel needs anyway, done for all chunks
  before the first kernel), the check is one ``torch.dot`` of that hot copy with itself (the squared norm
  of all gradients together: inf or nan exactly when a gradient is, or the squares overflow) and one host
  read, and the chunks then step from those copies;
* above that, one multi-tensor ``_foreach_norm`` of the bf16 gradients first
  (:func:`~mixprec.optim.guard.grads_fit`, each tensor's norm against the limit), a read the size of such
  a step amortizes.

The folded check bounds the norm of all gradients together, at least each tensor's, so it may skip a step
of finite gradients a little earlier (norms near 1e19); a step it lets through is bit for bit the
unfolded one. The low-bit steps (:func:`step_groups`) are checked by their callers first.

Sources: Adam (Kingma & Ba 2015) and torch's fused kernel; Kahan-compensated bf16 weights (Zamirai et al.
2020, "Revisiting BFloat16 Training"; torch-optimi's ``kahan_sum``); bf16 state that freezes when
``1 - beta`` is below half an ulp (the rule in ``updates.moment_dtypes``); low-bit moments as torchao's
AdamW8bit/AdamWFp8 (``mixprec.optim.state_formats``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch

from mixprec.optim import _triton_adam
from mixprec.optim.guard import grads_fit, grads_of
from mixprec.optim.rounding import Workspace, narrow, segments, views, widen
from mixprec.optim.sharding import local_grads
from mixprec.optim.state_formats import MOMENTS, CodedMoments, TorchMoments
from mixprec.optim.updates import fused_adam_, new_states

__all__ = ["AdamUnit", "adam_step", "check_lowbit_params", "step_groups"]

_F32 = torch.float32


@dataclass
class AdamUnit:
    """The params of one group and device, stepped together: what :func:`adam_step` takes a list of.

    ``params`` are contiguous; fp32 ones are stepped in place (exactly as torch steps an fp32 param), the
    others through fp32 copies and written back by Kahan (``kahan``: a buffer per low-precision param, shaped
    as it, None for fp32 ones), stochastic (``generator`` draws the bits) or nearest rounding (neither).
    ``moments`` says how ``exp_avg`` and ``exp_avg_sq`` are stored (``state_formats.TorchMoments`` or
    ``CodedMoments``).
    """

    group: dict[str, Any]
    states: list[dict[str, Any]]
    params: list[torch.Tensor]
    kahan: Sequence[torch.Tensor | None] | None
    moments: TorchMoments | CodedMoments
    generator: torch.Generator | None = None


def check_lowbit_params(params: list[torch.Tensor]) -> None:
    """Refuse params the chunked pass cannot view flat (the low-bit states' check at construction).

    Raises:
        ValueError: a parameter is not contiguous.
    """
    for param in params:
        if not param.is_contiguous():
            raise ValueError(
                f"state_format needs contiguous parameters; one of shape {tuple(param.shape)} and strides "
                f"{param.stride()} is not (call .contiguous() on it before building the optimizer)"
            )


def step_groups(
    optimizer: torch.optim.Optimizer,
    fmt: str,
    workspace: Workspace,
    kahan_of: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
    generator_of: Callable[[torch.device], torch.Generator | None] | None = None,
) -> None:
    """One Adam/AdamW step of every group of ``optimizer`` (its params with a gradient) with moments in the
    state format ``fmt``: one :class:`AdamUnit` per group and device, FSDP2 params as their local shards.

    ``kahan_of(param)`` gives a param's Kahan buffer, ``generator_of(device)`` the stochastic-rounding bits
    (None for nearest rounding); the caller has checked the gradients (nothing here skips).
    """
    moments = CodedMoments(fmt)
    units = []
    with ExitStack() as stack:
        for group in optimizer.param_groups:
            by_device: dict[torch.device, list[torch.Tensor]] = {}
            for param in group["params"]:
                if param.grad is not None:
                    by_device.setdefault(param.device, []).append(param)
            for device, params in by_device.items():
                buffers = [kahan_of(p) for p in params] if kahan_of else []
                kahan = buffers if any(c is not None for c in buffers) else None  # stochastic, nearest: none
                generator = generator_of(device) if generator_of else None
                states = [optimizer.state[p] for p in params]
                shards = stack.enter_context(local_grads(params))  # FSDP2: each rank steps its own shard
                units.append(AdamUnit(group, states, shards, kahan, moments, generator))
        adam_step(units, workspace, guard=False)


def adam_step(units: list[AdamUnit], workspace: Workspace, guard: bool) -> bool:
    """One Adam/AdamW step of every unit (contiguous params, each with a grad).

    Args:
        units: the groups to step.
        workspace: the scratch buffers (its ``numel_on(device)`` bounds every buffer, ``fold_numel_on``
            the gradient copies of a folded step).
        guard: skip the step when a gradient is non-finite or too large (see the module docstring).

    Returns:
        False when the guard skipped the step: weights, Kahan buffers and state unchanged (none created).
    """
    used: dict[tuple[Any, ...], Any] = {}
    one_pass = [_triton_adam.takes(unit) for unit in units]  # CUDA bf16 in torch's layout: one kernel each
    folded = guard and not any(one_pass) and _foldable(units, workspace)
    if guard and not (
        _copied_grads_fit(units, workspace, used)
        if folded
        else grads_fit([param for unit in units for param in unit.params], _narrowest_second_moment(units))
    ):
        return False
    offset = 0  # where the unit's gradient copies start in the folded step's "grad" buffer
    for unit, fast in zip(units, one_pass, strict=True):
        unit.moments.keep(unit.states)
        new_states(unit.states, unit.params, unit.moments.new)  # torch's layout: step, then the moments
        if fast:
            _triton_adam.step_unit(unit, workspace.tables)
            continue
        flat_grads = [] if folded else [g.reshape(-1) for g in grads_of(unit.params)]
        for chunk in _plan(unit, workspace, used, offset if folded else None):
            if not folded:
                pieces = [flat_grads[i][start:stop] for i, start, stop in chunk.segments]
                torch._foreach_copy_(chunk.grads, pieces)
            _update(unit, chunk, workspace)
        offset += sum(p.numel() for p in unit.params)
    workspace.plans = used  # plans of replaced tensors go, and with them their views
    return True


def _foldable(units: list[AdamUnit], workspace: Workspace) -> bool:
    """Whether the whole step's gradients fit the workspace's fold buffer (one device)."""
    total = sum(p.numel() for unit in units for p in unit.params)
    devices = {unit.params[0].device for unit in units}
    return len(devices) == 1 and total <= workspace.fold_numel_on(devices.pop())


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


def _narrowest_second_moment(units: list[AdamUnit]) -> torch.dtype:
    return min((unit.moments.second_dtype for unit in units), key=lambda dtype: torch.finfo(dtype).max)


@dataclass
class _Moment:
    """One moment's views over a chunk: its stored codes and their block scales (None without), and the
    fp32 values the kernel steps (workspace copies, or the codes themselves where stepped in place)."""

    codes: list[torch.Tensor]
    scales: list[Any]
    values: list[torch.Tensor]


@dataclass
class _Chunk:
    """Flat views of one chunk: ``segments`` (param index, start, stop); what the kernel steps
    (``targets``: fp32 param slices themselves, the fp32 copies of the others), the low-precision slices
    (``low``), their fp32 copies (``values``), Kahan buffers and fp32 scratch for their copies; the gradient
    copies, both moments, the flat "values" buffer the chunk covers (stochastic rounding's bits) and the
    step counters of the params the segments belong to."""

    segments: list[tuple[int, int, int]]
    targets: list[torch.Tensor]
    low: list[torch.Tensor]
    values: list[torch.Tensor]
    kahan: list[torch.Tensor] | None
    scratch: list[torch.Tensor]
    grads: list[torch.Tensor]
    moments: list[_Moment]
    flat: torch.Tensor | None
    steps: list[torch.Tensor]


def _plan(
    unit: AdamUnit, workspace: Workspace, used: dict[tuple[Any, ...], Any], grads_at: int | None
) -> list[_Chunk]:
    """The chunks of ``unit``; where its format says so, built once and reused while its tensors and the
    workspace stay the same (the plan holds views of them, so a tensor it names cannot be freed and its
    address reused).

    ``grads_at``: None, every chunk's gradient copies reuse the start of the "grad" buffer; else the
    folded step's copies of this unit's gradients start there, chunk after chunk."""
    fmt = unit.moments
    key: tuple[Any, ...] = ()
    if fmt.cached:
        tensors = [unit.params, *([s[k] for s in unit.states] for k in MOMENTS)]
        tensors += [[c for c in unit.kahan if c is not None]] if unit.kahan is not None else []
        key = (workspace.generation, grads_at, *((t.data_ptr(), t.numel()) for ts in tensors for t in ts))
        key += tuple(id(s["step"]) for s in unit.states)
        if key in workspace.plans:
            used[key] = workspace.plans[key]
            return used[key]
    device = unit.params[0].device
    total = sum(p.numel() for p in unit.params)
    limit = min(max(workspace.numel_on(device), fmt.align), total)
    lows = [p.dtype != _F32 for p in unit.params]
    roles = (["values"] if any(lows) else []) + ["grad"]
    roles += [role for role, second in (("moment", False), ("second", True)) if not fmt.in_place(second)]
    roles += ["kahan"] if unit.kahan is not None else []
    buffers = {role: workspace.get(device, _F32, role, limit) for role in roles}
    if grads_at is not None:
        buffers["grad"] = workspace.get(device, _F32, "grad", grads_at + total)[grads_at:]
    runs = [
        (i, a, b, block)
        for i, (param, state) in enumerate(zip(unit.params, unit.states, strict=True))
        for a, b, block in fmt.runs(param.numel(), state)
    ]
    plan, done = [], 0
    for cut in segments([b - a for _, a, b, _ in runs], limit, align=fmt.align):
        # (param, start, stop, first block): a coded grid's blocks are ``align`` long, cut at their edges
        pieces = [
            (runs[k][0], runs[k][1] + a, runs[k][1] + b, runs[k][3] + a // fmt.align) for k, a, b in cut
        ]
        plan.append(_chunk(unit, pieces, buffers, lows, done if grads_at is not None else None))
        done += sum(b - a for _, a, b, _ in pieces)
    if fmt.cached:
        key = (workspace.generation, *key[1:])  # a buffer that grew starts a new generation
        used[key] = plan
    return plan


def _chunk(
    unit: AdamUnit,
    pieces: list[tuple[int, int, int, int]],
    buffers: dict[str, torch.Tensor],
    lows: list[bool],
    grads_at: int | None,
) -> _Chunk:
    """The views of one chunk of ``pieces`` (param index, start, stop, first block)."""
    size = sum(b - a for _, a, b, _ in pieces)
    work = {role: _consecutive(buffer, pieces) for role, buffer in buffers.items()}
    if grads_at is not None:
        work["grad"] = _consecutive(buffers["grad"][grads_at:], pieces)
    flat = [unit.params[i].view(-1)[a:b] for i, a, b, _ in pieces]
    low = [n for n, (i, _, _, _) in enumerate(pieces) if lows[i]]
    targets = [work["values"][n] if lows[i] else flat[n] for n, (i, _, _, _) in enumerate(pieces)]
    kahan = None
    if unit.kahan is not None:
        kahan = [_flat(unit.kahan[pieces[n][0]])[pieces[n][1] : pieces[n][2]] for n in low]
    moments = []
    for key, role, second in zip(MOMENTS, ("moment", "second"), (False, True), strict=True):
        views_ = [unit.moments.view(unit.states[i], key, a, b, block) for i, a, b, block in pieces]
        codes, scales = [c for c, _ in views_], [s for _, s in views_]
        moments.append(_Moment(codes, scales, codes if unit.moments.in_place(second) else work[role]))
    return _Chunk(
        segments=[(i, a, b) for i, a, b, _ in pieces],
        targets=targets,
        low=[flat[n] for n in low],
        values=[work["values"][n] for n in low],
        kahan=kahan,
        scratch=[work["kahan"][n] for n in low] if kahan is not None else [],
        grads=work["grad"],
        moments=moments,
        flat=buffers["values"][:size] if low else None,
        steps=[unit.states[i]["step"] for i, _, _, _ in pieces],
    )


def _flat(kahan: torch.Tensor | None) -> torch.Tensor:
    if kahan is None:
        raise ValueError("a low-precision parameter stepped with Kahan buffers has none")
    return kahan.view(-1)


def _consecutive(buffer: torch.Tensor, pieces: list[tuple[int, int, int, int]]) -> list[torch.Tensor]:
    out, start = [], 0
    for _, a, b, _ in pieces:
        out.append(buffer[start : start + b - a])
        start += b - a
    return out


def _update(unit: AdamUnit, chunk: _Chunk, workspace: Workspace) -> None:
    """The step for one chunk of one unit whose gradients are already copied into ``chunk.grads``."""
    fmt, (m, v) = unit.moments, chunk.moments
    if chunk.low:
        widen(chunk.values, chunk.low, chunk.kahan, chunk.scratch)
    for second, moment in enumerate(chunk.moments):
        if moment.values is not moment.codes:
            fmt.decode(bool(second), moment.codes, moment.scales, moment.values, workspace.tables)
    fused_adam_(unit.group, chunk.targets, chunk.grads, m.values, v.values, chunk.steps)
    for second, moment in enumerate(chunk.moments):
        if moment.values is not moment.codes:
            fmt.encode(bool(second), moment.values, moment.codes, moment.scales, workspace.tables)
    if chunk.low:
        assert chunk.flat is not None
        narrow(chunk.low, chunk.values, chunk.kahan, chunk.scratch, chunk.flat, unit.generator, workspace)
