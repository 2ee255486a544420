"""The fake-CUDA harness: CUDA branches on ``device="cuda"`` FakeTensors, with what they cost the host.

A CUDA build of torch runs the CUDA dispatch keys and meta kernels under ``FakeTensorMode`` without a GPU
(shape, stride, dtype and device rules included: ``_scaled_mm``'s scaling check is the meta kernel's), but
no real kernel and not autograd's backward engine: call an ``autograd.Function``'s ``forward`` /
``backward`` directly with a :class:`Ctx`. ``torch.cuda.is_available()`` is False there, so
:func:`cuda_patched` makes it True and fixes the compute capability for mixprec's callers.

:class:`Recorder` is a ``TorchDispatchMode`` pushed inside the fake mode (so it sees every op first) that
records:

- ``sync``: ``aten._local_scalar_dense`` of a CUDA tensor (``.item()``, ``bool()``, ``float()`` come
  down to it; ``.tolist()`` counts once, as the one copy it is on a GPU), plus ops with data-dependent
  output shapes (``nonzero`` & co.); :meth:`Recorder.host_syncs` adds the device-to-host copies;
  under fake mode the scalar has no value, so the recorder answers a plausible one itself (False / 0,
  see :meth:`Recorder.scalar`) instead of letting the fake mode raise ``DataDependentOutputException``;
- ``h2d`` / ``d2h``: ``_to_copy`` / ``copy_`` between a host and a CUDA tensor, and a CUDA op fed a host
  tensor of more than one element (an implicit pageable copy, e.g. indexing with a Python list).
  ``torch.tensor(..., device="cuda")`` arrives as ``lift_fresh`` of a host constant then a host-to-CUDA
  ``_to_copy``, so it counts as one ``h2d``;
- ``bad_generator``: a random op whose ``generator=`` lives on another device type than its output;
- ``scaled_mm``: every ``_scaled_mm`` / ``_scaled_mm_v2`` / ``_scaled_grouped_mm`` call, its operands'
  shapes, strides and dtypes, its scales' shapes and dtypes, and the error the meta kernel raised, if any;
- ``launches`` (a tally per op name, kept apart from ``events``): every op on a CUDA tensor (or making
  one) that runs a kernel, i.e. neither a view (``slice``, ``view``, ``detach``, ...) nor a bare
  allocation (``empty``, ...) nor the scalar read itself nor a ``prim`` metadata query (``device``); one
  dispatched op as the host issues it (a ``_foreach_*`` or fused op over a long list may launch a few
  kernels on a GPU, torch's as well as ours);
- ``device_mismatch``: an op mixing CPU and CUDA tensors that the real CUDA kernel refuses. The recorder
  raises it at once (a ``RuntimeError``, as the GPU would) and also keeps it in
  :attr:`Recorder.device_errors`, which :meth:`Recorder.reset` leaves alone: :func:`fake_cuda` fails on
  exit when one was raised and swallowed (a ``try``/``except`` in the code under test). The rules, from
  torch's ``native_functions.yaml`` and the kernels' own checks, are data in ``fake_cuda/devices.py``: every
  tensor argument on one device (``torch._fused_adamw_``'s ``state_steps``, ``grad_scale``, ``found_inf``
  included; a tensor ``lr`` may be on the host), except that a TensorIterator op (``mul``, ``add_``,
  ``where``, ...) takes a 0-dim CPU tensor as an input (never as its output), a ``_foreach_*`` op does so
  per index (its slow path), ``_foreach_mul`` / ``_foreach_div`` take a CPU scalar tensor but
  ``_foreach_add`` does not, ``_foreach_addcdiv`` / ``_foreach_addcmul`` want their ``scalars`` tensor on
  the host, indices may be anywhere, and explicit copies (``copy_``, ``_to_copy``, ``_foreach_copy_``) cross
  devices. ``fake_cuda(device_check=False)`` turns it off.
"""

from __future__ import annotations

import collections
import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from fake_cuda import devices

__all__ = [
    "CAPABILITIES",
    "Applied",
    "Ctx",
    "DeviceMismatch",
    "Event",
    "FakeCudaGenerator",
    "FakeCudaMode",
    "Recorder",
    "cuda_patched",
    "direct_autograd",
    "fake_cuda",
    "module_apply_in_place",
]

#: Ada (sm89), Hopper (sm90), datacenter Blackwell (sm100), consumer Blackwell (sm120).
CAPABILITIES = ((8, 9), (9, 0), (10, 0), (12, 0))

aten = torch.ops.aten
_SYNC = {aten._local_scalar_dense.default}
# Output shape depends on the data: the host waits for the device to learn it.
_DATA_DEPENDENT = {"nonzero", "masked_select", "unique", "_unique2", "unique_consecutive", "bincount"}
_RANDOM = {
    "rand",
    "randn",
    "randint",
    "randperm",
    "rand_like",
    "randn_like",
    "randint_like",
    "uniform",
    "uniform_",
    "normal",
    "normal_",
    "bernoulli",
    "bernoulli_",
    "exponential_",
    "geometric_",
    "log_normal_",
    "cauchy_",
    "random_",
    "multinomial",
}
# Ops that allocate or read back without running a kernel on the device (views are told by their schema).
_NO_KERNEL = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "lift_fresh",
              "_local_scalar_dense"}  # fmt: skip
_SCALED_MM = {"_scaled_mm", "_scaled_mm_v2", "_scaled_grouped_mm", "_scaled_grouped_mm_v2"}


@dataclass
class Event:
    """One recorded op: its kind (see the module doc), the aten op, and what was seen."""

    kind: str
    op: str
    detail: dict[str, Any] = field(default_factory=dict)


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _describe(t: Any) -> Any:
    if not isinstance(t, torch.Tensor):
        return t
    return {"shape": tuple(t.shape), "stride": tuple(t.stride()), "dtype": t.dtype, "device": t.device.type}


def _bind(func: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The op's arguments by schema name (positional and keyword together)."""
    names = [a.name for a in func._schema.arguments]
    return {**dict(zip(names, args, strict=False)), **kwargs}


def _target_device(bound: dict[str, Any]) -> str:
    """The device type a factory or in-place op writes to: ``device=``, else its first tensor's."""
    device = bound.get("device")
    if device is not None:
        return torch.device(device).type
    first = next(iter(_tensors(list(bound.values()))), None)
    return first.device.type if first is not None else "cpu"


class DeviceMismatch(RuntimeError):
    """An op mixing host and CUDA tensors that the real CUDA kernel refuses (see ``fake_cuda/devices.py``)."""


class Recorder(TorchDispatchMode):
    """Records host syncs, host<->device copies, foreign generators and scaled GEMMs, and refuses ops that mix
    devices as a GPU would (see the module doc).

    ``events`` is every record in call order; :meth:`count` and :meth:`of` filter them; ``launches``
    tallies the kernel-running CUDA ops per name (:meth:`launch_count` sums it); :meth:`reset` clears
    both (e.g. after a first call whose one-time copies are allowed). ``device_errors`` keeps every
    ``device_mismatch`` event until cleared by hand; ``check_devices`` turns the check on and off.
    ``overflow`` set True makes the synced CUDA values read as an overflowed step's (see :meth:`scalar`)
    until it is set back.
    """

    def __init__(self, check_devices: bool = True) -> None:
        super().__init__()
        self.events: list[Event] = []
        self.launches: collections.Counter[str] = collections.Counter()
        self.device_errors: list[Event] = []
        self.check_devices = check_devices
        self.overflow = False

    def reset(self) -> None:
        self.events.clear()
        self.launches.clear()

    def launch_count(self) -> int:
        """Kernel-running CUDA ops since the last :meth:`reset` (see the module doc)."""
        return sum(self.launches.values())

    def of(self, kind: str) -> list[Event]:
        return [e for e in self.events if e.kind == kind]

    def count(self, kind: str) -> int:
        return len(self.of(kind))

    def host_syncs(self) -> int:
        """Times the host waits for the device: scalar reads and device-to-host copies."""
        return self.count("sync") + self.count("d2h")

    def scalar(self, t: torch.Tensor) -> bool | int | float:
        """The value a synced scalar reads as: False / 0 / 0.0, i.e. no inf found, no step skipped; a host
        float whose value the fake mode lost reads as 1.0, what it is in the loops here: a step counter after
        its first increment (torch keeps Adam's ``step`` on the host; 0.0 would divide by zero in the bias
        correction). With ``overflow`` a CUDA bool reads True and a CUDA float 1.0: found_inf is set, so a
        scaler skips the step (an int, a counter, still reads 0)."""
        if t.dtype == torch.bool:
            return self.overflow and t.device.type == "cuda"
        if not (t.dtype.is_floating_point or t.dtype.is_complex):
            return 0
        return 1.0 if t.device.type == "cpu" or self.overflow else 0.0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        bound = _bind(func, args, kwargs)
        if self.check_devices:
            self._devices(func, bound)
        self._launch(func, name, bound)
        if func in _SYNC:
            if args[0].device.type == "cuda":  # only a device tensor makes the host wait
                self.events.append(Event("sync", str(func), {}))
            try:  # a host constant the fake mode kept (an optimizer's step count) reads as itself
                return func(*args, **kwargs)
            except DataDependentOutputException:
                return self.scalar(args[0])
        if name in _DATA_DEPENDENT and any(t.device.type == "cuda" for t in _tensors(args)):
            self.events.append(Event("sync", str(func), {}))
        self._copies(func, name, bound)
        if name in _RANDOM:
            self._generator(func, bound)
        if name in _SCALED_MM:
            return self._scaled_mm(func, bound, args, kwargs)
        return func(*args, **kwargs)

    def _devices(self, func: Any, bound: dict[str, Any]) -> None:
        """Raises (and keeps) a :class:`DeviceMismatch` where the CUDA kernel would refuse the devices."""
        problem = devices.mismatch(func, bound)
        if problem is None:
            return
        shapes = {k: _describe(v) for k, v in bound.items() if isinstance(v, torch.Tensor)}
        event = Event("device_mismatch", str(func), {"error": problem, "tensors": shapes})
        self.events.append(event)
        self.device_errors.append(event)
        raise DeviceMismatch(f"{func}: {problem} (fake-CUDA device check; a GPU refuses this call)")

    def _launch(self, func: Any, name: str, bound: dict[str, Any]) -> None:
        """Tallies an op that runs a kernel on a CUDA device (not a view, not a bare allocation)."""
        if func.namespace == "prim" or func.is_view or name in _NO_KERNEL:  # prim: metadata (``device``)
            return
        tensors = _tensors(list(bound.values()))
        if _target_device(bound) == "cuda" or any(t.device.type == "cuda" for t in tensors):
            self.launches[name] += 1

    def _copies(self, func: Any, name: str, bound: dict[str, Any]) -> None:
        """Records an explicit or implicit copy between the host and a CUDA device."""
        if name == "_to_copy":
            src, dst = bound["self"].device.type, _target_device({"device": bound.get("device"), **bound})
        elif name == "copy_":
            src, dst = bound["src"].device.type, bound["self"].device.type
        else:
            tensors = _tensors(list(bound.values()))
            if not any(t.device.type == "cuda" for t in tensors):
                return
            host = [t for t in tensors if t.device.type == "cpu" and t.numel() > 1]
            if not host:
                return
            src, dst = "cpu", "cuda"
        if {src, dst} == {"cpu", "cuda"}:
            kind = "h2d" if dst == "cuda" else "d2h"
            self.events.append(Event(kind, str(func), {"shapes": [tuple(t.shape) for t in _tensors(bound)]}))

    def _generator(self, func: Any, bound: dict[str, Any]) -> None:
        gen = bound.get("generator")
        if gen is None:
            return
        out, device = _target_device(bound), _generator_device(gen)
        if device != out:
            self.events.append(Event("bad_generator", str(func), {"generator": device, "out": out}))

    def _scaled_mm(self, func: Any, bound: dict[str, Any], args: tuple, kwargs: dict) -> Any:
        detail = {k: _describe(v) for k, v in bound.items() if v is not None}
        event = Event("scaled_mm", str(func), detail)
        self.events.append(event)
        try:
            return func(*args, **kwargs)
        except Exception as exc:  # the meta kernel's refusal is what a GPU would raise: keep it, re-raise
            detail["error"] = f"{type(exc).__name__}: {exc}"
            raise


def _counted_tolist(recorder: Recorder, tolist: Any) -> Any:
    """``Tensor.tolist`` counting a CUDA tensor's as one sync (one device-to-host copy on a GPU; under fake
    mode it reads element by element, a ``_local_scalar_dense`` each), answered with plausible values.
    A wrapper on FakeTensor.tolist, which reads per element (torch function modes never see it)."""

    def counted(self: torch.Tensor) -> Any:
        if self.device.type != "cuda":  # a host tensor: copied (counted there) or made on the host
            return tolist(self)
        recorder.events.append(Event("sync", "Tensor.tolist", {"shape": tuple(self.shape)}))
        out: Any = recorder.scalar(self)
        for size in reversed(self.shape):
            out = [copy.deepcopy(out) for _ in range(size)]
        return out

    return counted


@contextlib.contextmanager
def cuda_patched(capability: tuple[int, int] = (9, 0)) -> Iterator[None]:
    """``torch.cuda`` answering as a machine with one GPU of ``capability`` (for mixprec's callers)."""
    with contextlib.ExitStack() as stack:
        for attr, value in (
            ("is_available", lambda: True),
            ("get_device_capability", lambda device=None: capability),
            ("is_bf16_supported", lambda including_emulation=True: True),
            ("device_count", lambda: 1),
            ("get_device_name", lambda device=None: f"fake sm{capability[0]}{capability[1]}"),
        ):
            stack.enter_context(mock.patch.object(torch.cuda, attr, value))
        yield


_MARK = 1 << 62  # set in a FakeCudaGenerator's seed: how the recorder tells one apart from a CPU generator
_RealGenerator = torch.Generator


class FakeCudaGenerator(_RealGenerator):
    """A ``torch.Generator(device="cuda")`` on a machine without a driver: a CPU generator reporting
    ``device`` cuda, whose seed carries :data:`_MARK`. The dispatcher hands ops a plain ``Generator``
    wrapping the same C++ generator (the subclass is lost), so :class:`Recorder` reads its device from
    the marked seed: a CPU generator seeded with bit 62 set would read as CUDA there."""

    def __new__(cls, device: torch.device | str | int | None = None) -> FakeCudaGenerator:
        gen = super().__new__(cls, "cpu")
        device = torch.device("cpu" if device is None else device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", 0)
        gen._fake_device = device
        return gen.manual_seed(67280421310721)  # torch's default seed

    def __init__(self, device: torch.device | str | int | None = None) -> None:
        pass

    @property
    def device(self) -> torch.device:
        return self._fake_device

    def manual_seed(self, seed: int) -> FakeCudaGenerator:
        mark = _MARK if self._fake_device.type == "cuda" else 0
        super().manual_seed((int(seed) % _MARK) | mark)
        return self


def _generator_device(gen: torch.Generator) -> str:
    if gen.device.type == "cpu" and gen.initial_seed() & _MARK:
        return "cuda"
    return gen.device.type


class FakeCudaMode(FakeTensorMode):
    """``FakeTensorMode`` that never initialises a real device, also while ``is_available`` is patched.

    The fake mode asks ``torch.cuda.is_available()`` whether it may materialise constants on the device
    (``avoid_device_init``); with it patched to True, ``torch.tensor(..., device="cuda")`` would call
    into the CUDA driver and fail. This machine has none, so the answer is always "avoid".
    """

    @property
    def avoid_device_init(self) -> bool:
        return True


@contextlib.contextmanager
def fake_cuda(
    capability: tuple[int, int] = (9, 0), device_check: bool = True, allow_non_fake_inputs: bool = False
) -> Iterator[Recorder]:
    """A fake mode with ``torch.cuda`` patched, and a :class:`Recorder` pushed inside it.

    ``torch.Generator`` is :class:`FakeCudaGenerator` inside (a CUDA generator needs a driver), and
    FakeTensor's ``tolist`` counts one sync (see :func:`_counted_tolist`). With ``device_check`` an op a GPU
    would refuse for its devices raises :class:`DeviceMismatch`, and leaving the block normally after one
    was raised and caught raises ``AssertionError`` (clear ``recorder.device_errors`` to accept them).
    ``allow_non_fake_inputs`` lets real tensors in, e.g. a model built on the CPU before and moved by
    ``.cuda()`` inside (a module of fake CPU parameters cannot move: ``nn.Module._apply`` swaps fake
    tensors, which FakeTensor refuses).
    """
    recorder = Recorder(check_devices=device_check)
    tolist = _counted_tolist(recorder, FakeTensor.tolist)
    with (
        cuda_patched(capability),
        mock.patch.object(FakeTensor, "tolist", tolist),
        mock.patch.object(torch, "Generator", FakeCudaGenerator),
        FakeCudaMode(allow_non_fake_inputs=allow_non_fake_inputs),
        recorder,
    ):
        yield recorder
    if recorder.device_errors:
        lines = "\n".join(f"  {e.op}: {e.detail['error']}" for e in recorder.device_errors)
        raise AssertionError(f"ops a GPU refuses for their devices ran here (and were caught):\n{lines}")


@contextlib.contextmanager
def module_apply_in_place() -> Iterator[None]:
    """``nn.Module._apply`` (``.half()``, ``.to(dtype)``, a model cast) as it runs on real tensors: each
    parameter keeps its identity and gets ``param.data = fn(param)``. torch swaps a FakeTensor parameter for
    a new one instead, which fails ("Couldn't swap Linear.weight"), so a model cannot be cast under fake
    mode. A FakeTensor keeps its device outside its data, so a move between devices is refused here:
    build such a module where it runs (``with torch.device("cuda")``)."""

    def apply(self: torch.nn.Module, fn: Any, recurse: bool = True) -> torch.nn.Module:
        if recurse:
            for child in self.children():
                apply(child, fn)
        with torch.no_grad():
            for name, param in self._parameters.items():
                if param is None:
                    continue
                new = fn(param)
                if new.device != param.device:
                    raise RuntimeError(
                        f"module_apply_in_place cannot move {type(self).__name__}.{name} from {param.device} "
                        f"to {new.device}: build the module on its device (with torch.device(...))"
                    )
                param.data = new
                if param.grad is not None:
                    param.grad = fn(param.grad)
            for key, buffer in self._buffers.items():
                if buffer is not None:
                    self._buffers[key] = fn(buffer)
        return self

    with mock.patch.object(torch.nn.Module, "_apply", apply):
        yield


class Ctx:
    """A hand-made autograd ctx: ``forward(ctx, ...)`` then ``backward(ctx, grad)`` without the engine."""

    def __init__(self, needs_input_grad: tuple[bool, ...]) -> None:
        self.needs_input_grad = needs_input_grad
        self.saved_tensors: tuple[torch.Tensor, ...] = ()

    def save_for_backward(self, *tensors: torch.Tensor) -> None:
        self.saved_tensors = tensors

    def mark_non_differentiable(self, *tensors: torch.Tensor) -> None:
        pass

    def set_materialize_grads(self, value: bool) -> None:
        pass


@dataclass
class Applied:
    """One ``autograd.Function.apply`` run by :func:`direct_autograd`: the function, its ctx, its output."""

    fn: type[torch.autograd.Function]
    ctx: Ctx
    output: Any

    def backward(self, *grads: torch.Tensor) -> Any:
        """The function's ``backward(ctx, *grads)`` without grad, as autograd's engine calls it."""
        with torch.no_grad():
            return self.fn.backward(self.ctx, *grads)


@contextlib.contextmanager
def direct_autograd(*fns: type[torch.autograd.Function]) -> Iterator[list[Applied]]:
    """Each of ``fns``' ``apply`` runs ``forward`` directly with a :class:`Ctx` and is recorded.

    So a module's own ``forward`` (which calls ``Fn.apply``) runs unchanged under fake CUDA, and the test
    calls :meth:`Applied.backward` for each recorded call with a gradient of the output's shape.
    ``needs_input_grad`` is each argument's ``requires_grad``; forward runs without grad, as in autograd.
    """
    calls: list[Applied] = []

    def direct(fn: type[torch.autograd.Function]) -> Any:
        def apply(*args: Any) -> Any:
            ctx = Ctx(tuple(isinstance(a, torch.Tensor) and a.requires_grad for a in args))
            with torch.no_grad():
                out = fn.forward(ctx, *args)
            calls.append(Applied(fn, ctx, out))
            return out

        return staticmethod(apply)

    with contextlib.ExitStack() as stack:
        for fn in fns:
            stack.enter_context(mock.patch.object(fn, "apply", direct(fn)))
        yield calls
