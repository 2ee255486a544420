"""mixprec under torch.distributed: helpers for DDP and FSDP training with mixprec's scaler.

Nothing here is needed to train: ``mixprec.GradScaler`` agrees on skipping by itself (see
:class:`mixprec.scaling.skip.RankSync`), and ``mixprec.autocast`` and ``MixedPrecisionOptimizer`` are
per-process and unaffected by the wrappers. What is here:

- :func:`compression_hook`: torch's DDP gradient-compression hooks by format name, and what they do to the
  scaler (docs/distributed.md explains the fp16 overflow in the all-reduce).
- :func:`replicas_identical`: whether every rank holds bit-identical tensors, the invariant DDP relies on and
  a per-rank skip decision silently breaks.
- :func:`lowbit_allreduce_hook` / :class:`LowbitCommState`: a DDP comm hook that sends gradient buckets in
  fp8 (one scale agreed across ranks, all-gather, float32 sum) or bf16, with optional error feedback;
  :class:`LowbitReduceScatter` is the same for FSDP2 (``FSDPModule.set_custom_reduce_scatter``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from mixprec.lowbit import block_scales
from mixprec.lowbit.formats import E4M3
from mixprec.scaling.skip import agree_max

__all__ = [
    "COMPRESSION_HOOKS",
    "LOWBIT_COMM_FORMATS",
    "LowbitCommState",
    "LowbitReduceScatter",
    "compression_hook",
    "lowbit_allreduce_hook",
    "replicas_identical",
]

#: Format name -> name of the DDP comm hook in torch.distributed.algorithms.ddp_comm_hooks.default_hooks.
COMPRESSION_HOOKS: dict[str, str] = {"fp16": "fp16_compress_hook", "bf16": "bf16_compress_hook"}


def compression_hook(format: str) -> Callable[..., Any]:
    """Torch's DDP comm hook that all-reduces gradient buckets in ``format`` ("fp16" or "bf16").

    Use: ``ddp_model.register_comm_hook(None, mixprec.distributed.compression_hook("bf16"))``. Each bucket is
    cast to ``format``, divided by the world size, summed across ranks and cast back. With "fp16" a scaled
    gradient above 65504 becomes inf in the cast: the scaler sees inf on every rank, skips and backs off until
    the scaled gradients fit, so the hook caps the loss scale at about ``65504 / max|grad|``. "bf16" has
    fp32's range (no overflow) and 8 significant bits.

    Raises:
        ValueError: for another format, naming the accepted ones.
        RuntimeError: when torch.distributed is not available.
    """
    if not isinstance(format, str) or format not in COMPRESSION_HOOKS:
        raise ValueError(f"compression format must be one of {sorted(COMPRESSION_HOOKS)}, got {format!r}")
    if not dist.is_available():
        raise RuntimeError("this torch build has no torch.distributed, so no DDP comm hooks")
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return getattr(default_hooks, COMPRESSION_HOOKS[format])


def _digest(tensors: Iterable[torch.Tensor]) -> str:
    """SHA-256 of the tensors' shapes, dtypes and bytes, in order."""
    digest = hashlib.sha256()
    for tensor in tensors:
        data = tensor.detach().cpu().contiguous()
        digest.update(f"{tuple(data.shape)}{data.dtype};".encode())
        digest.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _tensor_list(tensors: object) -> list[torch.Tensor]:
    """A module's parameters then buffers, or the given iterable of tensors as a list (else TypeError)."""
    if isinstance(tensors, torch.nn.Module):
        return [*tensors.parameters(), *tensors.buffers()]
    if isinstance(tensors, Iterable) and not isinstance(tensors, (str, bytes, torch.Tensor)):
        items = list(tensors)
        if all(isinstance(t, torch.Tensor) for t in items):
            return items
    raise TypeError(
        "tensors must be an nn.Module or an iterable of tensors, "
        f"got {type(tensors).__name__}: {tensors!r:.60}"
    )


def replicas_identical(
    tensors: torch.nn.Module | Iterable[torch.Tensor], group: dist.ProcessGroup | None = None
) -> bool:
    """Whether every rank of ``group`` holds bit-identical tensors (a module's parameters and buffers).

    A collective: every rank of the group must call it. It hashes on the host (a device sync, and a copy of
    each tensor to the CPU), so it is a check for tests and debugging, not for every step. With one process,
    or without torch.distributed initialised, it is True.

    Args:
        tensors: a module (its ``parameters()`` then ``buffers()``) or tensors in the same order on each rank.
        group: the ranks to compare; None means the default group.

    Raises:
        TypeError: when ``tensors`` is neither a module nor an iterable of tensors.
    """
    tensors = _tensor_list(tensors)
    digest = _digest(tensors)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return True
    digests: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(digests, digest, group=group)
    return len(set(digests)) == 1


# -- low-bit gradient communication ------------------------------------------------------------------------

#: Formats the low-bit hooks send gradients in.
LOWBIT_COMM_FORMATS = ("fp8", "bf16")


def _all_gather_single(
    output: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool
) -> Any:
    """``dist.all_gather_single`` (torch >= 2.13), else its older name ``all_gather_into_tensor``."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, tensor, group=group, async_op=async_op)


def _check_comm_format(fmt: object) -> str:
    if not isinstance(fmt, str) or fmt not in LOWBIT_COMM_FORMATS:
        raise ValueError(
            f"low-bit communication format must be one of {list(LOWBIT_COMM_FORMATS)}, got {fmt!r}"
        )
    return fmt


class LowbitCommState:
    """The state :func:`lowbit_allreduce_hook` keeps between steps (``register_comm_hook(state, hook)``).

    Args:
        process_group: the ranks that reduce; None means the default group.
        error_feedback: add the previous step's quantization error of each bucket to its gradients before
            quantizing (residual kept per bucket index; dropped when DDP rebuilds its buckets).

    Attributes:
        residuals: bucket index -> float32 residual (with ``error_feedback``).
        bytes_sent: bytes this rank has handed to collectives (the inputs' sizes: the amax and the payload).
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None, error_feedback: bool = False) -> None:
        if not isinstance(error_feedback, bool):
            raise TypeError(f"error_feedback must be a bool, got {error_feedback!r}")
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(
                f"process_group must be a ProcessGroup or None, got {type(process_group).__name__}"
            )
        self.process_group = process_group
        self.error_feedback = error_feedback
        self.residuals: dict[int, torch.Tensor] = {}
        self.bytes_sent = 0

    def state_dict(self) -> dict[str, Any]:
        """``{"error_feedback", "residuals" (bucket index -> float32 tensor, cloned), "bytes_sent"}``.

        The process group is not saved: it belongs to the run, not to the checkpoint.
        """
        residuals = {int(k): v.detach().clone() for k, v in self.residuals.items()}
        return {"error_feedback": self.error_feedback, "residuals": residuals, "bytes_sent": self.bytes_sent}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; checked whole first, so a bad one changes nothing.

        Raises:
            ValueError: a missing key, an ``error_feedback`` other than this state's, a residual that is
                not a float32 tensor under an int key, or a negative ``bytes_sent``.
        """
        missing = {"error_feedback", "residuals", "bytes_sent"} - set(state_dict)
        if missing:
            raise ValueError(f"LowbitCommState.load_state_dict: missing keys {sorted(missing)}")
        if state_dict["error_feedback"] != self.error_feedback:
            raise ValueError(
                "LowbitCommState.load_state_dict: saved with "
                f"error_feedback={state_dict['error_feedback']!r}, "
                f"this state has error_feedback={self.error_feedback!r}"
            )
        residuals = state_dict["residuals"]
        for key, value in residuals.items():
            if isinstance(key, bool) or not isinstance(key, int):
                raise ValueError(
                    f"LowbitCommState.load_state_dict: residual key {key!r} is not a bucket index"
                )
            if not isinstance(value, torch.Tensor) or value.dtype != torch.float32:
                raise ValueError(
                    f"LowbitCommState.load_state_dict: residual {key} must be a float32 tensor, got "
                    f"{getattr(value, 'dtype', type(value).__name__)}"
                )
        sent = state_dict["bytes_sent"]
        if isinstance(sent, bool) or not isinstance(sent, int) or sent < 0:
            raise ValueError(f"LowbitCommState.load_state_dict: bytes_sent must be an int >= 0, got {sent!r}")
        self.residuals = {k: v.detach().clone() for k, v in residuals.items()}
        self.bytes_sent = sent


def _agreed_scale(grad: torch.Tensor, group: dist.ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the e4m3 scale from the MAX over the ranks of ``max|grad|``, whether that amax is finite)."""
    amax = grad.abs().max().to(torch.float32) if grad.numel() else grad.new_zeros((), dtype=torch.float32)
    amax = agree_max(amax, group)
    finite = torch.isfinite(amax)
    return block_scales.fp32_scale(torch.where(finite, amax, 1.0), E4M3, False), finite


def _encode(grad: torch.Tensor, fmt: str, scale: torch.Tensor | None) -> torch.Tensor:
    if fmt == "bf16":
        return grad.to(torch.bfloat16)
    assert scale is not None  # fp8 always has an agreed scale
    return torch.clamp(grad * scale, -E4M3.max, E4M3.max).to(torch.float8_e4m3fn)


def _decode_sum(payloads: torch.Tensor, fmt: str, scale: torch.Tensor | None, finite: torch.Tensor | None):
    """float32 sum over dim 0 of the ranks' payloads, in rank order (the same bits on every rank)."""
    total = payloads.to(torch.float32).sum(dim=0)
    if fmt == "bf16":
        return total
    assert scale is not None and finite is not None  # fp8 always has an agreed scale
    return torch.where(finite, total / scale, torch.nan)  # a non-finite gradient anywhere: nan everywhere


def _with_residual(state: LowbitCommState, index: int, grad: torch.Tensor) -> torch.Tensor:
    residual = state.residuals.get(index)
    if state.error_feedback and residual is not None and residual.shape == grad.shape:
        return grad.to(torch.float32) + residual
    return grad.to(torch.float32)


def _keep_residual(state, index, grad, payload, fmt, scale) -> None:
    if state.error_feedback:
        sent = payload.to(torch.float32) if fmt == "bf16" else payload.to(torch.float32) / scale
        state.residuals[index] = torch.nan_to_num(grad - sent, nan=0.0, posinf=0.0, neginf=0.0)


def lowbit_allreduce_hook(fmt: str) -> Callable[[LowbitCommState | None, Any], torch.futures.Future]:
    """A DDP communication hook that averages gradient buckets sent in ``fmt``.

    Use: ``ddp.register_comm_hook(LowbitCommState(error_feedback=True), lowbit_allreduce_hook("fp8"))``
    (a None state means the default group and no error feedback). Per bucket::

        g = bucket + residual                   (error feedback only)
        fp8:  amax = all_reduce(max|g|, MAX)     one scale for every rank (agree_max, as GradScaler's)
              q = e4m3(saturate(g * 448 / amax)); gathered = all_gather(q)
              out = float32 sum of gathered in rank order / scale / world size   (nan everywhere if amax
              is not finite, so a loss scaler skips on every rank)
        bf16: gathered = all_gather(bf16(g)); out = float32 sum / world size
        residual = g - dequantize(q)            (error feedback only)

    fp8 values are not summed in flight (a sum of e4m3 values is not an e4m3 value, and the reduction order
    would differ between ranks); every rank sums the same gathered bytes in the same order, so the reduced
    gradients are bitwise identical on every rank. An all-gather moves ``world_size - 1`` payloads per
    rank, a ring all-reduce about two, so at more than ~8 ranks fp8 stops saving wire bytes over a bf16
    all-reduce.

    Raises:
        ValueError: for a format other than "fp8" or "bf16".
        RuntimeError: when torch.distributed is not available.
    """
    fmt = _check_comm_format(fmt)
    if not dist.is_available():
        raise RuntimeError("this torch build has no torch.distributed, so no DDP comm hooks")

    def hook(state: LowbitCommState | None, bucket: Any) -> torch.futures.Future:
        state = state if state is not None else LowbitCommState()
        group = state.process_group
        world = dist.get_world_size(group)
        grad = _with_residual(state, bucket.index(), bucket.buffer())
        scale, finite = _agreed_scale(grad, group) if fmt == "fp8" else (None, None)
        payload = _encode(grad, fmt, scale)
        _keep_residual(state, bucket.index(), grad, payload, fmt, scale)
        state.bytes_sent += payload.numel() * payload.element_size() + (4 if fmt == "fp8" else 0)
        wire = payload.view(torch.uint8) if fmt == "fp8" else payload  # gloo has no float8 dtypes
        gathered = wire.new_empty(world * wire.numel())  # gloo wants one flat output
        work = _all_gather_single(gathered, wire, group=group, async_op=True)
        out_dtype = bucket.buffer().dtype

        def reduce(_: torch.futures.Future) -> torch.Tensor:
            payloads = (gathered.view(payload.dtype) if fmt == "fp8" else gathered).view(world, -1)
            return (_decode_sum(payloads, fmt, scale, finite) / world).to(out_dtype)

        return work.get_future().then(reduce)

    hook.__name__ = hook.__qualname__ = f"lowbit_allreduce_hook_{fmt}"
    # DDP compares the annotations with the objects; this module's are strings (postponed evaluation).
    hook.__annotations__ = {
        "state": LowbitCommState | None,
        "bucket": dist.GradBucket,
        "return": torch.futures.Future[torch.Tensor],
    }
    return hook


class LowbitReduceScatter:
    """FSDP2's reduce-scatter in ``fmt``: ``module.set_custom_reduce_scatter(LowbitReduceScatter("fp8"))``.

    torch 2.13's ``FSDPModule.set_custom_reduce_scatter`` takes any object with FSDP's ``ReduceScatter``
    shape (``allocate`` and ``__call__(output_tensor, input_tensor, group, op, async_op)``). Per call: a
    scale agreed across ``group`` (fp8), each rank's ``world_size`` chunks encoded, exchanged with one
    all-to-all, and the received chunks summed in float32 in rank order into ``output_tensor``; ``op``
    AVG divides by the world size, SUM does not (FSDP divides before / after itself then). The call is
    synchronous. ``bytes_sent`` counts the payload and amax bytes handed to the collectives.

    Raises:
        ValueError: for another format, or (at a reduce-scatter) an ``op`` other than SUM or AVG, e.g. the
            PREMUL_SUM FSDP picks for a custom ``set_gradient_divide_factor``.
    """

    def __init__(self, fmt: str) -> None:
        self.fmt = _check_comm_format(fmt)
        self.bytes_sent = 0

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> None:
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise ValueError(
                f"LowbitReduceScatter reduces with SUM or AVG, got {op!r}; drop set_gradient_divide_factor "
                "or call set_force_sum_reduction_for_comms(True)"
            )
        world = dist.get_world_size(group)
        grad = input_tensor.to(torch.float32)
        scale, finite = _agreed_scale(grad, group) if self.fmt == "fp8" else (None, None)
        payload = _encode(grad, self.fmt, scale)
        wire = payload.view(torch.uint8) if self.fmt == "fp8" else payload
        received = torch.empty_like(wire)
        dist.all_to_all_single(received, wire, group=group)
        self.bytes_sent += wire.numel() * wire.element_size() + (4 if self.fmt == "fp8" else 0)
        payloads = received.view(payload.dtype).view(world, -1)
        total = _decode_sum(payloads, self.fmt, scale, finite)
        output_tensor.copy_(total / world if op == dist.ReduceOp.AVG else total)
