"""mixprec under a real process group: DDP and FSDP2 train a few steps on one rank (NCCL on a GPU).

One process is rank 0 of a world of 1, initialised from ``MASTER_ADDR=127.0.0.1``, a free
``MASTER_PORT``, ``RANK=0`` and ``WORLD_SIZE=1`` (``env://``), with NCCL on ``--device cuda`` and gloo on
``--device cpu`` (the dry run of ``benchmarks/gpu.sh``). On one rank every collective still runs (NCCL
launches its kernels, the comm hooks encode and decode), so this is the first time the code paths that
only NCCL takes (device-side all-reduce of the scaler's ``found_inf``, uint8 all-gathers, all-to-all)
run at all. Cases, each ``--steps`` steps on a fixed batch (so the loss must fall):

- ``ddp_amp``: ``DistributedDataParallel`` of an MLP under ``mixprec.autocast`` (fp16) with
  ``mixprec.GradScaler`` (``sync="auto"``: on one rank it has no one to agree with), beside a twin
  trained alone with the same code and no process group: on one rank DDP's averaged gradient is the
  rank's own (NCCL's all-reduce of one buffer, divided by 1), so the twin's losses and parameters must
  agree: bitwise is expected and reported, within ``TOLERANCE`` relative passes (a kernel that is not
  deterministic run to run should not fail the check).
- ``ddp_fp8_comm``: the same DDP model with ``mixprec.distributed.lowbit_allreduce_hook("fp8")`` and error
  feedback: the gradients travel as e4m3 with one scale (``bytes_sent`` counted), the loss falls and
  ends near the twin's.
- ``fsdp2_fp8``: ``fully_shard`` (each Linear, then the root) of a model converted by
  ``mixprec.float8.convert_to_float8_training`` with ``enable_fsdp_float8_all_gather=True`` under a
  bf16 ``MixedPrecisionPolicy``, scales precomputed after each step with one all-reduce
  (``precompute_float8_dynamic_scale_for_fsdp``): the loss falls and every Linear computes with the
  fp8 all-gather's output (``Float8GatheredWeight``, seen by a forward pre-hook after FSDP2's unshard).
  The gradients go through ``mixprec.distributed.LowbitReduceScatter("fp8")`` where this torch has
  ``set_custom_reduce_scatter``; FSDP2 (torch 2.13) copies instead of reduce-scattering on a world of
  1, and may all-gather by a copy too, so what one rank checks is the fp8 cast on both sides of the
  all-gather and the scale's all-reduce, not NCCL moving fp8 bytes between GPUs.

Each case's row (losses, checks, passed, or the error that stopped it) is written to ``--json`` as soon
as it ends (``benchmarks/checkpoint.py``: atomic, ``"partial"`` until the last one, also on SIGTERM); a
case that raises is recorded and the next one runs. Exit code 1 when a case failed.

Usage::

    python benchmarks/gpu_distributed.py --device cuda --json distributed.json
    python benchmarks/gpu_distributed.py --device cpu        # gloo, tiny: what gpu.sh --dry-run runs
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec.distributed import LowbitCommState, LowbitReduceScatter, lowbit_allreduce_hook
from mixprec.float8 import Float8Config, convert_to_float8_training
from mixprec.float8.fsdp import precompute_float8_dynamic_scale_for_fsdp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoint import STOPPED, stop_on_sigterm, write_json  # a sibling script, not a package

#: DDP on one rank against its twin: relative difference of the parameters allowed (reported exactly).
TOLERANCE = 1e-6
#: (width, layers, batch) of the models: a few ms a step on a GPU, well under a second on a CPU.
SIZES = {"cuda": (1024, 4, 256), "cpu": (64, 2, 32)}
CASES = ("ddp_amp", "ddp_fp8_comm", "fsdp2_fp8")


def free_port() -> int:
    """A TCP port nothing listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def one_rank_group(device: torch.device) -> Iterator[str]:
    """Rank 0 of a world of 1 (NCCL on CUDA, gloo on a CPU) from the ``env://`` variables (set for the
    rendezvous only, then as they were); yields the backend's name and destroys the group at the end."""
    rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1"}
    before = {key: os.environ.get(key) for key in rendezvous}
    backend = "nccl" if device.type == "cuda" else "gloo"
    extra: dict[str, Any] = {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        extra["device_id"] = device  # NCCL's communicator is made now, not at the first collective
    os.environ.update(rendezvous)
    try:
        dist.init_process_group(backend, init_method="env://", timeout=timedelta(seconds=60), **extra)
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    try:
        yield backend
    finally:
        dist.destroy_process_group()


def mlp(width: int, layers: int, device: torch.device, seed: int = 0) -> nn.Sequential:
    """``layers`` x (Linear(width, width), GELU) then Linear(width, 16): the same weights for a seed."""
    torch.manual_seed(seed)
    body: list[nn.Module] = []
    for _ in range(layers):
        body += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*body, nn.Linear(width, 16)).to(device)


def batch(width: int, size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed batch and its classes: training on it must lower the loss step after step."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(size, width, generator=gen)
    return x.to(device), (x[:, :16].argmax(1)).to(device)


def train_amp(
    model: nn.Module, data: tuple[torch.Tensor, torch.Tensor], steps: int, sync: bool | str
) -> list[float]:
    """fp16 autocast + GradScaler + SGD, as a user writes it; the loss of each step."""
    x, y = data
    device = x.device.type
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = mixprec.GradScaler(device, init_scale=2.0**10, sync=sync)
    losses = []
    for _ in range(steps):
        with mixprec.autocast(device, dtype=torch.float16):
            loss = F.cross_entropy(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _falls(losses: list[float]) -> bool:
    return all(map(torch.isfinite, torch.tensor(losses))) and losses[-1] < losses[0]


def _largest_difference(a: nn.Module, b: nn.Module) -> tuple[float, bool]:
    """The largest |a - b| over the parameters relative to the largest |b|, and whether all are equal."""
    pairs = list(zip(a.parameters(), b.parameters(), strict=True))
    diff = max((p.detach() - q.detach()).abs().max().item() for p, q in pairs)
    scale = max(q.detach().abs().max().item() for _, q in pairs)
    return diff / scale, all(torch.equal(p, q) for p, q in pairs)


def ddp_amp(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    width, layers, size = SIZES[device.type]
    data = batch(width, size, device)
    model = mlp(width, layers, device)
    twin = copy.deepcopy(model)
    ddp = DDP(model, device_ids=[device.index or 0] if device.type == "cuda" else None)
    losses = train_amp(ddp, data, args.steps, sync="auto")
    alone = train_amp(twin, data, args.steps, sync=False)
    difference, bitwise = _largest_difference(model, twin)
    loss_difference = max(abs(a - b) / abs(b) for a, b in zip(losses, alone, strict=True))
    checks = {
        "losses_fall": _falls(losses),
        "losses_match_twin": loss_difference <= TOLERANCE,
        "params_match_twin": difference <= TOLERANCE,
    }
    return {"losses": losses, "twin_losses": alone, "loss_rel_diff": loss_difference,
            "param_rel_diff": difference, "bitwise": bitwise, "checks": checks}  # fmt: skip


def ddp_fp8_comm(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    width, layers, size = SIZES[device.type]
    data = batch(width, size, device)
    model = mlp(width, layers, device)
    twin = copy.deepcopy(model)
    ddp = DDP(model, device_ids=[device.index or 0] if device.type == "cuda" else None)
    state = LowbitCommState(error_feedback=True)
    ddp.register_comm_hook(state, lowbit_allreduce_hook("fp8"))
    losses = train_amp(ddp, data, args.steps, sync="auto")
    alone = train_amp(twin, data, args.steps, sync=False)
    numel = sum(p.numel() for p in model.parameters())
    checks = {
        "losses_fall": _falls(losses),
        "near_twin": abs(losses[-1] - alone[-1]) <= 0.1 * abs(alone[0] - alone[-1]) + 1e-3,
        "fp8_on_the_wire": 0 < state.bytes_sent < 2 * numel * args.steps,  # ~1 byte per gradient element
    }
    return {"losses": losses, "twin_losses": alone, "bytes_sent": state.bytes_sent, "grad_numel": numel,
            "checks": checks}  # fmt: skip


def fsdp2_fp8(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    width, layers, size = SIZES[device.type]
    x, y = batch(width, size, device)
    model = mlp(width, layers, device)
    convert_to_float8_training(model, config=Float8Config(enable_fsdp_float8_all_gather=True))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    scatters: list[LowbitReduceScatter] = []
    linears = [m for m in model if isinstance(m, nn.Linear)]
    for module in [*linears, model]:
        fully_shard(module, mp_policy=policy)
        if hasattr(module, "set_custom_reduce_scatter"):  # torch's hook for it; a world of 1 skips it
            scatters.append(LowbitReduceScatter("fp8"))
            module.set_custom_reduce_scatter(scatters[-1])
    # What each Linear computes with, after FSDP2's pre-forward unshard (registered after it, so run
    # after it): the fp8 all-gather's output, not a bf16 weight.
    weights: set[str] = set()
    for linear in linears:
        linear.register_forward_pre_hook(lambda module, _: weights.add(type(module.weight).__name__))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    precompute_float8_dynamic_scale_for_fsdp(model)
    losses = []
    for _ in range(args.steps):
        loss = F.cross_entropy(model(x).float(), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        precompute_float8_dynamic_scale_for_fsdp(model)
        losses.append(loss.item())
    checks = {"losses_fall": _falls(losses), "fp8_all_gather": weights == {"Float8GatheredWeight"}}
    return {"losses": losses, "unsharded_weights": sorted(weights),
            "reduce_scatter_bytes": sum(s.bytes_sent for s in scatters), "checks": checks}  # fmt: skip


RUNS: dict[str, Callable[[argparse.Namespace, torch.device], dict[str, Any]]] = {
    "ddp_amp": ddp_amp,
    "ddp_fp8_comm": ddp_fp8_comm,
    "fsdp2_fp8": fsdp2_fp8,
}


def run_case(name: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """One case's row: what it measured and whether every check held, or the error that stopped it."""
    start = time.perf_counter()
    try:
        row = {"case": name, **RUNS[name](args, device)}
        row["passed"] = all(row["checks"].values())
    except Exception as exc:  # one broken case must not hide the others
        lines = traceback.format_exception(exc)
        row = {
            "case": name,
            "passed": False,
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": lines[-6:],
        }
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    row["seconds"] = round(time.perf_counter() - start, 2)
    return row


def _print(row: dict[str, Any]) -> None:
    if "error" in row:
        print(f"{row['case']:14} FAILED: {row['error']}", flush=True)
        return
    failed = [k for k, ok in row["checks"].items() if not ok]
    verdict = "ok" if row["passed"] else f"FAILED ({', '.join(failed)})"
    losses = row["losses"]
    print(f"{row['case']:14} loss {losses[0]:.4f} -> {losses[-1]:.4f} in {len(losses)} steps, "
          f"{row['seconds']:.1f} s; {verdict}", flush=True)  # fmt: skip


def _nccl_version() -> str | None:
    """NCCL's version as torch reports it (a tuple in recent builds), or None where it cannot say."""
    try:
        version = torch.cuda.nccl.version()
    except Exception:  # a build without NCCL: the group's own error says more
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=8, help="training steps per case (default 8)")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {list(CASES)}")
    parser.add_argument("--json", help="write the rows here, after each case")
    args = parser.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        parser.error(f"unknown cases {unknown}; accepted: {list(CASES)}")
    if args.steps < 2:
        parser.error(
            f"--steps must be >= 2 (the loss must fall between the first and the last), got {args.steps}"
        )
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    stop_on_sigterm()
    meta = {"device": str(device), "torch": torch.__version__, "world_size": 1, "steps": args.steps}
    if device.type == "cuda":
        meta.update(gpu=torch.cuda.get_device_name(device), nccl=_nccl_version())
    rows: list[dict[str, Any]] = []
    write_json(args.json, {"meta": meta, "rows": rows}, "running: starting the process group")
    try:
        with one_rank_group(device) as backend:
            meta["backend"] = backend
            print(f"{backend}, 1 rank on {meta.get('gpu', device)}, torch {torch.__version__}", flush=True)
            for index, name in enumerate(cases, 1):
                rows.append(run_case(name, args, device))
                _print(rows[-1])
                done = None if index == len(cases) else f"running: {index} of {len(cases)} cases"
                write_json(args.json, {"meta": meta, "rows": rows}, done)
    except KeyboardInterrupt as exc:
        why = STOPPED if str(exc) == STOPPED else "interrupted"
        write_json(args.json, {"meta": meta, "rows": rows}, f"{why} after {len(rows)} of {len(cases)} cases")
        return 124
    except Exception as exc:  # the process group itself did not come up: say so in the file
        meta["error"] = f"{type(exc).__name__}: {exc}"
        write_json(args.json, {"meta": meta, "rows": rows}, None)
        print(f"gpu_distributed: {meta['error']}", file=sys.stderr)
        return 1
    return 0 if all(r["passed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
