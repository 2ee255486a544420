"""FSDP2's fp8 all-gather hooks on fake CUDA, called directly: e4m3 bytes and a scale on the device.

No process group: the hooks need a mesh (``ndim``, ``size``, ``get_group``) and ``dist.all_reduce``, so a
two-rank mesh is stubbed and the all-reduce recorded; over one rank's values a MAX all-reduce is the
identity, which is what it is here. The collective and NCCL themselves are tests/float8/test_fsdp.py's
(gloo, on the CPU). What this checks is the CUDA side: the bytes sent, the scale, the weight rebuilt
after the gather and used by the fp8 GEMM, and no host sync or host-to-device copy on the way.
"""

from __future__ import annotations

from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from fake_cuda.harness import direct_autograd
from mixprec.float8 import Float8Config, Float8Linear, fsdp
from mixprec.float8.fsdp import Float8AllGatherWeight, Float8GatheredWeight
from mixprec.lowbit.gemm import LowbitLinearFunction

pytestmark = pytest.mark.skipif(torch.version.cuda is None, reason="needs a CUDA build of torch (fake tier)")

N, K, WORLD = 32, 64, 2
MESH = SimpleNamespace(ndim=1, size=lambda dim=None: WORLD, get_group=lambda dim: "the shard group")


def _layer() -> Float8Linear:
    config = Float8Config(enable_fsdp_float8_all_gather=True)
    return Float8Linear(K, N, bias=False, device="cuda", dtype=torch.bfloat16, config=config)


def _no_host_cost(recorder) -> None:
    assert [e for e in recorder.events if e.kind in ("sync", "d2h", "h2d")] == []


@pytest.mark.parametrize("rows", [N // WORLD, 13], ids=["even", "uneven"])
def test_pre_all_gather_sends_e4m3_bytes_and_the_scale_on_the_device(fake_hopper, rows) -> None:
    weight = _layer().weight
    shard = weight[:rows]  # this rank's rows; FSDP2 slices a Float8AllGatherWeight into one
    assert isinstance(shard, Float8AllGatherWeight)
    reduced = []
    fake_hopper.reset()
    with mock.patch.object(dist, "all_reduce", lambda t, op=None, group=None: reduced.append((t, op, group))):
        (data,), (amax, scale) = shard.fsdp_pre_all_gather(MESH, weight.shape, weight.stride(), None, None)
    _no_host_cost(fake_hopper)
    # every rank sends the padded shard size FSDP2 expects: ceil(N / WORLD) rows
    assert data.shape == (N // WORLD, K) and data.dtype == torch.uint8 and data.device.type == "cuda"
    assert amax.shape == () and amax.dtype == torch.float32 and amax.device.type == "cuda"
    assert scale.shape == () and scale.dtype == torch.float32 and scale.device.type == "cuda"
    ((t, op, group),) = reduced  # the shard's amax made the whole weight's, on the device
    assert t is amax and op == dist.ReduceOp.MAX and group == "the shard group"


def test_post_all_gather_rebuilds_the_weight_the_fp8_gemm_takes(fake_hopper) -> None:
    layer = _layer()
    weight = layer.weight
    rows = N // WORLD
    with mock.patch.object(dist, "all_reduce", lambda t, op=None, group=None: None):
        outs = [
            weight[r * rows : (r + 1) * rows].fsdp_pre_all_gather(
                MESH, weight.shape, weight.stride(), None, None
            )
            for r in range(WORLD)
        ]
    # what the all-gather hands back: the ranks' bytes in order (one scale: the amax is the whole weight's
    # after the MAX all-reduce, here each rank's own, and the first rank's is kept)
    gathered_bytes = torch.cat([data for (data,), _ in outs])
    amax, scale = outs[0][1]
    fake_hopper.reset()
    gathered, inner = weight.fsdp_post_all_gather((gathered_bytes,), (amax, scale), torch.bfloat16)
    assert isinstance(gathered, Float8GatheredWeight) and inner == (gathered_bytes,)
    assert gathered.shape == (N, K) and gathered.dtype == torch.bfloat16 and gathered.device.type == "cuda"
    assert gathered._data.dtype == torch.float8_e4m3fn and gathered._scale is scale
    # the layer's forward takes the gathered e4m3 bytes as the weight's cast, straight into _scaled_mm
    layer.weight = torch.nn.Parameter(gathered, requires_grad=False)
    x = torch.randn(16, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)  # dgrad needs w.T
    with direct_autograd(LowbitLinearFunction) as calls:
        out = layer(x)
    (call,) = calls
    assert out.shape == (16, N) and out.dtype == torch.bfloat16
    w8_t, w_scale, w_descale = call.ctx.saved_tensors[3:]
    # backward keeps the gathered cast itself, transposed as a view for dgrad: no new cast, no copy
    assert w8_t._base is layer.weight._data and w8_t.shape == (K, N) and w_scale is scale
    assert w_descale is None  # a gathered cast brings no reciprocal: each GEMM computes its own
    (gemm,) = [e.detail for e in fake_hopper.of("scaled_mm")]
    assert "error" not in gemm and gemm["mat2"]["dtype"] == torch.float8_e4m3fn
    assert gemm["mat2"]["shape"] == (K, N)
    _no_host_cost(fake_hopper)
    # FSDP2 re-gathering into the same storage: only the scale and amax are replaced, nothing copied
    fake_hopper.reset()
    new_scale, new_amax = scale * 2, amax / 2
    assert (
        weight.fsdp_post_all_gather((gathered_bytes,), (new_amax, new_scale), torch.bfloat16, out=gathered)
        is None
    )
    assert gathered._scale is new_scale and gathered._amax is new_amax
    _no_host_cost(fake_hopper)


def test_precomputed_amaxes_are_gathered_without_a_host_copy(fake_hopper) -> None:
    """The one all-reduce's input, once per optimizer step: empty shards (an uneven split) read 0."""
    shards = [
        torch.randn(3, 4, device="cuda", dtype=torch.bfloat16),
        torch.empty(0, 4, device="cuda", dtype=torch.bfloat16),
        torch.randn(2, 2, device="cuda", dtype=torch.bfloat16),
    ]
    fake_hopper.reset()
    amaxes = fsdp._local_amaxes(shards)
    assert amaxes.shape == (3,) and amaxes.dtype == torch.float32 and amaxes.device.type == "cuda"
    _no_host_cost(fake_hopper)
