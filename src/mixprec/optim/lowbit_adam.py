"""Adam/AdamW with low-bit moments, chunk by chunk through torch's fused kernel: :func:`lowbit_adam_step`.

Both optimizer wrappers step with it when ``state_format`` is set (the formats:
``mixprec.optim.state_formats``). Each chunk of at most ``workspace.numel`` values (cut at block
boundaries of each tensor) is dequantized into fp32 workspace buffers, stepped by torch's fused Adam/AdamW
kernel, and requantized; the weight is written as its update method says::

    t = fp32(w) [+ fp32(c)]   or   t = w itself (fp32 weights: fp32 masters, or fp32 params)
    g = fp32(grad);  m, v = dequantize(exp_avg), dequantize(exp_avg_sq)
    torch._fused_adamw_(t, g, m, v, step)          # (_fused_adam_ for Adam): torch's algorithm in fp32
    exp_avg, exp_avg_sq = quantize(m), quantize(v)
    kahan:       w = round(t);  c = round(t - w)
    stochastic:  w = round_stochastic(t)
    nearest:     w = round(t)

So the update uses the moments at full precision within the step (as torchao's low-bit AdamW does), and
only what is carried to the next step is quantized; no fp32 copy of a whole moment, weight or gradient
exists. The caller checks the gradients first (the non-finite guard): a skipped step never reaches here,
so nothing is created or written.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mixprec.optim import state_formats as sf
from mixprec.optim.rounding import Workspace, narrow, segments, widen
from mixprec.optim.sharding import local_grads
from mixprec.optim.updates import fused_adam_, new_states

__all__ = ["check_lowbit_params", "lowbit_adam_step", "step_groups"]

_F32 = torch.float32


def check_lowbit_params(params: list[torch.Tensor]) -> None:
    """Refuse params the chunked pass cannot view flat.

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
    method: str = "nearest",
    kahan_of: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
    generator_of: Callable[[torch.device], torch.Generator | None] | None = None,
) -> None:
    """:func:`lowbit_adam_step` over every group of ``optimizer`` (its params with a gradient), device by
    device; ``kahan_of(param)`` gives a param's Kahan buffer, ``generator_of(device)`` the rounding bits."""
    for group in optimizer.param_groups:
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for param in group["params"]:
            if param.grad is not None:
                by_device.setdefault(param.device, []).append(param)
        for device, params in by_device.items():
            kahan = [kahan_of(p) if kahan_of else None for p in params]
            generator = generator_of(device) if generator_of else None
            states = [optimizer.state[p] for p in params]
            with local_grads(params) as shards:  # FSDP2: each rank steps its own shard
                lowbit_adam_step(group, states, shards, kahan, method, fmt, generator, workspace)


def lowbit_adam_step(
    group: dict[str, Any],
    states: list[dict[str, Any]],
    params: list[torch.Tensor],
    kahan: list[torch.Tensor | None],
    method: str,
    fmt: str,
    generator: torch.Generator | None,
    workspace: Workspace,
) -> None:
    """One Adam/AdamW step of ``params`` (one group and device, each with a ``.grad``).

    Args:
        group: the torch param group (hyperparameters; ``decoupled_weight_decay`` picks AdamW).
        states: ``optimizer.state[p]`` per param, created here on the first step.
        params: contiguous weights, updated in place (fp32 ones directly, low-precision ones by ``method``).
        kahan: the Kahan buffer per param (None for fp32 params and methods without one).
        method: "kahan", "stochastic" or "nearest" (how a low-precision weight is rounded).
        fmt: one of ``state_formats.STATE_FORMATS``.
        generator: draws the stochastic-rounding bits.
        workspace: the fp32 scratch buffers, at most ``workspace.numel`` values each.
    """
    if not params:
        return
    new_states(states, params, lambda param: sf.new_moments(fmt, param))  # one block grid, from the start
    device = params[0].device
    limit = max(sf.BLOCK, min(workspace.numel, sum(p.numel() for p in params)) // sf.BLOCK * sf.BLOCK)
    buffers = {
        role: workspace.get(device, _F32, role, limit) for role in ("values", "grad", "moment", "second")
    }
    runs = [
        (i, a, b, block)
        for i, (param, state) in enumerate(zip(params, states, strict=True))
        for a, b, block in sf.pieces(param.numel(), _origins(state))
    ]
    for cuts in segments([b - a for _, a, b, _ in runs], limit, align=sf.BLOCK):
        pieces = [
            (runs[k][0], runs[k][1] + a, runs[k][1] + b, runs[k][3] + a // sf.BLOCK) for k, a, b in cuts
        ]
        _chunk(group, states, params, kahan, method, fmt, generator, workspace, pieces, buffers)


def _origins(state: dict[str, Any]) -> list[int] | None:
    origins = state.get(sf.ORIGINS)
    return None if origins is None else origins.tolist()


def _chunk(group, states, params, kahan, method, fmt, generator, workspace, segments, buffers) -> None:
    """Dequantize, step and requantize one chunk (``segments``: (param index, start, stop, first block))."""
    work: dict[str, list[torch.Tensor]] = {role: [] for role in buffers}
    at = 0
    for _, a, b, _ in segments:
        for role, buffer in buffers.items():
            work[role].append(buffer[at : at + b - a])
        at += b - a
    targets, lows = [], []
    for n, (i, a, b, block) in enumerate(segments):
        flat = params[i].view(-1)[a:b]
        if params[i].dtype == _F32:
            targets.append(flat)  # stepped in place, exactly as torch steps an fp32 param
        else:
            value = work["values"][n]
            buffer = None if kahan[i] is None else [kahan[i].view(-1)[a:b]]
            widen([value], [flat], buffer, [work["grad"][n]])  # the grad copy goes there after
            targets.append(value)
            lows.append(n)
        work["grad"][n].copy_(params[i].grad.reshape(-1)[a:b])
        for key, role in zip(sf.MOMENTS, ("moment", "second"), strict=True):
            codes, scale = _codes(fmt, states[i], key, a, b, block)
            sf.dequantize_(fmt, key == "exp_avg_sq", codes, scale, work[role][n], workspace.tables)
    steps = [states[i]["step"] for i, _, _, _ in segments]
    fused_adam_(group, targets, work["grad"], work["moment"], work["second"], steps)
    for n, (i, a, b, block) in enumerate(segments):
        for key, role in zip(sf.MOMENTS, ("moment", "second"), strict=True):
            codes, scale = _codes(fmt, states[i], key, a, b, block)
            sf.quantize_(fmt, key == "exp_avg_sq", work[role][n], codes, scale, workspace.tables)
    for n in lows:
        i, a, b, _ = segments[n]
        value = work["values"][n]
        buffer = None if kahan[i] is None else [kahan[i].view(-1)[a:b]]
        bits = generator if method == "stochastic" else None
        narrow([params[i].view(-1)[a:b]], [value], buffer, [work["grad"][n]], value, bits, workspace)


def _codes(fmt: str, state: dict[str, Any], key: str, start: int, stop: int, block: int):
    """The flat codes of ``state[key]`` from ``start`` to ``stop`` (one run of the grid, from its block
    ``block``) and the scales of their blocks."""
    codes = state[key].view(-1)[start:stop]
    if fmt == "bf16":
        return codes, None
    return codes, state[sf.scale_key(key)][block : block + -(-(stop - start) // sf.BLOCK)]
