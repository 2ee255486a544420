"""The low-precision building blocks of the compensated updates: workspace, chunks, Kahan fold, rounding.

Temporaries (fp32 copies of the gradients and moments, Adam's denominator, stochastic rounding's values and
random bits) live in a :class:`Workspace` that survives between steps: an update allocates nothing per
step, and no scratch the size of a big model exists. Its buffers are bounded per device type
(:meth:`Workspace.numel_on`):

* on a CPU by ``CHUNK`` elements (1 MiB in fp32: cache-sized, so a chunk's copies are still in cache when
  the kernel reads them), one buffer up to ``FOLD`` elements: the fp32 gradient copies of a whole guarded
  fused Adam step small enough to be checked in the workspace before anything is written
  (:func:`mixprec.optim.fused_adam.adam_step`);
* on a CUDA device by ``CUDA_CHUNK`` elements, the fold too (``CUDA_FOLD``). A GPU kernel over 2**24 fp32
  values runs for tens of microseconds at HBM bandwidth, several times the host's cost of launching it, so
  the device stays busy while the host issues the next chunk's ten or so ops (at ``CHUNK`` a 403M step
  would be ~1,540 chunks and 17,000 to 20,000 launches, launch-bound); the price is memory: 64 MiB per fp32
  buffer, at most five (plus 32 MiB of random bits for stochastic rounding), against the several GiB of
  weights, gradients and moments a step of that size holds.

Each chunk is a list of consecutive slices of the flattened tensors (a big tensor spans chunks, small ones
share one), so the foreach ops see the same values as on whole tensors; only the grouping differs.

Stochastic rounding (Zamirai et al. 2020; Gupta et al. 2015, "Deep Learning with Limited Numerical
Precision") adds 16 uniform random bits below bf16's last bit of the fp32 pattern and truncates, so the
carry into bf16's last bit happens with probability (dropped fraction): unbiased. Where the bits come from:

* :func:`round_stochastic_into` (fp32-state paths): one ``randint`` per value from the generator;
* :func:`round_stochastic` (the fused Adam engine, every state format), on a CUDA device and for chunks
  under ``POOL // 4`` values: fresh bits from the generator (:func:`add_fresh_bits`, four values per
  int64 draw), drawn on the device with nothing read back to the host;
* :func:`round_stochastic` on a CPU, chunks of ``POOL // 4`` values or more: :class:`RandomBits`, a pool of
  ``POOL`` int32 values holding every 16-bit pattern equally often, shuffled once from a fixed seed and
  stored twice over, read at windows that start at offsets drawn from the generator for every chunk of
  every step.
  Given a uniform offset each value is exactly uniform over the 2**16 patterns, so each rounding stays
  unbiased; rounding errors of two weights in one step may be correlated (their windows may overlap), never
  biased. Drawing the offsets costs one small ``randint`` per chunk instead of 16 bits per weight, but the
  offsets are host numbers: on a GPU every chunk would wait for the device, hence fresh bits there.

Which bits a weight gets depends on the chunking (the draws are made chunk by chunk), so a stochastic run
repeats bit for bit only with the same chunk sizes on the same device type; Kahan and nearest rounding and
the moments do not depend on it (a tensor is cut only where its vectors or blocks end, see
:func:`segments`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

__all__ = [
    "ALIGN",
    "CHUNK",
    "CUDA_CHUNK",
    "CUDA_FOLD",
    "FOLD",
    "POOL",
    "RandomBits",
    "Workspace",
    "add_fresh_bits",
    "chunks",
    "kahan_fold",
    "narrow",
    "round_stochastic",
    "round_stochastic_into",
    "segments",
    "views",
    "widen",
]

CHUNK = 2**18  # most elements per buffer on a CPU (1 MiB in fp32, cache-sized); never more than stepped
FOLD = 2**20  # most gradient values a guarded fused Adam step copies up front to check them (4 MiB fp32)
CUDA_CHUNK = 2**24  # on a CUDA device: kernels long enough to hide their launches (64 MiB in fp32)
CUDA_FOLD = CUDA_CHUNK  # the "grad" buffer a chunk needs anyway: folding costs no memory more
POOL = 2**18  # random-bit pool: every 16-bit pattern 4 times; chunks under POOL // 4 draw fresh bits
KEEP_HIGH_16_BITS = -65536  # 0xFFFF0000 as int32: clears the low 16 bits of an fp32 pattern
ALIGN = 64  # elements: a multiple of every vector width torch's kernels use
ROLES = ("grad", "moment", "second", "values", "kahan", "denom", "bits")


class Workspace:
    """Scratch buffers reused across steps, one per (device, dtype, role), at most ``numel`` elements each
    (the ``"grad"`` buffer up to ``fold_numel`` when a whole fused Adam step's gradients are checked in it);
    on a CUDA device ``cuda_numel`` and ``cuda_fold_numel`` (see the module doc; :meth:`numel_on`).

    Roles (what the buffer holds during an update): ``"grad"``, ``"moment"``, ``"second"`` (fp32 copies of
    the gradients and moments), ``"values"`` (the new weights in fp32), ``"kahan"``, ``"denom"`` (bf16
    temporaries of the unfused paths), ``"bits"``; the random-bit pools live here too (:attr:`pools`).
    """

    def __init__(
        self,
        numel: int = CHUNK,
        fold_numel: int = FOLD,
        cuda_numel: int = CUDA_CHUNK,
        cuda_fold_numel: int = CUDA_FOLD,
    ) -> None:
        self.numel = numel
        self.fold_numel = fold_numel
        self.cuda_numel = cuda_numel
        self.cuda_fold_numel = cuda_fold_numel
        self.buffers: dict[tuple[str, torch.dtype, str], torch.Tensor] = {}
        self.pools: dict[str, RandomBits] = {}
        self.plans: dict[tuple[Any, ...], Any] = {}  # the engine's kept chunk views, keyed by their tensors
        self.tables: dict[tuple[Any, ...], Any] = {}  # constant lookup tables per device (the int8 state map)
        self.generation = 0  # bumped whenever a buffer is replaced, which makes cached views stale

    def numel_on(self, device: torch.device) -> int:
        """Most elements of a chunk (a buffer) on ``device``: ``cuda_numel`` on CUDA, else ``numel``."""
        return self.cuda_numel if device.type == "cuda" else self.numel

    def fold_numel_on(self, device: torch.device) -> int:
        """Most gradient values a guarded step on ``device`` checks in the workspace (see ``fold_numel``)."""
        return self.cuda_fold_numel if device.type == "cuda" else self.fold_numel

    def get(self, device: torch.device, dtype: torch.dtype, role: str, numel: int) -> torch.Tensor:
        """A buffer of at least ``numel`` elements (grown, never shrunk, while the optimizer lives).

        Raises:
            ValueError: for a role not in ``ROLES``.
        """
        if role not in ROLES:
            raise ValueError(f"unknown workspace role {role!r}; accepted: {list(ROLES)}")
        key = (str(device), dtype, role)
        buffer = self.buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = self.buffers[key] = torch.empty(numel, dtype=dtype, device=device)
            self.generation += 1
        return buffer

    def views(self, role: str, dtype: torch.dtype, like: list[torch.Tensor]) -> list[torch.Tensor]:
        """Consecutive views of the ``role`` buffer shaped as the tensors ``like`` (one device)."""
        buffer = self.get(like[0].device, dtype, role, sum(t.numel() for t in like))
        return views(buffer, like)

    def random_bits(self, device: torch.device) -> RandomBits:
        key = str(device)
        if key not in self.pools:
            self.pools[key] = RandomBits(device)
        return self.pools[key]

    def __getstate__(self) -> dict[str, Any]:
        # scratch, not state: recreated on demand
        return {"numel": self.numel, "fold_numel": self.fold_numel, "cuda_numel": self.cuda_numel,
                "cuda_fold_numel": self.cuda_fold_numel, "buffers": {}, "pools": {}, "plans": {},
                "tables": {}, "generation": 0}  # fmt: skip

    def __setstate__(self, state: dict[str, Any]) -> None:
        # a workspace pickled before the CUDA bounds existed gets the defaults
        self.__dict__.update({"cuda_numel": CUDA_CHUNK, "cuda_fold_numel": CUDA_FOLD, **state})


def views(buffer: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Consecutive slices of the flat ``buffer``, each viewed as the shape of its tensor in ``like``."""
    out, start = [], 0
    for t in like:
        out.append(buffer[start : start + t.numel()].view(t.shape))
        start += t.numel()
    return out


def chunks(
    lists: list[list[torch.Tensor]], limit: int
) -> Iterator[tuple[list[list[torch.Tensor]], list[int]]]:
    """Slices of the aligned ``lists`` (same numel per index) with at most ``limit`` elements per chunk.

    Yields ``(views per list, owner index per view)``; when everything fits, the tensors themselves.
    """
    if sum(t.numel() for t in lists[0]) <= limit:
        yield lists, list(range(len(lists[0])))
        return
    pieces: list[list[torch.Tensor]] = [[] for _ in lists]
    owners: list[int] = []
    size = 0
    for i in range(len(lists[0])):
        flats = [tensors[i].view(-1) for tensors in lists]
        numel, start = flats[0].numel(), 0
        while start < numel:
            take = min(numel - start, limit - size)
            for out, flat in zip(pieces, flats, strict=True):
                out.append(flat[start : start + take])
            owners.append(i)
            size, start = size + take, start + take
            if size == limit:
                yield pieces, owners
                pieces, owners, size = [[] for _ in lists], [], 0
    if owners:
        yield pieces, owners


def segments(sizes: list[int], limit: int, align: int = ALIGN) -> list[list[tuple[int, int, int]]]:
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


def kahan_fold(params: list[torch.Tensor], kahan: list[torch.Tensor], temp: list[torch.Tensor]) -> None:
    """``w, c = round(w + c), c + (w - round(w + c))`` in the weights' dtype; ``temp`` is workspace."""
    torch._foreach_copy_(temp, params)
    torch._foreach_add_(params, kahan)
    torch._foreach_sub_(temp, params)
    torch._foreach_add_(kahan, temp)


def round_stochastic_into(weight: torch.Tensor, value: torch.Tensor, generator: torch.Generator) -> None:
    """``weight = value`` rounded to bf16 stochastically, one ``randint`` per value; ``value`` (fp32) is
    used as workspace."""
    bits = value.view(torch.int32)
    noise = torch.randint(0, 2**16, value.shape, dtype=torch.int32, device=value.device, generator=generator)
    bits.add_(noise).bitwise_and_(KEEP_HIGH_16_BITS)
    weight.copy_(value)  # exact: the low 16 bits are zero


def widen(
    values: list[torch.Tensor],
    weights: list[torch.Tensor],
    kahan: list[torch.Tensor] | None,
    scratch: list[torch.Tensor],
) -> None:
    """``values = fp32(w) + fp32(c)``, the value a Kahan-compensated weight tracks (``fp32(w)`` without
    ``kahan``); ``scratch``: fp32 tensors shaped as the weights, for the buffers' fp32 copies."""
    torch._foreach_copy_(values, weights)
    if kahan is not None:
        torch._foreach_copy_(scratch, kahan)
        torch._foreach_add_(values, scratch)


def narrow(
    weights: list[torch.Tensor],
    values: list[torch.Tensor],
    kahan: list[torch.Tensor] | None,
    scratch: list[torch.Tensor],
    flat: torch.Tensor,
    generator: torch.Generator | None,
    workspace: Workspace,
) -> None:
    """Write the stepped fp32 ``values`` into the low-precision weights, each way the updates round:

    * Kahan (``kahan`` given): ``w = round(t); c = t - w`` (exact in fp32: ``w`` is ``t``'s neighbour);
    * stochastic (``generator`` given): :func:`round_stochastic` (``flat``: the fp32 buffer the values
      cover);
    * nearest: ``w = round(t)``.

    ``values`` and ``scratch`` (fp32, shaped as the weights) are used as workspace.
    """
    if kahan is not None:
        torch._foreach_copy_(weights, values)
        torch._foreach_copy_(scratch, weights)
        torch._foreach_sub_(values, scratch)
        torch._foreach_copy_(kahan, values)
    elif generator is not None:
        round_stochastic(weights, values, flat, generator, workspace)
    else:
        torch._foreach_copy_(weights, values)


def round_stochastic(
    weights: list[torch.Tensor],
    values: list[torch.Tensor],
    flat: torch.Tensor,
    generator: torch.Generator,
    workspace: Workspace,
) -> None:
    """``weights = round_stochastic(values)`` (bf16) with fresh bits on a CUDA device or for a chunk under
    ``POOL // 4`` values, else bits from the workspace's pool (see the module doc); ``flat`` is the fp32
    buffer the ``values`` views cover, used as workspace."""
    bits = flat.view(torch.int32)
    device = weights[0].device
    # small chunks: fresh bits cost little and no pool is made; CUDA: the pool's offsets would sync the host
    if flat.numel() < POOL // 4 or device.type == "cuda":
        add_fresh_bits(bits, generator, workspace.get(device, torch.int64, "bits", (flat.numel() + 3) // 4))
    else:
        workspace.random_bits(device).add_(bits, generator)
    bits.bitwise_and_(KEEP_HIGH_16_BITS)  # carry into bf16's last bit with the dropped fraction
    torch._foreach_copy_(weights, values)  # exact: the low 16 bits are zero


class RandomBits:
    """Uniform 16-bit patterns for stochastic rounding, read from a shuffled pool at random offsets."""

    def __init__(self, device: torch.device) -> None:
        shuffle = torch.Generator().manual_seed(0x5EED)  # a fixed order: the offsets carry the randomness
        patterns = torch.arange(POOL, dtype=torch.int32) % 2**16
        pool = patterns[torch.randperm(POOL, generator=shuffle)].to(device)
        self.pool = torch.cat([pool, pool])  # any window of up to POOL values is contiguous

    def add_(self, bits: torch.Tensor, generator: torch.Generator) -> None:
        """Add uniform noise in [0, 2**16) to every value of the flat int32 tensor ``bits``."""
        starts = range(0, bits.numel(), POOL)
        offsets = torch.randint(
            0, POOL, (len(starts),), generator=generator, device=generator.device
        ).tolist()
        pieces = [bits[start : start + POOL] for start in starts]
        windows = [self.pool[o : o + p.numel()] for o, p in zip(offsets, pieces, strict=True)]
        torch._foreach_add_(pieces, windows)


def add_fresh_bits(bits: torch.Tensor, generator: torch.Generator, draws: torch.Tensor) -> None:
    """Add new uniform noise in [0, 2**16) from the generator to the flat int32 ``bits``; ``draws`` is an
    int64 buffer of at least a quarter of their number (four 16-bit values per draw)."""
    total = bits.numel()
    draws = draws[: (total + 3) // 4]
    draws.random_(-(2**63), 2**63 - 1, generator=generator)
    bits.add_(draws.view(torch.int16)[:total]).add_(2**15)  # int16 is [-2**15, 2**15)
