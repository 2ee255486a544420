"""The op-level watcher behind :func:`mixprec.inspect.find_nonfinite`.

Forward: a :class:`~torch.overrides.TorchFunctionMode` pushed *inside* the mixprec autocast region sees
every torch call first, runs it (through the autocast mode below it, so with the policy's casts) and
checks the result; the first call whose floating output holds inf or nan is recorded.

Backward: for every op the watcher runs with grad enabled, it walks the autograd nodes the op created
(from its outputs' ``grad_fn`` back to its inputs' nodes and the leaves) and registers a node hook on
each. A node hook sees the gradients flowing in (``grad_outputs``) and the ones it computed
(``grad_inputs``), so the first node whose inputs were finite and whose result is not names the op,
and the module it ran in, exactly, even where a tensor feeds several ops (residuals) or a weight's
gradient alone overflows. Node hooks live on this forward's graph, never on the model.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from mixprec.autocast import autocast
from mixprec.inspect._modules import ModuleTracker
from mixprec.inspect._restore import Handles, tensors_in
from mixprec.inspect.nonfinite_report import NonfiniteReport


def op_name(func: Any) -> str:
    """The name users know an op by: ``linear``, ``matmul``, ``__add__``."""
    return getattr(func, "__name__", None) or type(func).__name__


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every floating tensor holds only finite values (one host sync)."""
    floating = [t for t in tensors if t.is_floating_point() and t.numel()]
    return not floating or bool(torch.stack([torch.isfinite(t).all() for t in floating]).all())


def value_range(tensors: list[torch.Tensor]) -> tuple[float, float] | None:
    """(min, max) over the finite values of the floating tensors, or None when there are none."""
    lows, highs = [], []
    for t in tensors:
        if not t.is_floating_point() or not t.numel():
            continue
        finite = t.detach()[torch.isfinite(t.detach())]
        if finite.numel():
            lows.append(finite.min().float())
            highs.append(finite.max().float())
    if not lows:
        return None
    return float(torch.stack(lows).min()), float(torch.stack(highs).max())


def nonfinite_kind(tensors: list[torch.Tensor]) -> str:
    """ "nan" if any value is nan, else "inf"."""
    return "nan" if any(bool(torch.isnan(t).any()) for t in tensors if t.is_floating_point()) else "inf"


_IN_PLACE_DUNDERS = frozenset(
    f"__i{op}__"
    for op in ("add", "sub", "mul", "matmul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor")
) | {"__ilshift__", "__irshift__"}


def _mutates(func: Any, kwargs: dict) -> bool:
    name = op_name(func)
    in_place = (name.endswith("_") and not name.endswith("__")) or name in _IN_PLACE_DUNDERS
    return in_place or bool(kwargs.get("inplace")) or kwargs.get("out") is not None


def _to_fp32(value: Any, copy: bool = False) -> Any:
    """Floating tensors in ``value`` as float32 (float64 kept); ``copy``: every tensor a fresh copy."""
    if isinstance(value, torch.Tensor):
        keep = not value.is_floating_point() or value.dtype == torch.float64
        dtype = value.dtype if keep else torch.float32
        return value.detach().to(dtype, copy=True) if copy else (value if keep else value.detach().float())
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_to_fp32(v, copy) for v in value)
    if isinstance(value, dict):
        return {k: _to_fp32(v, copy) for k, v in value.items()}
    return value


def _masks(outputs: list[torch.Tensor], given: tuple[Any, Any]) -> bool:
    """Whether an op's non-finite outputs are a deliberate -inf mask, not an overflow: their only
    non-finite value is -inf and the op was given -inf (``masked_fill(mask, float("-inf"))``, a mask
    added). A fully masked row still shows, as the nan its softmax makes."""
    for t in outputs:
        bad = t.detach()[~torch.isfinite(t.detach())]
        if bad.numel() and not bool((bad == -math.inf).all()):
            return False
    values = [*tensors_in(given), *_scalars(given)]
    return any(
        (v == -math.inf) if isinstance(v, float) else bool((v.detach() == -math.inf).any())
        for v in values
        if isinstance(v, float) or (isinstance(v, torch.Tensor) and v.is_floating_point())
    )


def _scalars(value: Any) -> list[float]:
    """The Python floats in a (nested) tuple, list or dict of an op's arguments."""
    if isinstance(value, float):
        return [value]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _scalars(v)]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _scalars(v)]
    return []


class Watch(TorchFunctionMode):
    """Records the first non-finite forward output and hooks each op's backward nodes.

    Args:
        tracker: names the module each op runs in.
        handles: collects the node hooks so the caller removes them.
        device_type: the autocast region's device family (for the fp32 re-run of the culprit).
        watch_backward: hook backward nodes (only when a backward will run).
    """

    def __init__(
        self, tracker: ModuleTracker, handles: Handles, device_type: str, watch_backward: bool
    ) -> None:
        super().__init__()
        self.tracker = tracker
        self.handles = handles
        self.device_type = device_type
        self.watch_backward = watch_backward
        self.forward: NonfiniteReport | None = None
        self.backward: NonfiniteReport | None = None
        self._seen_nodes: set[Any] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # An in-place op overwrites its inputs: keep float32 copies to judge them (and re-run the op on).
        before = None
        if self.forward is None and _mutates(func, kwargs):
            before = (_to_fp32(args, copy=True), _to_fp32(kwargs, copy=True))
        result = func(*args, **kwargs)
        outputs = [t for t in tensors_in(result) if t.is_floating_point()]
        if outputs:
            if (
                self.forward is None
                and not all_finite(outputs)
                and not _masks(outputs, before or (args, kwargs))
            ):
                self.forward = self._forward_finding(func, args, kwargs, outputs, before)
            if self.watch_backward and self.forward is None:
                self._hook_nodes(op_name(func), args, kwargs, outputs)
        return result

    def release(self) -> None:
        """Drop the references to graph nodes (the hooks themselves go with the handles)."""
        self._seen_nodes.clear()

    # ----------------------------------------------------------------- forward
    def _forward_finding(
        self,
        func: Any,
        args: tuple,
        kwargs: dict,
        outputs: list[torch.Tensor],
        before: tuple[tuple, dict] | None,
    ) -> NonfiniteReport:
        """The report for the op that produced non-finite ``outputs``; ``before``: float32 copies of an
        in-place op's arguments taken before it ran (its inputs as they were, not as it left them)."""
        bad = [t for t in outputs if not all_finite([t])]
        if before is not None:
            args, kwargs = before
        inputs = tensors_in((args, kwargs))
        return NonfiniteReport(
            module=self.tracker.current,
            phase="forward",
            op=op_name(func),
            dtype=bad[0].dtype,
            value=nonfinite_kind(bad),
            input_range=value_range(inputs),
            inputs_finite=all_finite(inputs),
            finite_in_fp32=self._finite_in_fp32(func, args, kwargs, copied=before is not None),
        )

    def _finite_in_fp32(self, func: Any, args: tuple, kwargs: dict, copied: bool) -> bool | None:
        """Whether the culprit op gives finite results when run in float32 (None: could not re-run it).

        An in-place op is re-run only on ``copied`` arguments (float32 copies made before it ran)."""
        if _mutates(func, kwargs) and not copied:
            return None
        try:
            with torch.no_grad(), autocast(self.device_type, enabled=False):
                result = func(*_to_fp32(args), **_to_fp32(kwargs))
        except Exception:  # the re-run is a hint only; an op that refuses fp32 inputs gives no hint
            return None
        return all_finite(tensors_in(result))

    # ----------------------------------------------------------------- backward
    def _hook_nodes(self, name: str, args: tuple, kwargs: dict, outputs: list[torch.Tensor]) -> None:
        stop = {t.grad_fn for t in tensors_in((args, kwargs)) if t.grad_fn is not None}
        pending = [t.grad_fn for t in outputs if t.grad_fn is not None]
        module = self.tracker.current
        while pending:
            node = pending.pop()
            if node in self._seen_nodes or node in stop or type(node).__name__ == "AccumulateGrad":
                continue
            self._seen_nodes.add(node)
            self.handles.add(node.register_hook(self._node_hook(name, module, node)))
            pending.extend(fn for fn, _ in node.next_functions if fn is not None)

    def _node_hook(self, name: str, module: str, node: Any):
        def hook(grad_inputs: tuple, grad_outputs: tuple) -> None:
            if self.backward is not None:
                return
            incoming = [g for g in grad_outputs if g is not None]
            produced = [g for g in grad_inputs if g is not None]
            if all_finite(produced) or not all_finite(incoming):
                return
            bad = [g for g in produced if not all_finite([g])]
            self.backward = NonfiniteReport(
                module=module,
                phase="backward",
                op=name,
                dtype=bad[0].dtype,
                value=nonfinite_kind(bad),
                input_range=value_range(incoming),
                inputs_finite=True,
                node=type(node).__name__,
            )

        return hook
