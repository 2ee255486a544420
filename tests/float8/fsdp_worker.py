"""One gloo rank of the FSDP2 fp8 all-gather scenarios (run by test_fsdp.py).

python fsdp_worker.py RANK WORLD_SIZE OUT_DIR

It runs every scenario in one process group:

- ``fp8``: fp32 parameters, fp8 all-gather, scales precomputed after each step;
- ``fp8_lazy``: the same without the precompute (each all-gather reduces its own amax);
- ``fp8_stale``: precomputed once before the first step only, so later all-gathers must not use the
  stale scales;
- ``fp8_uneven``: ``fp8`` on a model whose weights do not split evenly (:data:`UNEVEN`);
- ``fp32``: FSDP2's own fp32 all-gather of a converted model;
- ``bf16``: FSDP2's own bf16 all-gather (``param_dtype=bfloat16``, fp32 reduce);
- ``fp8_bf16``: fp8 all-gather under that policy.

Each rank saves what it saw, per scenario, in ``OUT_DIR/rank{rank}.pt``: outputs, full gradients and
parameters per step, every all-gather's dtype and bytes, the all-reduces per step, the weights' fp8
scales, and the full state_dict; ``fp8`` also torchao's all-gather payload for the same shards, and the
first output again after loading the initial plain model's state_dict into the sharded model.
"""

from __future__ import annotations

import gc
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from mixprec.float8 import Float8Config, convert_to_float8_training, float8_linears
from mixprec.float8.fsdp import precompute_float8_dynamic_scale_for_fsdp

STEPS, LR = 3, 1e-2
SCENARIOS = ("fp8", "fp8_lazy", "fp8_stale", "fp8_uneven", "fp32", "bf16", "fp8_bf16")
#: Layer widths of ``fp8_uneven``: 63 rows shard as 32 + 31, and 1 row as 1 + an empty shard.
UNEVEN = (63, 1)


def model_for(enable_fsdp_float8_all_gather: bool, widths: tuple[int, int] = (64, 16)) -> nn.Module:
    """The same initial model on every rank (and in the test's unsharded reference)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, widths[0]), nn.GELU(), nn.Linear(widths[0], widths[1]))
    config = Float8Config(enable_fsdp_float8_all_gather=enable_fsdp_float8_all_gather)
    return convert_to_float8_training(model, config=config)


def batch(step: int, rank: int) -> torch.Tensor:
    """Rank r's batch at a step; rank 1's inputs are 4x larger, so the ranks' input scales differ."""
    return torch.randn(16, 32, generator=torch.Generator().manual_seed(100 * step + rank)) * (1 + 3 * rank)


def _shard(model: nn.Module, scenario: str, sent: list[tuple[str, int]]) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

    class CountingAllGather(DefaultAllGather):
        """FSDP2's own all-gather, recording the dtype and bytes this rank puts on the wire."""

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            sent.append((str(input_tensor.dtype), input_tensor.numel() * input_tensor.element_size()))
            return super().__call__(output_tensor, input_tensor, group, async_op)

    policy = MixedPrecisionPolicy()
    if scenario in ("bf16", "fp8_bf16"):
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in (model[0], model[2]):
        fully_shard(layer, mp_policy=policy)
        layer.set_custom_all_gather(CountingAllGather())
    fully_shard(model, mp_policy=policy)


def _payloads(model: nn.Module) -> list[tuple[torch.Tensor, ...]] | None:
    """Per weight: mixprec's all-gather input and scale beside torchao's for the same shard (the oracle:
    torchao's ``WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather``); None without torchao."""
    try:
        from torchao.float8.float8_training_tensor import LinearMMConfig
        from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor
    except ImportError:
        return None
    payloads = []
    for _, layer in float8_linears(model):
        shard, mesh = layer.weight._local_tensor, layer.weight.device_mesh
        (ours,), (_, scale) = shard.fsdp_pre_all_gather(mesh, layer.weight.shape, None, layer, None)
        theirs = WeightWithDynamicFloat8CastTensor(
            shard._tensor.clone(), LinearMMConfig(), torch.float8_e4m3fn
        )
        (data,), (their_scale,) = theirs.fsdp_pre_all_gather(mesh)
        payloads.append((ours, scale, data.view(torch.uint8), their_scale))
    return payloads


def _reload(model: nn.Module, record: dict) -> None:
    """Load a plain nn.Linear model's checkpoint into the sharded fp8 model; record its shards and output."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    plain = model_for(False).state_dict()
    set_model_state_dict(model, plain, options=StateDictOptions(full_state_dict=True))
    record["reloaded_shards"] = [type(m.weight._local_tensor).__name__ for _, m in float8_linears(model)]
    precompute_float8_dynamic_scale_for_fsdp(model)
    with torch.no_grad():
        record["reloaded_out"] = model(batch(0, dist.get_rank()))


def run(scenario: str, rank: int) -> dict:
    """Train a fresh sharded model for STEPS steps under ``scenario``; what this rank saw."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    model = model_for(scenario.startswith("fp8"), UNEVEN if scenario == "fp8_uneven" else (64, 16))
    sent: list[tuple[str, int]] = []
    _shard(model, scenario, sent)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    real_all_reduce, reduces = dist.all_reduce, []

    def counted(*args, **kwargs):
        reduces.append(1)
        return real_all_reduce(*args, **kwargs)

    record = {key: [] for key in ("out", "grads", "params", "scales", "reduces", "sent")}
    if scenario == "fp8":
        record["payloads"] = _payloads(model)
    if scenario in ("fp8", "fp8_stale", "fp8_uneven"):
        precompute_float8_dynamic_scale_for_fsdp(model)
    for step in range(STEPS):
        reduces.clear()
        sent.clear()
        dist.all_reduce = counted
        try:
            optimizer.zero_grad()
            y = model(batch(step, rank))
            y.float().square().mean().backward()
            optimizer.step()
            if scenario in ("fp8", "fp8_uneven"):
                precompute_float8_dynamic_scale_for_fsdp(model)
        finally:
            dist.all_reduce = real_all_reduce
        record["out"].append(y.detach().clone())
        record["grads"].append([p.grad.full_tensor() for p in model.parameters()])
        record["params"].append([p.detach().full_tensor().clone() for p in model.parameters()])
        record["scales"].append([m.last_scale()["weight"] for _, m in float8_linears(model)])
        record["reduces"].append(len(reduces))
        record["sent"].append(list(sent))
    record["state_dict"] = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    if scenario == "fp8":
        _reload(model, record)
    return record


def main(rank: int, world: int, out: Path) -> None:
    torch.set_num_threads(1)
    # A collective that one rank never joins (a deadlock) fails after a minute instead of hanging.
    dist.init_process_group(
        "gloo",
        init_method=f"file://{out / 'store'}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    torch.save({scenario: run(scenario, rank) for scenario in SCENARIOS}, out / f"rank{rank}.pt")
    gc.collect()  # free gloo's references before shutdown (see tests/float8/dist_worker.py)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
