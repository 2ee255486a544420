"""The fp8 all-gather's pieces in one process: the config flag, the wrapped weight (equal to a plain
Float8Linear bitwise, checkpoints both ways), the gathered weight and FSDP2's post-all-gather hook called
directly. The two-rank all-gather itself is tested in test_fsdp.py."""

from __future__ import annotations

import ast
import copy
import io
import pickle
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from mixprec import formats
from mixprec.float8 import (
    CastConfig,
    Float8Config,
    Float8Linear,
    ScalingGranularity,
    convert_to_float8_training,
)
from mixprec.float8.fsdp import (
    Float8AllGatherWeight,
    Float8GatheredWeight,
    precompute_float8_dynamic_scale_for_fsdp,
    weight_scale,
)
from mixprec.lowbit.history import amax_of, to_float8

FLAG = Float8Config(enable_fsdp_float8_all_gather=True)


def _pair(**fields: object) -> tuple[nn.Module, nn.Module]:
    """The same converted model without and with the flag (other config fields shared)."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(12, 24), nn.GELU(), nn.Linear(24, 6))
    config = Float8Config(enable_fsdp_float8_all_gather=True, **fields)
    flagged = convert_to_float8_training(copy.deepcopy(plain), config=config)
    return convert_to_float8_training(plain, config=Float8Config(**fields)), flagged


@pytest.mark.parametrize(
    ("fields", "error", "words"),
    [
        ({"scaling": "delayed"}, ValueError, "scaling='delayed'"),
        ({"recipe": "rowwise"}, ValueError, "recipe='rowwise'"),
        ({"enable_fsdp_float8_all_gather": "yes"}, TypeError, "'yes'"),
        (
            {"cast_config_weight": CastConfig(scaling_granularity=ScalingGranularity.AXISWISE)},
            ValueError,
            "every",
        ),
    ],
)
def test_config_flag_is_checked(fields, error, words) -> None:
    fields = {"enable_fsdp_float8_all_gather": True, **fields}
    with pytest.raises(error, match="enable_fsdp_float8_all_gather") as info:
        Float8Config(**fields)
    assert words in str(info.value)
    with pytest.raises(ValueError, match="enable_fsdp_float8_all_gather"):
        Float8Config.from_recipe_name("rowwise", enable_fsdp_float8_all_gather=True)
    assert Float8Config().enable_fsdp_float8_all_gather is False
    assert "fsdp_fp8_all_gather" in FLAG.short_str()


@pytest.mark.parametrize("autocast", [False, True])
def test_flagged_module_trains_as_the_plain_one_bitwise(autocast: bool) -> None:
    models = _pair(margin=1, round_scales_to_power_of_2=True)
    assert type(models[1][0].weight) is Float8AllGatherWeight and isinstance(
        models[1][0].weight, nn.Parameter
    )
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    for step in range(3):
        x = torch.randn(8, 12, generator=torch.Generator().manual_seed(step)) * 3
        outs = []
        for model, optimizer in zip(models, optimizers, strict=True):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out = model(x)
            out.float().square().mean().backward()
            optimizer.step()
            outs.append(out)
        assert torch.equal(*outs)
        for p, q in zip(models[0].parameters(), models[1].parameters(), strict=True):
            assert type(q.grad) is torch.Tensor and torch.equal(p.grad, q.grad)
            assert torch.equal(p.detach(), q.detach())
    assert models[0][0].last_scale() == models[1][0].last_scale()


def test_checkpoints_load_both_ways_and_pickle_as_plain_tensors() -> None:
    _, flagged = _pair()
    plain = nn.Sequential(nn.Linear(12, 24), nn.GELU(), nn.Linear(24, 6))
    buffer = io.BytesIO()
    torch.save(flagged.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert all(type(t) is torch.Tensor for t in state.values())
    plain.load_state_dict(state)
    assert torch.equal(plain[0].weight, flagged[0].weight._tensor)
    torch.nn.init.zeros_(plain[2].weight)
    flagged.load_state_dict(plain.state_dict())  # a plain checkpoint into the flagged model
    assert type(flagged[2].weight) is Float8AllGatherWeight
    assert not flagged[2].weight._tensor.any()
    for twin in (copy.deepcopy(flagged), pickle.loads(pickle.dumps(flagged))):
        assert torch.equal(twin[0].weight, flagged[0].weight)
        assert isinstance(twin[0].weight, nn.Parameter) and type(twin[0].weight) is Float8AllGatherWeight
        assert twin[0].weight.requires_grad


def _gathered(weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> Float8GatheredWeight:
    amax = amax_of(weight)
    scale = weight_scale(amax, FLAG)
    return Float8GatheredWeight(to_float8(weight, scale, formats.FP8_E4M3FN), scale, amax, dtype)


def test_gathered_weight_is_the_weights_fp8_cast() -> None:
    plain, _ = _pair()
    layer = plain[0]
    x = torch.randn(5, 12)
    gathered_layer = Float8Linear.from_linear(nn.Linear(12, 24), FLAG)
    gathered_layer.weight = nn.Parameter(_gathered(layer.weight.detach()))
    gathered_layer.bias = layer.bias
    assert type(gathered_layer.weight) is Float8GatheredWeight
    assert torch.equal(gathered_layer(x), layer(x))
    gathered_layer(x).sum().backward()
    layer.zero_grad()
    layer(x).sum().backward()
    assert gathered_layer.weight.grad.dtype == torch.float32 and torch.equal(
        gathered_layer.weight.grad, layer.weight.grad
    )
    assert gathered_layer.last_scale() == layer.last_scale()


def test_gathered_weight_views_stay_fp8_and_other_ops_see_the_dequantized_weight() -> None:
    weight = torch.randn(6, 4)
    gathered = _gathered(weight, torch.bfloat16)
    expected = (gathered._data.float() / gathered._scale).to(torch.bfloat16)
    assert torch.equal(gathered.dequantize(), expected)
    for view in (
        gathered.detach(),
        gathered.t(),
        gathered.view(24),
        torch.as_strided(gathered, (3, 4), (4, 1)),
    ):
        assert type(view) is Float8GatheredWeight and view._scale is gathered._scale
        assert view._data.untyped_storage().data_ptr() == gathered._data.untyped_storage().data_ptr()
    assert torch.equal(gathered.t().dequantize(), expected.t())
    summed = gathered + 1
    assert type(summed) is torch.Tensor and torch.equal(summed, expected + 1)


def test_post_all_gather_hook_builds_and_refreshes_the_gathered_weight() -> None:
    weight = torch.randn(8, 4)
    shard = Float8AllGatherWeight(weight, FLAG)
    first = _gathered(weight)
    data = first._data.view(torch.uint8)
    built, inner = shard.fsdp_post_all_gather((data,), (first._amax, first._scale), torch.bfloat16)
    assert type(built) is Float8GatheredWeight and built.dtype == torch.bfloat16 and built.shape == (8, 4)
    assert inner == (data,) and built._data.data_ptr() == data.data_ptr()
    new_scale, new_amax = first._scale * 2, first._amax / 2
    assert shard.fsdp_post_all_gather((data,), (new_amax, new_scale), torch.bfloat16, out=built) is None
    assert built._scale is new_scale and built._amax is new_amax


def test_precompute_without_sharded_weights_does_nothing() -> None:
    _, flagged = _pair()  # not sharded: no DTensor weights, so no collective is attempted
    assert precompute_float8_dynamic_scale_for_fsdp(flagged) == 0
    assert flagged[0].weight._precomputed is None


def test_frozen_flagged_weight_still_runs_in_fp8() -> None:
    plain, flagged = _pair()
    for model in (plain, flagged):
        model.requires_grad_(False)
    x = torch.randn(4, 12)
    assert torch.equal(plain(x), flagged(x))


def test_readme_fsdp_snippet_imports_what_it_uses() -> None:
    page = (Path(__file__).resolve().parents[2] / "docs" / "guide" / "fp8.md").read_text()
    section = page.split("\n## FSDP2: weights all-gathered in fp8", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```python\n(.*?)```", section, re.S)
    assert block, "no python block under '## FSDP2: weights all-gathered in fp8'"
    tree = ast.parse(block.group(1))
    imports = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert len(imports) == 2
    exec(compile(ast.Module(body=imports, type_ignores=[]), "docs/guide/fp8.md#fsdp2", "exec"), {})
