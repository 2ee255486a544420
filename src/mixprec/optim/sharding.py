"""Optimizer wrappers under FSDP2 (``fully_shard``), and their state saved on N ranks, loaded on M.

Under ``fully_shard`` a parameter is a DTensor sharded along dim 0; each rank steps its own shard
(:func:`local_params`, :func:`local_grads`) and keeps plain tensors of the shard's shape as state. With a
``state_format`` the blocks of ``BLOCK`` values are cut per shard, from the shard's first value, so a
shard boundary that is no multiple of ``BLOCK`` of the flattened parameter cuts a block the unsharded
parameter would have whole. Requantizing on load would therefore change the codes (and, since
dequantize/quantize is not idempotent, even loading on the same layout could); instead the state keeps its
grid::

    full_state_dict(optimizer)        # collective: every rank gets the whole state, on the CPU
        codes, moments, Kahan buffers, masters:  the shards concatenated (the parameter's global shape)
        <moment>_scale:                          the shards' scales concatenated, in rank order
        block_origins:                           where each shard's grid began, global offsets
    load_full_state_dict(optimizer, full)       # each rank takes its range
        a shard must start and end on a block boundary of the saved grid (else: refused, nothing changed);
        its state keeps the origins inside it, so its blocks are the saved blocks

The codes and scales are copied, never requantized, so a state saved on 2 ranks continues on 1 rank (a
plain model: one tensor, the grid restarting where rank 1's shard began) or on 2 ranks with the blocks, the
codes and the arithmetic of the uninterrupted run. torch's fused Adam kernel is bitwise the same on a
tensor cut in two where the cut falls on a multiple of its vector width (64 values cover every CPU and GPU
width); FSDP2's shard offsets are a multiple of a row, so a parameter whose rows hold a multiple of 64
values (or whose shard starts fall there) continues bit for bit; elsewhere the kernel's tail lanes round
``exp_avg_sq`` differently in the last bit.

Only 1-D meshes with ``Shard(0)`` placements (FSDP2's default) are supported; others are refused.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mixprec.optim import state_formats as sf

__all__ = [
    "full_state_dict",
    "load_full_state_dict",
    "local",
    "local_grads",
    "local_params",
    "replaced_params",
]


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch build without distributed
        return None
    return DTensor


def is_sharded(tensor: Any) -> bool:
    cls = _dtensor_type()
    return cls is not None and isinstance(tensor, cls)


def local(tensor: Any) -> Any:
    """A DTensor's local shard (the tensor FSDP2 keeps, sharing its storage), or ``tensor`` itself; the
    same object on every call, so it can key optimizer state during a step."""
    return tensor._local_tensor if is_sharded(tensor) else tensor


@contextmanager
def local_grads(params: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    """``params`` as their local shards, each carrying its shard of the gradient for the block."""
    shards = [local(p) for p in params]
    given = [s for p, s in zip(params, shards, strict=True) if s is not p]
    for param, shard in zip(params, shards, strict=True):
        if shard is not param:
            shard.grad = None if param.grad is None else local(param.grad)
    try:
        yield shards
    finally:
        for shard in given:
            shard.grad = None


@contextmanager
def replaced_params(
    optimizer: torch.optim.Optimizer,
    groups: list[list[torch.Tensor]],
    replacement: Mapping[int, torch.Tensor],
) -> Iterator[None]:
    """Inside the block the groups of ``optimizer`` hold ``groups`` (one list per group), and the state of
    each param in ``replacement`` (``id(param) -> stand-in``) is keyed to its stand-in; put back after."""
    originals = [group["params"] for group in optimizer.param_groups]
    held = [p for params in originals for p in params if id(p) in replacement]
    state = optimizer.state
    try:
        for param in held:
            if param in state:
                state[replacement[id(param)]] = state.pop(param)
        for group, params in zip(optimizer.param_groups, groups, strict=True):
            group["params"] = params
        yield
    finally:
        for group, params in zip(optimizer.param_groups, originals, strict=True):
            group["params"] = params
        for param in held:
            if replacement[id(param)] in state:
                state[param] = state.pop(replacement[id(param)])


@contextmanager
def local_params(optimizer: torch.optim.Optimizer) -> Iterator[dict[int, torch.Tensor]]:
    """The groups of ``optimizer`` hold their params' local shards (with gradient shards), their state keyed
    to those, inside the block; put back after. Yields ``id(param) -> shard`` of the DTensors swapped."""
    originals = [group["params"] for group in optimizer.param_groups]
    swapped = {id(p): local(p) for params in originals for p in params if is_sharded(p)}
    if not swapped:
        yield swapped
        return
    held = [p for params in originals for p in params if id(p) in swapped]
    shards = [[swapped.get(id(p), p) for p in params] for params in originals]
    with local_grads(held), replaced_params(optimizer, shards, swapped):
        yield swapped


def agree_finite(params: list[torch.Tensor], fits: bool) -> bool:
    """``fits`` agreed by every rank of the params' mesh (one all-reduce): one rank's inf skips all."""
    sharded = [p for p in params if is_sharded(p)]
    if not sharded:
        return fits
    flag = torch.tensor([0.0 if fits else 1.0], device=local(sharded[0]).device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=_mesh_group(sharded[0]))
    return bool(flag.item() == 0.0)


@dataclass(frozen=True)
class _Shard:
    offset: int  # of the shard's first value in the flattened parameter
    numel: int  # of the whole parameter
    shape: tuple[int, ...]  # of the whole parameter


def _mesh_group(param: Any) -> Any:
    return param.device_mesh.get_group()


def _shard_of(param: Any) -> _Shard | None:
    """Where ``param``'s local shard lies in the whole parameter (None: not a DTensor).

    Raises:
        ValueError: a mesh of more than one dimension, or a placement other than ``Shard(0)``.
    """
    if not is_sharded(param):
        return None
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if param.device_mesh.ndim != 1 or tuple(param.placements) != (Shard(0),):
        raise ValueError(
            f"resharding optimizer state supports FSDP2's 1-D mesh with Shard(0); a parameter of shape "
            f"{tuple(param.shape)} has mesh {param.device_mesh} and placements {param.placements}"
        )
    _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    row = param.numel() // param.shape[0] if param.dim() and param.shape[0] else 0
    return _Shard(offset[0] * row if param.dim() else 0, param.numel(), tuple(param.shape))


def _parts(optimizer: Any) -> tuple[dict[str, Any], list[Any], list[Any], str]:
    """The wrapper's state dict, the param behind each inner state id (the DTensor whose shard it holds),
    the param behind each entry of the per-param list (``compensation`` / ``master_params``) and its key:
    the wrapper's ``shard_parts()`` (:meth:`mixprec.optim.wrapper.OptimizerWrapper.shard_parts`)."""
    shard_parts = getattr(optimizer, "shard_parts", None)
    parts = shard_parts() if callable(shard_parts) else None
    if parts is None:
        raise TypeError(
            "full_state_dict / load_full_state_dict take a CompensatedOptimizer or a MixedPrecisionOptimizer "
            f"around a torch optimizer, got {type(optimizer).__name__}"
        )
    return parts


def _shards(params: list[Any]) -> tuple[list[_Shard | None], Any]:
    shards = [_shard_of(p) for p in params]
    sharded = [p for p in params if is_sharded(p)]
    groups = {id(_mesh_group(p)) for p in sharded}
    if len(groups) > 1:
        raise ValueError(
            f"the optimizer's parameters are sharded over {len(groups)} meshes; one is supported"
        )
    return shards, (_mesh_group(sharded[0]) if sharded else None)


def full_state_dict(optimizer: Any) -> dict[str, Any]:
    """The whole state of a mixprec optimizer whose params may be FSDP2 shards, the same on every rank.

    A collective on the params' mesh (one ``all_gather_object``): call it on every rank. The result holds
    CPU tensors shaped as the whole parameters and loads with :func:`load_full_state_dict` on any number of
    ranks, or with ``load_state_dict`` on one process without FSDP2.
    """
    state_dict, inner, listed, list_key = _parts(optimizer)
    shards, group = _shards(inner)
    list_shards, _ = _shards(listed)
    out = copy.copy(state_dict)
    if group is None:
        return out
    opt_key = "optimizer"
    mine = {
        "state": {i: dict(s) for i, s in state_dict[opt_key]["state"].items() if shards[i] is not None},
        "list": {n: t for n, t in enumerate(state_dict[list_key]) if list_shards[n] is not None},
    }
    for i, state in mine["state"].items():
        if f"{sf.MOMENTS[0]}_scale" in state:
            origins = state.get(sf.ORIGINS)
            base = [0] if origins is None else origins.tolist()
            state[sf.ORIGINS] = torch.tensor([shards[i].offset + o for o in base], dtype=torch.int64)
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, _to_cpu(mine), group=group)
    every = [_from_cpu(rank) for rank in every]
    inner_state = dict(state_dict[opt_key]["state"])
    for i in mine["state"]:
        inner_state[i] = {
            key: _join(key, [rank["state"][i][key] for rank in every], shards[i]) for key in mine["state"][i]
        }
    listed_out = list(state_dict[list_key])
    for n in mine["list"]:
        listed_out[n] = _join("", [rank["list"][n] for rank in every], list_shards[n])
    out[opt_key] = {**state_dict[opt_key], "state": inner_state}
    out[list_key] = listed_out
    return out


def _to_cpu(value: Any) -> Any:
    """Tensors as (dtype, shape, bytes): pickled tensors do not survive ``all_gather_object`` in torch 2.13
    (its unpickler trips over the storages), and raw bytes keep fp8 codes exact."""
    if torch.is_tensor(value):
        flat = value.detach().cpu().contiguous().reshape(-1)
        return (
            str(flat.dtype).removeprefix("torch."),
            tuple(value.shape),
            flat.view(torch.uint8).numpy().tobytes(),
        )
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


def _from_cpu(value: Any) -> Any:
    if isinstance(value, tuple) and len(value) == 3 and isinstance(value[2], bytes):
        dtype, shape, data = value
        raw = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if data
            else torch.empty(0, dtype=torch.uint8)
        )
        return raw.view(getattr(torch, dtype)).reshape(shape).clone()
    if isinstance(value, dict):
        return {k: _from_cpu(v) for k, v in value.items()}
    return value


def _join(key: str, parts: list[torch.Tensor], shard: _Shard) -> torch.Tensor:
    """The ranks' pieces of one state tensor as one: a scalar (``step``) is the same on every rank; scales
    and origins are concatenated; a shard-shaped tensor becomes the whole parameter's."""
    if parts[0].dim() == 0:
        return parts[0]
    if key.endswith("_scale") or key == sf.ORIGINS:
        return torch.cat(parts)
    return torch.cat([p.reshape(-1) for p in parts]).view(shard.shape)


def load_full_state_dict(optimizer: Any, state_dict: dict[str, Any]) -> None:
    """Load what :func:`full_state_dict` returned, on this rank's shards (or on unsharded params).

    Each rank takes its range of every tensor; the block grid is kept (see the module doc).

    Raises:
        ValueError: a state saved with another ``state_format``, a shard boundary inside a saved block,
            or anything ``load_state_dict`` refuses; the optimizer is unchanged then.
    """
    _, inner, listed, list_key = _parts(optimizer)
    if not isinstance(state_dict, dict) or not isinstance(state_dict.get("optimizer"), dict):
        raise TypeError(f"state_dict must be a dict from full_state_dict, got {type(state_dict).__name__}")
    fmt, saved = getattr(optimizer, "state_format", None), state_dict.get("state_format")
    if saved != fmt:
        raise ValueError(
            f"state_dict was saved with state_format={saved!r}, this optimizer uses state_format={fmt!r}; "
            f"build the optimizer with state_format={saved!r} to load it (nothing was changed)"
        )
    shards, group = _shards(inner)
    list_shards, _ = _shards(listed)
    if group is None:  # a copy: the optimizer would otherwise step the caller's tensors in place
        optimizer.load_state_dict(copy.deepcopy(state_dict))
        return
    inner_state = dict(state_dict["optimizer"].get("state", {}))
    for i, state in list(inner_state.items()):
        shard = shards[i] if isinstance(i, int) and 0 <= i < len(shards) else None
        if shard is not None and isinstance(state, dict):
            inner_state[i] = _slice_state(state, local(inner[i]), shard, i)
    listed_in = list(state_dict.get(list_key, []))
    for n, shard in enumerate(list_shards):
        if shard is not None and n < len(listed_in) and torch.is_tensor(listed_in[n]):
            listed_in[n] = _take(listed_in[n], local(listed[n]), shard, f"{list_key}[{n}]")
    mine = {**state_dict, "optimizer": {**state_dict["optimizer"], "state": inner_state}, list_key: listed_in}
    optimizer.load_state_dict(mine)


def _take(full: torch.Tensor, shard_tensor: torch.Tensor, shard: _Shard, what: str) -> torch.Tensor:
    if tuple(full.shape) != shard.shape:
        raise ValueError(f"{what} has shape {tuple(full.shape)}, its parameter {shard.shape}")
    n = shard_tensor.numel()
    return full.reshape(-1)[shard.offset : shard.offset + n].view(shard_tensor.shape).clone()


def _slice_state(state: dict[str, Any], shard_tensor: torch.Tensor, shard: _Shard, i: int) -> dict[str, Any]:
    """This shard's part of one parameter's whole state: its values, its blocks' scales, its origins."""
    start, stop = shard.offset, shard.offset + shard_tensor.numel()
    out: dict[str, Any] = {}
    runs = None
    if any(str(k).endswith("_scale") for k in state):
        origins = sf.check_origins(state.get(sf.ORIGINS, torch.zeros(1, dtype=torch.int64)), shard.numel)
        runs = sf.pieces(shard.numel, origins)
        first, last = _block_at(runs, start, shard, i), _block_at(runs, stop, shard, i)
        inside = [o - start for o in origins if start < o < stop]
        if inside:
            out[sf.ORIGINS] = torch.tensor([0, *inside], dtype=torch.int64)
    for key, value in state.items():
        if key == sf.ORIGINS:
            continue
        if not torch.is_tensor(value) or value.dim() == 0:
            out[key] = value.clone() if torch.is_tensor(value) else value  # ``step`` is stepped in place
        elif str(key).endswith("_scale") and runs is not None:
            out[key] = value[first:last].clone()
        else:
            out[key] = _take(value, shard_tensor, shard, f"optimizer state {i}[{key!r}]")
    return out


def _block_at(runs: list[tuple[int, int, int]], at: int, shard: _Shard, i: int) -> int:
    """The index of the saved block starting at ``at`` (or the block count at the end).

    Raises:
        ValueError: ``at`` falls inside a block: this shard would cut a block the state was saved with.
    """
    for a, b, block in runs:
        if a <= at < b and (at - a) % sf.BLOCK == 0:
            return block + (at - a) // sf.BLOCK
        if at == b == runs[-1][1]:
            return block + -(-(b - a) // sf.BLOCK)
    raise ValueError(
        f"optimizer state {i}: this rank's shard of the parameter of shape {shard.shape} starts or ends at "
        f"value {at}, inside a block of {sf.BLOCK} of the saved state (its grid restarts at "
        f"{[a for a, _, _ in runs]}); the low-bit state cannot be resharded there without requantizing. "
        "Shard so that each shard starts on a saved block boundary (nothing was changed)"
    )
