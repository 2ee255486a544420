"""`trace_dtypes`: which ops ran in which dtype, per module, so a policy can be checked against intent.

Usage::

    with mixprec.inspect.trace_dtypes(model) as trace:
        with mixprec.autocast("cuda", policy=policy):
            model(x)
    print(trace.table())
    trace.counts["encoder.layers.0.attn"]["linear"]   # {torch.float16: 4}

The trace is a :class:`~torch.overrides.TorchFunctionMode`: each torch call made while it is active is
counted under the innermost running module of ``model``, by op name and the dtype of its (first
floating) result, which is the dtype the op ran in. It works in either nesting order with the autocast
region, and with ``torch.autocast`` too. The casts autocast inserts (``to``) and attribute reads are left
out unless ``include_casts=True``. Nothing is hooked before the ``with`` block or after it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from mixprec.inspect._modules import OUTSIDE, ModuleTracker, display_name
from mixprec.inspect._restore import Handles, tensors_in
from mixprec.inspect._watch import op_name

__all__ = ["DtypeTrace", "trace_dtypes"]

#: Calls that move data between dtypes or read attributes rather than compute.
_CASTS = frozenset(
    {"to", "type", "type_as", "float", "half", "bfloat16", "double", "__get__", "__set__", "detach"}
)


class _Recorder(TorchFunctionMode):
    def __init__(self, trace: DtypeTrace) -> None:
        super().__init__()
        self.trace = trace

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        self.trace._record(op_name(func), result)
        return result


class DtypeTrace:
    """Counts of ops by module, op name and result dtype; a context manager that records while active.

    Args:
        model: the model whose modules the counts are keyed by (qualified names as in
            ``model.named_modules()``, "" for the root); None keys everything as ``"(outside the model)"``.
        include_casts: also count dtype casts the code calls (``to``, ``float``, ``half`` ...) and
            attribute reads. Autocast's own casts happen inside torch's kernels and are not seen.

    Attributes:
        counts: ``{module: {op: {dtype: n}}}``.
    """

    def __init__(self, model: nn.Module | None = None, *, include_casts: bool = False) -> None:
        if model is not None and not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module or None, got {type(model).__name__}")
        self.model = model
        self.include_casts = include_casts
        self.counts: dict[str, dict[str, dict[torch.dtype, int]]] = {}
        self._handles = Handles()
        self._tracker: ModuleTracker | None = None
        self._recorder: _Recorder | None = None

    def __enter__(self) -> DtypeTrace:
        if self._recorder is not None:
            raise RuntimeError("this DtypeTrace is already active; nest a new trace_dtypes() instead")
        if self.model is not None:
            self._tracker = ModuleTracker(self.model, self._handles)
        self._recorder = _Recorder(self)
        self._recorder.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        recorder, self._recorder = self._recorder, None
        try:
            if recorder is not None:
                recorder.__exit__(None, None, None)
        finally:
            self._handles.remove_all()
            self._tracker = None

    def _record(self, name: str, result: Any) -> None:
        if not self.include_casts and name in _CASTS:
            return
        dtype = next((t.dtype for t in tensors_in(result) if t.is_floating_point()), None)
        if dtype is None:
            return
        module = self._tracker.current if self._tracker is not None else OUTSIDE
        per_op = self.counts.setdefault(module, {}).setdefault(name, {})
        per_op[dtype] = per_op.get(dtype, 0) + 1

    @property
    def totals(self) -> dict[str, dict[torch.dtype, int]]:
        """``{op: {dtype: n}}`` summed over modules."""
        totals: dict[str, dict[torch.dtype, int]] = {}
        for per_module in self.counts.values():
            for name, per_dtype in per_module.items():
                for dtype, n in per_dtype.items():
                    totals.setdefault(name, {})[dtype] = totals.get(name, {}).get(dtype, 0) + n
        return totals

    def modules_running(self, op: str, dtype: torch.dtype) -> list[str]:
        """Modules in which ``op`` ran at least once in ``dtype``."""
        return [m for m, per_op in self.counts.items() if per_op.get(op, {}).get(dtype)]

    def table(self) -> str:
        """A fixed-width table: one row per (module, op), one column per dtype seen."""
        dtypes = sorted({d for per_op in self.counts.values() for c in per_op.values() for d in c}, key=str)
        names = [str(d).removeprefix("torch.") for d in dtypes]
        header = f"{'module':<28} {'op':<22} " + " ".join(f"{n:>9}" for n in names)
        lines = [header, "-" * len(header)]
        for module, per_op in self.counts.items():
            label = module if module == OUTSIDE else display_name(module)
            for name, per_dtype in per_op.items():
                cells = " ".join(f"{per_dtype.get(d, '-'):>9}" for d in dtypes)
                lines.append(f"{label[:28]:<28} {name[:22]:<22} {cells}")
        return "\n".join(lines)


def trace_dtypes(model: nn.Module | None = None, *, include_casts: bool = False) -> DtypeTrace:
    """A :class:`DtypeTrace` to use as ``with trace_dtypes(model) as trace: ...``.

    Args:
        model: the model whose module names key the counts (None: no per-module split).
        include_casts: also count casts and attribute reads.

    Returns:
        The trace (inactive until entered).
    """
    return DtypeTrace(model, include_casts=include_casts)
