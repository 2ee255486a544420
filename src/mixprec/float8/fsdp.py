"""FSDP2 all-gathers fp8 weights (torchao's ``enable_fsdp_float8_all_gather``), tensorwise dynamic recipe.

With ``Float8Config(enable_fsdp_float8_all_gather=True)`` a :class:`~mixprec.float8.Float8Linear`'s weight
is a :class:`Float8AllGatherWeight`: the high-precision weight behind FSDP2's all-gather extension hooks
(``torch.distributed.fsdp.fully_shard``, ``_fsdp_param.py``)::

    fsdp_pre_all_gather (each rank, its shard w_r of the weight W):
        amax  = all_reduce(max|w_r|, MAX)          # = max|W|; or the precomputed one, see below
        scale = e4m3.max / max(amax, EPS) / 2**margin   (rounded down to a power of 2 if configured)
        send  saturate(w_r * scale) as e4m3, viewed as uint8   # 1 byte per element on the wire
              (zero rows appended to an uneven shard: FSDP2 wants every rank's padded size, dim 0)
    fsdp_post_all_gather (each rank):
        the gathered bytes, viewed as e4m3, and the scale make a Float8GatheredWeight (N, K),
        which Float8LinearFunction uses as the weight's fp8 cast instead of casting again

Every element is cast exactly as the unsharded module casts ``W`` (the max of the shards' amaxes is
``W``'s amax, and the cast is elementwise), so the forward, the gradients and the updates are the
unsharded run's. The gathered weight presents itself with FSDP's ``param_dtype``, so the weight gradient
comes back in that dtype as for any FSDP parameter.

The bytes travel as uint8 so that any backend carries them (gloo has no float8 dtypes; NCCL's uint8 is
the same transfer). :func:`precompute_float8_dynamic_scale_for_fsdp` after each optimizer step computes
every weight's scale with one all-reduce instead of one per weight per all-gather. A precomputed scale
is used only while the weight is unchanged (the sharded parameter's version counter): after an update it
is stale, and the all-gather falls back to its own all-reduce rather than cast with the old scale. That
choice is made on each rank and must agree across ranks, else one rank all-reduces while another
all-gathers and both wait forever; it does under SPMD training (every rank steps the same parameters,
and the scale follows the shard through FSDP2's re-padding, which happens on uneven ranks only).
"""

from __future__ import annotations

import math
import weakref
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

from mixprec import formats
from mixprec.float8.config import Float8Config
from mixprec.lowbit.history import amax_of, amax_to_scale, to_float8

__all__ = [
    "Float8AllGatherWeight",
    "Float8GatheredWeight",
    "precompute_float8_dynamic_scale_for_fsdp",
    "weight_scale",
]

E4M3 = formats.FP8_E4M3FN

# FSDP2 pads, slices, views, copies and moves the sharded weight; these keep it a Float8AllGatherWeight
# so the hooks stay on the local shard (the list torchao keeps for its weight subclass, and detach, which
# nn.Parameter needs).
_KEEP_SHARD_SUBCLASS = {
    torch.ops.aten.detach.default,
    torch.ops.aten.empty_like.default,
    torch.ops.aten.new_zeros.default,
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.copy_.default,
    torch.ops.aten.view.default,
    torch.ops.aten.as_strided.default,
    torch.ops.aten._to_copy.default,
    torch.ops.aten._pin_memory.default,
    torch.ops.aten.split.Tensor,
    torch.ops.aten.clone.default,
}
# Views of a gathered weight that stay fp8 (one scale for the whole tensor, so any view of the data is
# valid); every other op sees the dequantized weight.
_KEEP_GATHERED_SUBCLASS = {
    torch.ops.aten.detach.default,
    torch.ops.aten.alias.default,
    torch.ops.aten.view.default,
    torch.ops.aten.as_strided.default,
    torch.ops.aten.t.default,
}


def weight_scale(amax: torch.Tensor, config: Float8Config) -> torch.Tensor:
    """The e4m3 scale of a weight whose ``max|W|`` is ``amax`` (float32 scalar), as Float8Linear's forward
    computes it: ``448 / max(amax, EPS) / 2**margin``, rounded down to a power of two if configured."""
    scale = amax_to_scale(amax, E4M3, config.margin)
    if config.round_scales_to_power_of_2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale


class Float8AllGatherWeight(torch.Tensor):
    """A high-precision weight (or FSDP2's shard of it) that FSDP2 all-gathers in e4m3.

    It behaves as the wrapped tensor for every op (``_tensor``: the weight, any float dtype and shape);
    FSDP2's hooks ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` are what differ (see the module doc).
    Made by :class:`~mixprec.float8.Float8Linear` when its config has ``enable_fsdp_float8_all_gather``.
    """

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, config: Float8Config) -> Float8AllGatherWeight:
        return torch.Tensor._make_wrapper_subclass(
            cls,
            tensor.size(),
            strides=tensor.stride(),
            storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype,
            layout=tensor.layout,
            device=tensor.device,
            requires_grad=tensor.requires_grad,
        )

    def __init__(self, tensor: torch.Tensor, config: Float8Config) -> None:
        self._tensor = tensor
        self._config = config
        # Set by precompute_float8_dynamic_scale_for_fsdp: amax, scale, and the sharded parameter with its
        # _version then (in-place updates bump the parameter's counter, not this shard's).
        self._precomputed: tuple[torch.Tensor, torch.Tensor, weakref.ref, int] | None = None

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        shard = next(a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, cls))
        args, kwargs = pytree.tree_map_only(cls, lambda t: t._tensor, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _KEEP_SHARD_SUBCLASS:
            return out
        return pytree.tree_map_only(torch.Tensor, shard._same_kind, out)

    def _same_kind(self, tensor: torch.Tensor) -> Float8AllGatherWeight:
        # The precomputed scale goes along: FSDP2 re-pads an uneven shard into a new tensor on that rank
        # only, and every rank must decide alike whether to all-reduce (or the collectives deadlock).
        new = Float8AllGatherWeight(tensor, self._config)
        new._precomputed = self._precomputed
        return new

    def __tensor_flatten__(self) -> tuple[list[str], dict[str, Any]]:
        return ["_tensor"], {"config": self._config}

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride) -> Float8AllGatherWeight:
        return Float8AllGatherWeight(inner["_tensor"], meta["config"])

    def __reduce_ex__(self, protocol):
        # Pickled as the plain weight (a Parameter if it is one): a checkpoint loads into nn.Linear and
        # under weights_only=True; an unpickled Float8Linear wraps its weight again.
        if getattr(self, "_is_param", False):
            return nn.Parameter(self._tensor, requires_grad=self.requires_grad).__reduce_ex__(protocol)
        return self._tensor.__reduce_ex__(protocol)

    @property
    def cast_source(self) -> torch.Tensor:
        """The wrapped weight, which the engine casts (:func:`mixprec.lowbit.gemm.LowbitLinearFunction`)."""
        return self._tensor

    def __repr__(self) -> str:  # type: ignore[override]  # mypy 2.4 rejects even Tensor.__repr__'s own signature
        return f"Float8AllGatherWeight({self._tensor!r}, fp8 all-gather)"

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """FSDP2's hook: this rank's shard in e4m3 (as uint8 bytes) with the whole weight's scale."""
        amax, scale = self._amax_and_scale(mesh)
        data = to_float8(self._tensor, scale, E4M3).view(torch.uint8)
        rows = -(-outer_size[0] // mesh.size(mesh.ndim - 1))  # FSDP2 shards dim 0 in chunks of this many
        if data.shape[0] < rows:  # an uneven (or empty) shard is sent padded; FSDP2 drops the padding
            data = torch.cat([data, data.new_zeros(rows - data.shape[0], *data.shape[1:])])
        return (data,), (amax, scale)

    def _amax_and_scale(self, mesh) -> tuple[torch.Tensor, torch.Tensor]:
        precomputed = self._precomputed  # one read: another step may replace it
        if precomputed is not None:
            amax, scale, param_ref, version = precomputed
            param = param_ref()
            if param is not None and param._version == version:  # the weight is as it was then
                return amax, scale
        amax = amax_of(self._tensor)
        for dim in range(mesh.ndim):  # MAX over every mesh dimension: replicas hold equal weights
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))
        return amax, weight_scale(amax, self._config)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        """FSDP2's hook: the gathered e4m3 bytes as a :class:`Float8GatheredWeight` in ``param_dtype``."""
        (data,) = all_gather_outputs
        amax, scale = metadata
        if out is not None:  # FSDP2 re-gathered into the same storage: only the scale is new
            out._scale, out._amax = scale, amax
            return None
        return Float8GatheredWeight(data.view(E4M3.dtype), scale, amax, param_dtype), (data,)


class Float8GatheredWeight(torch.Tensor):
    """The all-gathered weight: e4m3 ``_data`` (N, K) with its float32 scalar ``_scale`` (and the weight's
    ``_amax``), presenting as a ``dtype`` tensor of the same shape whose values are ``_data / _scale``.

    :class:`~mixprec.lowbit.gemm.LowbitLinearFunction` takes ``_data`` and ``_scale`` as the weight's
    fp8 cast; any other op (not a view) sees the dequantized weight.
    """

    @staticmethod
    def __new__(cls, data, scale, amax, dtype) -> Float8GatheredWeight:
        return torch.Tensor._make_wrapper_subclass(
            cls, data.size(), strides=data.stride(), dtype=dtype, device=data.device, requires_grad=False
        )

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype):
        self._data, self._scale, self._amax = data, scale, amax

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        gathered = next(a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, cls))
        if func in _KEEP_GATHERED_SUBCLASS:
            data = func(gathered._data, *args[1:], **(kwargs or {}))
            return cls(data, gathered._scale, gathered._amax, gathered.dtype)
        args, kwargs = pytree.tree_map_only(cls, lambda t: t.dequantize(), (args, kwargs or {}))
        return func(*args, **kwargs)

    def __tensor_flatten__(self) -> tuple[list[str], dict[str, Any]]:
        return ["_data", "_scale", "_amax"], {"dtype": self.dtype}

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride) -> Float8GatheredWeight:
        return Float8GatheredWeight(inner["_data"], inner["_scale"], inner["_amax"], meta["dtype"])

    def tensorwise_cast(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(_data, _scale, _amax)``: the cast the engine uses as the weight's, gathered already."""
        return self._data, self._scale, self._amax

    def dequantize(self) -> torch.Tensor:
        """``_data / _scale`` in this tensor's dtype, shape (N, K)."""
        return (self._data.to(torch.float32) / self._scale).to(self.dtype)

    def __repr__(self) -> str:  # type: ignore[override]  # mypy 2.4 rejects even Tensor.__repr__'s own signature
        return f"Float8GatheredWeight(shape={tuple(self.shape)}, dtype={self.dtype}, scale={self._scale})"


@torch.no_grad()
def precompute_float8_dynamic_scale_for_fsdp(module: nn.Module) -> int:
    """Compute the fp8 scale of every FSDP2-sharded ``Float8AllGatherWeight`` of ``module`` with one
    all-reduce (MAX) of all their amaxes (per device mesh), for the next all-gathers (torchao's function).

    Call it after each ``optimizer.step()`` on every rank. A scale is used while its weight is unchanged;
    without this call each all-gather reduces its own weight's amax (one collective per weight).

    Returns:
        How many weights got a scale (0, and no collective, when ``module`` has none).
    """
    from torch.distributed.tensor import DTensor

    # Each sharded parameter with its local shard (kept as the narrowed Float8AllGatherWeight).
    by_mesh: dict[Any, list[tuple[DTensor, Float8AllGatherWeight]]] = defaultdict(list)
    for sub in module.modules():
        weight = getattr(sub, "weight", None)
        if isinstance(weight, DTensor) and isinstance(weight._local_tensor, Float8AllGatherWeight):
            by_mesh[weight.device_mesh].append((weight, weight._local_tensor))
    for mesh, params in by_mesh.items():
        amaxes = _local_amaxes([shard._tensor for _, shard in params])
        for dim in range(mesh.ndim):
            dist.all_reduce(amaxes, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))
        for (param, shard), amax in zip(params, amaxes, strict=True):
            shard._precomputed = (amax, weight_scale(amax, shard._config), weakref.ref(param), param._version)
    return sum(len(params) for params in by_mesh.values())


def _local_amaxes(shards: list[torch.Tensor]) -> torch.Tensor:
    """float32[len(shards)]: ``max|shard|`` of each (one ``_foreach_norm``; 0 for an empty shard, which
    an uneven split gives a rank and which ``_foreach_norm``'s infinity norm refuses). Stacked, not
    written at a list of indices: that index list would be a host-to-device copy every step."""
    full = [shard for shard in shards if shard.numel()]
    norms = iter(torch._foreach_norm(full, ord=math.inf) if full else ())
    zero = torch.zeros((), dtype=torch.float32, device=shards[0].device)
    return torch.stack([next(norms).to(torch.float32) if shard.numel() else zero for shard in shards])
