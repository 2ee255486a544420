"""Scenarios run by dist_harness.run_ranks: ``python dist_scenarios.py NAME WORLD_SIZE OUT_DIR RANK``.

Each rank joins a gloo group through a FileStore in OUT_DIR, runs the scenario and saves a dict of results
to OUT_DIR/rank{RANK}.pt; the tests compare the ranks' dicts.
"""

from __future__ import annotations

import copy
import datetime
import gc
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import mixprec
from mixprec.distributed import compression_hook, replicas_identical

INF = float("inf")
TIMEOUT = datetime.timedelta(seconds=60)
Result = dict[str, Any]


@contextmanager
def counting_all_reduce() -> Iterator[list[int]]:
    """Count calls of torch.distributed.all_reduce (what the scaler's sync uses) inside the block."""
    count = [0]
    original = dist.all_reduce

    def counted(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return original(*args, **kwargs)

    dist.all_reduce = counted
    try:
        yield count
    finally:
        dist.all_reduce = original


def snapshot(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def changed(before: list[torch.Tensor], module: torch.nn.Module) -> bool:
    return any(not torch.equal(b, p.detach()) for b, p in zip(before, module.parameters(), strict=True))


# -- (1) and (4): every rank owns different parameters (ZeRO-like); only rank 1 sees an inf ------------------


def _shard(rank: int) -> torch.nn.Linear:
    torch.manual_seed(100 + rank)
    return torch.nn.Linear(4, 3)


def _sharded_step(
    rank: int, scaler: mixprec.GradScaler, make_optimizer: Callable[[Any], torch.optim.Optimizer]
) -> Result:
    model = _shard(rank)
    optimizer = make_optimizer(model.parameters())
    results: Result = {}
    for step, poison in enumerate((True, False)):
        scaler.scale(model(torch.ones(2, 4)).square().mean()).backward()
        if poison and rank == 1:
            model.weight.grad[0, 0] = INF
        before = snapshot(model)
        with counting_all_reduce() as collectives:
            scaler.step(optimizer)
            scaler.update()
        optimizer.zero_grad()
        results[f"stepped{step}"] = changed(before, model)
        results[f"scale{step}"] = scaler.get_scale()
        results[f"collectives{step}"] = collectives[0]
    results["skipped_steps"] = scaler.skipped_steps
    return results


def _two_optimizers(rank: int, group: dist.ProcessGroup) -> Result:
    """Inf in optimizer b's gradients on rank 1 only: a steps everywhere, b skips everywhere."""
    model_a, model_b = _shard(rank), _shard(rank + 10)
    opt_a = torch.optim.SGD(model_a.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(model_b.parameters(), lr=0.1)
    scaler = mixprec.GradScaler(process_group=group)
    x = torch.ones(2, 4)
    scaler.scale(model_a(x).sum() + model_b(x).sum()).backward()
    if rank == 1:
        model_b.bias.grad[1] = float("nan")
    before_a, before_b = snapshot(model_a), snapshot(model_b)
    with counting_all_reduce() as collectives:
        scaler.unscale_(opt_a)
        scaler.step(opt_a)
        scaler.step(opt_b)
        scaler.update()
    return {
        "a_stepped": changed(before_a, model_a),
        "b_stepped": changed(before_b, model_b),
        "scale": scaler.get_scale(),
        "collectives": collectives[0],
    }


def _unscale_without_step(rank: int, sync: bool) -> Result:
    """unscale_() then update() with no step(): update() agrees on that optimizer's found_inf."""
    model = _shard(rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = mixprec.GradScaler(sync=sync)
    scaler.scale(model(torch.ones(2, 4)).sum()).backward()
    if rank == 1:
        model.weight.grad[2, 3] = -INF
    with counting_all_reduce() as collectives:
        scaler.unscale_(optimizer)
        scaler.update()
    return {"scale": scaler.get_scale(), "collectives": collectives[0]}


def _master_weights(rank: int, sync: bool) -> Result:
    """MixedPrecisionOptimizer with bf16 model params: its internal scaler agrees across ranks too."""
    model = _shard(rank).to(torch.bfloat16)
    scaler = mixprec.GradScaler(sync=sync)
    optimizer = mixprec.MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), scaler=scaler)
    optimizer.backward(model(torch.ones(2, 4, dtype=torch.bfloat16)).float().sum())
    if rank == 1:
        model.weight.grad[0, 1] = INF
    before = snapshot(model)
    optimizer.step()
    return {"stepped": changed(before, model), "scale": optimizer.loss_scale}


def _default_scaler_of_master_optimizer(rank: int) -> Result:
    """MixedPrecisionOptimizer(scaler="dynamic") builds its own GradScaler: sync='auto' covers it."""
    model = _shard(rank).to(torch.bfloat16)
    optimizer = mixprec.MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    optimizer.backward(model(torch.ones(2, 4, dtype=torch.bfloat16)).float().sum())
    if rank == 1:
        model.weight.grad[1, 1] = INF
    before = snapshot(model)
    optimizer.step()
    return {"stepped": changed(before, model), "scale": optimizer.loss_scale}


def _headroom(rank: int, sync: bool) -> Result:
    """HeadroomScale grows from amax: with sync the ranks use the largest amax and keep equal scales."""
    model = _shard(rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = mixprec.GradScaler(init_scale=1.0, growth="headroom", sync=sync)
    x = torch.full((2, 4), 1e-4 if rank == 0 else 10.0)
    scaler.scale(model(x).sum()).backward()
    with counting_all_reduce() as collectives:
        scaler.step(optimizer)
        scaler.update()
    return {"scale": scaler.get_scale(), "collectives": collectives[0]}


def sharded(rank: int, world_size: int) -> Result:
    group = dist.new_group(list(range(world_size)))
    sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    fused_adam = lambda params: torch.optim.Adam(params, lr=0.1, fused=True)  # noqa: E731
    return {
        "sync": _sharded_step(rank, mixprec.GradScaler(), sgd),
        "nosync": _sharded_step(rank, mixprec.GradScaler(sync=False), sgd),
        "fused": _sharded_step(rank, mixprec.GradScaler(), fused_adam),
        "fused_nosync": _sharded_step(rank, mixprec.GradScaler(sync=False), fused_adam),
        "two_optimizers": _two_optimizers(rank, group),
        "unscale_only": _unscale_without_step(rank, sync=True),
        "unscale_only_nosync": _unscale_without_step(rank, sync=False),
        "master": _master_weights(rank, sync="auto"),
        "master_nosync": _master_weights(rank, sync=False),
        "master_default_scaler": _default_scaler_of_master_optimizer(rank),
        "headroom": _headroom(rank, sync="auto"),
        "headroom_nosync": _headroom(rank, sync=False),
        "agree_max": _agree_max(rank, group),
    }


def _agree_max(rank: int, group: dist.ProcessGroup) -> Result:
    """mixprec's one rank agreement on its own: rank 1 holds the larger value of the first entry and a nan."""
    from mixprec.scaling.skip import agree_max

    values = torch.tensor([1.0, 2.0, 0.0]) if rank == 0 else torch.tensor([3.0, 1.0, float("nan")])
    with counting_all_reduce() as calls:
        agreed = agree_max(values, group)
    return {"agreed": agreed.tolist(), "given": values.tolist(), "collectives": calls[0]}


# -- (2) DDP ------------------------------------------------------------------------------------------------


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(16, 12, generator=generator)
    return x, (x[:, :4].sum(1) > 0).long() + (x[:, 4] > 0.5).long()


def _mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))


def _train_autocast(
    model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, sync: bool | str = "auto"
) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = mixprec.GradScaler(init_scale=2.0**12, growth_interval=2, sync=sync)
    scales = []
    for _ in range(steps):
        with mixprec.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        scales.append(scaler.get_scale())
    return scales


def _compression(rank: int, world_size: int, format: str | None) -> Result:
    """fp32 model, a scale big enough that scaled gradients exceed fp16's range, optional DDP compression."""
    model = DDP(_mlp())
    if format is not None:
        model.register_comm_hook(None, compression_hook(format))
    x, y = _data()
    local = slice(rank * 16 // world_size, (rank + 1) * 16 // world_size)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = mixprec.GradScaler(init_scale=2.0**24)
    skipped = []
    for _ in range(12):
        scaler.scale(F.cross_entropy(model(x[local]), y[local])).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        skipped.append(scaler.last_step_skipped)
    return {"skipped": skipped, "scale": scaler.get_scale(), "identical": replicas_identical(model)}


def _ddp_master_weights(rank: int, world_size: int) -> Result:
    """fp16 model under DDP, fp32 masters; a nan batch on rank 1 reaches every rank through the all-reduce."""
    model = DDP(_mlp().to(torch.float16))
    optimizer = mixprec.MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _data()
    local = slice(rank * 16 // world_size, (rank + 1) * 16 // world_size)
    skipped = []
    for step in range(4):
        xs = x[local].half()
        if step == 2 and rank == 1:
            xs[0, 0] = float("nan")
        optimizer.backward(F.cross_entropy(model(xs).float(), y[local]))
        optimizer.step()
        optimizer.zero_grad()
        skipped.append(optimizer.scaler.last_step_skipped)
    return {"skipped": skipped, "identical": replicas_identical(model), "scale": optimizer.loss_scale}


def ddp(rank: int, world_size: int) -> Result:
    x, y = _data()
    local = slice(rank * 16 // world_size, (rank + 1) * 16 // world_size)
    model = _mlp()
    reference = copy.deepcopy(model)
    scales = _train_autocast(DDP(model), x[local], y[local], steps=6)
    result: Result = {
        "params": snapshot(model),
        "scales": scales,
        "identical": replicas_identical(model),
        "master": _ddp_master_weights(rank, world_size),
        "compress_none": _compression(rank, world_size, None),
        "compress_fp16": _compression(rank, world_size, "fp16"),
    }
    if rank == 0:  # one process, the whole batch, no DDP; sync=False: rank 1 takes no part
        result["reference_scales"] = _train_autocast(reference, x, y, steps=6, sync=False)
        result["reference"] = snapshot(reference)
    return result


# -- (3) FSDP ----------------------------------------------------------------------------------------------


def _fsdp1(rank: int, sync: bool) -> Result:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = FSDP(_mlp(), device_id=torch.device("cpu"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = mixprec.GradScaler(sync=sync)
    x, y = _data()
    local = slice(rank * 8, rank * 8 + 8)
    stepped, scales = [], []
    for step in range(3):
        with mixprec.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x[local]).float(), y[local])
        scaler.scale(loss).backward()
        if step == 1 and rank == 1:
            next(model.parameters()).grad[-1] = INF  # an inf in rank 1's shard of the flat parameter
        before = snapshot(model)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        stepped.append(changed(before, model))
        scales.append(scaler.get_scale())
    return {"stepped": stepped, "scales": scales, "shard_numel": next(model.parameters()).numel()}


def _fsdp2(rank: int, fused: bool) -> Result:
    from torch.distributed.fsdp import fully_shard

    model = _mlp()
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, fused=fused)
    scaler = mixprec.GradScaler()
    x, y = _data()
    local = slice(rank * 8, rank * 8 + 8)
    stepped, scales = [], []
    for step in range(3):
        with mixprec.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x[local]).float(), y[local])
        scaler.scale(loss).backward()
        if step == 1 and rank == 1:
            model[2].bias.grad.to_local()[0] = INF  # rank 1's shard of the last bias
        before = [p.to_local().clone() for p in model.parameters()]
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        after = [p.to_local() for p in model.parameters()]
        stepped.append(any(not torch.equal(b, a) for b, a in zip(before, after, strict=True)))
        scales.append(scaler.get_scale())
    return {"stepped": stepped, "scales": scales}


def fsdp(rank: int, world_size: int) -> Result:
    result: Result = {
        "fsdp1": _fsdp1(rank, sync=True),
        "fsdp1_nosync": _fsdp1(rank, sync=False),
        "fsdp2": _fsdp2(rank, fused=False),
        "fsdp2_fused": _fsdp2(rank, fused=True),
    }
    return result


# -- low-bit gradient communication (issue 30 item 3) -----------------------------------------------------


def _lowbit_grads(rank: int, world_size: int, fmt: str | None) -> Result:
    """One DDP backward on rank-local data: the reduced gradients, with the hook or plain fp32."""
    from mixprec.distributed import LowbitCommState, lowbit_allreduce_hook

    model = DDP(_mlp(), bucket_cap_mb=0.001)  # several buckets
    state = LowbitCommState()
    if fmt is not None:
        model.register_comm_hook(state, lowbit_allreduce_hook(fmt))
    torch.manual_seed(10 + rank)
    x, y = torch.randn(8, 12) * (1 + 3 * rank), torch.randint(0, 3, (8,))
    F.cross_entropy(model(x), y).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    return {"grads": grads, "bytes": state.bytes_sent, "numel": sum(g.numel() for g in grads)}


def _lowbit_train(rank: int, world_size: int, fmt: str | None, feedback: bool) -> Result:
    from mixprec.distributed import LowbitCommState, lowbit_allreduce_hook

    model = DDP(_mlp())
    state = LowbitCommState(error_feedback=feedback)
    if fmt is not None:
        model.register_comm_hook(state, lowbit_allreduce_hook(fmt))
    x, y = _data()
    local = slice(rank * 16 // world_size, (rank + 1) * 16 // world_size)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    losses = []
    for _ in range(40):
        loss = F.cross_entropy(model(x[local]), y[local])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():
        full = F.cross_entropy(model(x), y).item()
    return {
        "losses": losses,
        "full": full,
        "identical": replicas_identical(model),
        "residuals": len(state.residuals),
    }


def _lowbit_nonfinite(rank: int) -> Result:
    from mixprec.distributed import lowbit_allreduce_hook

    model = DDP(_mlp())
    model.register_comm_hook(None, lowbit_allreduce_hook("fp8"))
    x = torch.randn(4, 12)
    if rank == 1:
        x[0, 0] = INF
    model(x).sum().backward()
    return {"finite": [bool(torch.isfinite(p.grad).all()) for p in model.parameters()]}


def _lowbit_fsdp2(rank: int, world_size: int, fmt: str | None) -> Result:
    from torch.distributed.fsdp import fully_shard

    from mixprec.distributed import LowbitReduceScatter

    model = _mlp()
    comms = []
    for module in (model[0], model[2], model):
        fully_shard(module)
        if fmt is not None:
            comms.append(LowbitReduceScatter(fmt))
            module.set_custom_reduce_scatter(comms[-1])
    torch.manual_seed(10 + rank)
    x, y = torch.randn(8, 12) * (1 + 3 * rank), torch.randint(0, 3, (8,))
    F.cross_entropy(model(x), y).backward()
    return {
        "grads": [p.grad.full_tensor().clone() for p in model.parameters()],
        "bytes": sum(c.bytes_sent for c in comms),
    }


def lowbit_comm(rank: int, world_size: int) -> Result:
    return {
        "grads_fp32": _lowbit_grads(rank, world_size, None),
        "grads_fp8": _lowbit_grads(rank, world_size, "fp8"),
        "grads_bf16": _lowbit_grads(rank, world_size, "bf16"),
        "train_fp32": _lowbit_train(rank, world_size, None, False),
        "train_fp8": _lowbit_train(rank, world_size, "fp8", False),
        "train_fp8_ef": _lowbit_train(rank, world_size, "fp8", True),
        "train_bf16": _lowbit_train(rank, world_size, "bf16", False),
        "nonfinite": _lowbit_nonfinite(rank),
        "fsdp2_fp32": _lowbit_fsdp2(rank, world_size, None),
        "fsdp2_fp8": _lowbit_fsdp2(rank, world_size, "fp8"),
        "fsdp2_bf16": _lowbit_fsdp2(rank, world_size, "bf16"),
    }


def _ddp_steps(state: Any, steps: int, seed: int = 0) -> list[torch.Tensor]:
    """``steps`` SGD steps of a small DDP model with the fp8 hook and ``state``: the gradient of each."""
    from mixprec.distributed import lowbit_allreduce_hook

    torch.manual_seed(seed)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)))
    model.register_comm_hook(state, lowbit_allreduce_hook("fp8"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for step in range(steps):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 + step))
        optimizer.zero_grad()
        model(x).square().mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        optimizer.step()
    return grads


def _comm_state_round_trip() -> Result:
    """Error-feedback residuals saved after 2 steps, loaded into fresh states, and the next step of each."""
    from mixprec.distributed import LowbitCommState

    state = LowbitCommState(error_feedback=True)
    _ddp_steps(state, 2)
    saved = state.state_dict()
    fresh = LowbitCommState(error_feedback=True)
    fresh.load_state_dict(saved)
    saved["residuals"][0].add_(1.0)  # the loaded state must hold its own copy
    same = LowbitCommState(error_feedback=True)
    same.load_state_dict(state.state_dict())
    return {
        "residuals": dict(state.residuals),
        "bytes_sent": state.bytes_sent,
        "fresh_residuals": dict(fresh.residuals),
        "fresh_bytes_sent": fresh.bytes_sent,
        "mutated_saved": saved["residuals"][0],
        "next_grad": _ddp_steps(state, 1, seed=1)[0],
        "next_grad_loaded": _ddp_steps(same, 1, seed=1)[0],
    }


def _gather_fallback() -> Result:
    """The fp8 hook where torch lacks ``dist.all_gather_single`` (before 2.13): ``all_gather_into_tensor``."""
    from mixprec.distributed import LowbitCommState, lowbit_allreduce_hook

    single = getattr(dist, "all_gather_single", None)
    older = dist.all_gather_into_tensor
    calls = [0]

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return older(*args, **kwargs)

    if single is not None:
        del dist.all_gather_single
    dist.all_gather_into_tensor = counted
    try:
        torch.manual_seed(0)
        model = DDP(torch.nn.Linear(8, 4))
        state = LowbitCommState()
        model.register_comm_hook(state, lowbit_allreduce_hook("fp8"))
        model(torch.randn(5, 8)).square().sum().backward()
    finally:
        dist.all_gather_into_tensor = older
        if single is not None:
            dist.all_gather_single = single
    return {
        "bytes_sent": state.bytes_sent,
        "calls": calls[0],
        "finite": [bool(torch.isfinite(p.grad).all()) for p in model.parameters()],
    }


def lowbit_comm_one_rank(rank: int, world_size: int) -> Result:
    """The checks that need a process group but not a peer, kept out of the test process: a gloo group
    created and destroyed in pytest's own process once left a later test hanging in CI."""
    return {"round_trip": _comm_state_round_trip(), "gather_fallback": _gather_fallback()}


# -- low-bit optimizer state resharded: saved on 2 FSDP2 ranks, loaded on 2 and on 1 (issue 30 item 1) -----


def _reshard_model(sharded: bool) -> torch.nn.Module:
    """Shard offsets 384 and 96 values into the weights: not block-aligned, so the saved grid matters."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 24), torch.nn.Tanh(), torch.nn.Linear(24, 8))
    model = model.to(torch.bfloat16)
    if sharded:
        for module in (model[0], model[2], model):
            fully_shard(module)
    return model


def _reshard_optimizer(model: torch.nn.Module, kind: str, fmt: str | None) -> Any:
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if kind == "kahan":
        return mixprec.CompensatedOptimizer(inner, "kahan", state_format=fmt)
    return mixprec.MixedPrecisionOptimizer(inner, scaler=None, state_format=fmt)


def _reshard_train(model: torch.nn.Module, optimizer: Any, steps: range) -> None:
    """The same batch on every rank: FSDP2's averaged gradient is then exactly the one-process gradient."""
    for step in steps:
        torch.manual_seed(1000 + step)
        x, y = torch.randn(8, 32).to(torch.bfloat16), torch.randn(8, 8)
        F.mse_loss(model(x).float(), y).backward()
        optimizer.step()
        optimizer.zero_grad()


def _whole(model: torch.nn.Module) -> list[torch.Tensor]:
    return [
        (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in model.parameters()
    ]


def _set_whole(model: torch.nn.Module, weights: list[torch.Tensor]) -> None:
    from torch.distributed.tensor import distribute_tensor

    with torch.no_grad():
        for param, weight in zip(model.parameters(), weights, strict=True):
            if hasattr(param, "device_mesh"):
                param.to_local().copy_(
                    distribute_tensor(weight, param.device_mesh, param.placements).to_local()
                )
            else:
                param.copy_(weight)


def _reshard_case(kind: str, fmt: str | None) -> Result:
    from mixprec.optim import full_state_dict, load_full_state_dict

    model = _reshard_model(sharded=True)
    optimizer = _reshard_optimizer(model, kind, fmt)
    before = [p._version for p in model.parameters()]
    _reshard_train(model, optimizer, range(3))
    saved, weights = full_state_dict(optimizer), _whole(model)
    after = [p._version for p in model.parameters()]
    _reshard_train(model, optimizer, range(3, 5))
    result: Result = {"reference": _whole(model), "weights": weights, "versions": (before, after)}
    origins = saved["optimizer"]["state"][0].get("block_origins")  # the first weight's saved grid
    result["origins"] = None if origins is None else origins.tolist()
    for name, sharded in (("two", True), ("one", False)):
        resumed = _reshard_model(sharded)
        _set_whole(resumed, weights)
        again = _reshard_optimizer(resumed, kind, fmt)
        load_full_state_dict(again, saved)
        _reshard_train(resumed, again, range(3, 5))
        result[name] = _whole(resumed)
    other = "fp8" if fmt != "fp8" else "int8"
    refused = _reshard_optimizer(_reshard_model(sharded=True), kind, other)
    try:
        load_full_state_dict(refused, saved)
        result["other_format"] = "loaded"
    except ValueError as error:
        result["other_format"] = str(error)
    result["other_format_state"] = len(refused.state)
    if fmt in ("int8", "fp8"):  # a one-process state has one grid, which rank 1's shard start would cut
        single = _reshard_model(sharded=False)
        alone = _reshard_optimizer(single, kind, fmt)
        _reshard_train(single, alone, range(1))
        target = _reshard_optimizer(_reshard_model(sharded=True), kind, fmt)
        try:
            load_full_state_dict(target, full_state_dict(alone))
            result["one_to_two"] = "loaded"
        except ValueError as error:
            result["one_to_two"] = str(error)
        result["one_to_two_state"] = len(target.state)
    return result


def reshard(rank: int, world_size: int) -> Result:
    return {
        f"{kind}-{fmt}": _reshard_case(kind, fmt)
        for kind in ("kahan", "masters")
        for fmt in (None, "bf16", "int8", "fp8")
    }


SCENARIOS: dict[str, Callable[[int, int], Result]] = {
    "sharded": sharded,
    "ddp": ddp,
    "fsdp": fsdp,
    "lowbit_comm": lowbit_comm,
    "lowbit_comm_one_rank": lowbit_comm_one_rank,
    "reshard": reshard,
}


def main(name: str, world_size: int, out: Path, rank: int) -> None:
    torch.set_num_threads(1)
    store = f"file://{out / 'store'}"
    # A timeout turns a rank left waiting in a collective into an error instead of a hang.
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world_size, timeout=TIMEOUT)
    try:
        result = SCENARIOS[name](rank, world_size)
        # DDP/FSDP modules sit in reference cycles that keep gloo's process group alive into interpreter
        # shutdown, where torch (2.13) can abort ("terminate called without an active exception").
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    torch.save(result, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]))
