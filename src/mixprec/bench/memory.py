"""Peak memory of one training run, measured from just before its model is built.

* CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, minus what was allocated
  at the start: tensors only (parameters, gradients, optimizer state, activations, casts), not the
  allocator's cache or the CUDA context.
* CPU: the process's peak resident set size (Linux ``VmHWM``, reset through ``/proc/self/clear_refs``)
  minus its RSS at the start, which comes after a probe step on a tiny model has paid the one-off cost
  of starting autograd, the kernel libraries and the thread pool. Freed memory that the allocator keeps
  counts, so this is only meaningful in a fresh process per run, which is how the bench runs on a CPU.
  Where the peak cannot be reset, the all-time peak ``ru_maxrss`` is used when training raised it, else
  nothing is reported.

Beside the peak, :func:`component_bytes` reads what one step holds per component (weights, gradients,
optimizer state, saved activations) off the tensors themselves, the same on every device: the storages of
the parameters, their gradients and the optimizer's state, and the saved tensors :class:`SavedBytes`
counts through ``torch.autograd.graph.saved_tensors_hooks`` during that step's forward.
"""

from __future__ import annotations

import gc
import resource
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
MIB = 2**20

DESCRIPTIONS = {
    "cuda": "peak tensor memory (torch.cuda.max_memory_allocated) above the start of the run",
    "cpu-hwm": "peak RSS above the RSS before the model was built (VmHWM), one fresh process per run",
    "cpu-maxrss": "peak RSS above the RSS before the model was built (ru_maxrss), one fresh process per run",
    "none": "not measured (CPU runs in one process share an allocator; run without --in-process)",
}


def _status_kib(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _maxrss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _current_rss_bytes() -> int | None:
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024


class PeakMemory:
    """Measures one run's peak memory above its starting point; ``method`` names how (see DESCRIPTIONS)."""

    def __init__(self, device: torch.device, fresh_process: bool) -> None:
        self.device = device
        self.fresh_process = fresh_process
        self.method = "none"
        self._base = 0
        self._start_maxrss = 0

    def start(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            self.method = "cuda"
            return
        rss = _current_rss_bytes()
        if not self.fresh_process or rss is None:
            self.method = "none"
            return
        self._base = rss
        try:
            _CLEAR_REFS.write_text("5")  # "5": reset the peak RSS to the current RSS (Linux >= 4.0)
            self.method = "cpu-hwm"
        except OSError:
            self._start_maxrss = _maxrss_bytes()
            self.method = "cpu-maxrss"

    def peak_mb(self) -> float | None:
        """Peak above the start in MiB, or None when this setup cannot measure it honestly."""
        if self.method == "cuda":
            torch.cuda.synchronize(self.device)
            return (torch.cuda.max_memory_allocated(self.device) - self._base) / MIB
        if self.method == "cpu-hwm":
            hwm = _status_kib("VmHWM")
            return None if hwm is None else max(hwm * 1024 - self._base, 0) / MIB
        if self.method == "cpu-maxrss":
            peak = _maxrss_bytes()
            return (peak - self._base) / MIB if peak > self._start_maxrss else None
        return None


#: The parts of a step's memory reported per mode, in the order the table shows them.
COMPONENTS = ("weights", "gradients", "optimizer_state", "activations")


def _storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a view and its base count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


class SavedBytes:
    """Counts, while it is entered, the bytes of the tensors autograd saves for backward: distinct storages,
    leaving out parameters and buffers of ``model`` (the model holds them anyway) and leaves that require
    grad. A region with its own ``saved_tensors_hooks`` inside (``save_activations``) takes over from this
    one, as torch's innermost hooks do, so such a mode reports its own count instead."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._owned = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
        self._seen: dict[int, int] = {}
        self._hooks: Any = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        root = t._base if t._base is not None else t
        if not (isinstance(root, torch.nn.Parameter) or (root.is_leaf and root.requires_grad)):
            storage = t.untyped_storage()
            if storage.data_ptr() not in self._owned:
                self._seen[storage.data_ptr()] = storage.nbytes()
        return t

    @property
    def nbytes(self) -> int:
        return sum(self._seen.values())

    def __enter__(self) -> SavedBytes:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


def component_bytes(model: torch.nn.Module, optimizer: Any, activations: int) -> dict[str, int]:
    """What a training step holds once it is done, read off the tensors: the model's parameters plus any
    tensor the optimizer steps instead of them (fp32 masters), their ``.grad``, every tensor in the torch
    optimizer's ``state`` plus a mixprec wrapper's Kahan ``compensation`` buffers, and ``activations``."""
    inner, compensation = optimizer, []
    while getattr(inner, "optimizer", None) is not None:  # mixprec wrappers hold the optimizer they step
        compensation += list(getattr(inner, "compensation", None) or [])
        inner = inner.optimizer
    params = list(model.parameters())
    stepped = [p for group in inner.param_groups for p in group["params"]]
    held = {t.untyped_storage().data_ptr() for t in params}
    masters = [p for p in stepped if p.untyped_storage().data_ptr() not in held]
    state = [v for s in inner.state.values() for v in s.values() if torch.is_tensor(v)]
    state += compensation
    return {
        "weights": _storage_bytes(params + masters),
        "gradients": _storage_bytes(p.grad for p in params + masters if p.grad is not None),
        "optimizer_state": _storage_bytes(state),
        "activations": activations,
    }
