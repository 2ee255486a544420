"""Optimizer state saved on 2 FSDP2 ranks, loaded on 2 and on 1, continues bit for bit (issue 30 item 1).

Every state_format under CompensatedOptimizer (Kahan, bf16 weights) and MixedPrecisionOptimizer (fp32
masters): 3 steps on 2 gloo ranks, ``full_state_dict``, then 2 more steps three ways: uninterrupted (the
oracle, in the same run), resumed on 2 ranks, resumed in one process on a plain model. Every rank sees the
same batch, so FSDP2's averaged gradient is exactly the one-process gradient and any difference is the
optimizer's.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from dist_harness import requires_gloo, run_ranks

pytestmark = requires_gloo

CASES = [f"{kind}-{fmt}" for kind in ("kahan", "masters") for fmt in (None, "bf16", "int8", "fp8")]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks("reshard", tmp_path_factory.mktemp("reshard"), timeout=240)


def _bits(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32) for t in tensors]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(_bits(a), _bits(b), strict=True))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("where", ["two", "one"])
def test_resumed_run_equals_uninterrupted_bitwise(ranks: list[dict[str, Any]], case: str, where: str) -> None:
    result = ranks[0][case]
    assert not _equal(result["weights"], result["reference"])  # the two steps after the save moved weights
    assert _equal(result[where], result["reference"])
    assert _equal(ranks[1][case][where], result["reference"])


@pytest.mark.parametrize("case", CASES)
def test_each_step_bumps_the_dtensor_params_version_counters(ranks: list[dict[str, Any]], case: str) -> None:
    """The shards change in place, so the DTensor params count an in-place change per step, as a torch
    optimizer's step on them does (float8's precompute_float8_dynamic_scale_for_fsdp reads the counter to
    know a precomputed scale is stale)."""
    for rank in ranks:
        before, after = rank[case]["versions"]
        assert all(a >= b + 3 for a, b in zip(after, before, strict=True)), (before, after)


@pytest.mark.parametrize("case", CASES)
def test_ranks_agree_on_the_uninterrupted_run(ranks: list[dict[str, Any]], case: str) -> None:
    assert _equal(ranks[0][case]["reference"], ranks[1][case]["reference"])


@pytest.mark.parametrize("case", [c for c in CASES if c.endswith(("int8", "fp8"))])
def test_saved_grid_restarts_where_rank_1_shard_began(ranks: list[dict[str, Any]], case: str) -> None:
    """The (24, 32) weight splits at row 12, value 384: inside the second block of 256 of a one-grid
    tensor, so a requantizing reshard would have moved the blocks; the saved state keeps both grids."""
    assert ranks[0][case]["origins"] == [0, 384]


@pytest.mark.parametrize("case", CASES)
def test_state_of_another_format_is_refused_and_nothing_loaded(
    ranks: list[dict[str, Any]], case: str
) -> None:
    fmt = case.split("-")[1]
    for rank in ranks:
        assert f"saved with state_format={None if fmt == 'None' else fmt!r}" in rank[case]["other_format"]
        assert rank[case]["other_format_state"] == 0


@pytest.mark.parametrize("case", [c for c in CASES if c.endswith(("int8", "fp8"))])
def test_one_process_low_bit_state_cannot_be_cut_inside_a_block(
    ranks: list[dict[str, Any]], case: str
) -> None:
    """Saved with one grid, rank 1's shard would start at value 384, inside block 1: refused, unchanged."""
    message = ranks[1][case]["one_to_two"]
    assert "inside a block of 256" in message and "starts or ends at value 384" in message
    assert all(rank[case]["one_to_two_state"] == 0 for rank in ranks)
