"""mixprec's GradScaler under FSDP on the CPU with gloo (issue 7, (3)).

FSDP1 (FullyShardedDataParallel, flat parameters) and FSDP2 (fully_shard, DTensor parameters: the
scaler checks and unscales each rank's local shard and agrees on found_inf with one all-reduce).
"""

from __future__ import annotations

from typing import Any

import pytest
from dist_harness import requires_gloo, run_ranks

pytestmark = requires_gloo


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks("fsdp", tmp_path_factory.mktemp("fsdp"))


@pytest.mark.parametrize("case", ["fsdp1", "fsdp2", "fsdp2_fused"])
def test_inf_in_one_shard_skips_every_rank(ranks: list[dict[str, Any]], case: str) -> None:
    for rank in ranks:
        assert rank[case]["stepped"] == [True, False, True]  # inf in rank 1's shard at step 1
        assert rank[case]["scales"] == [2.0**16, 2.0**15, 2.0**15]


def test_fsdp1_without_sync_steps_half_the_model(ranks: list[dict[str, Any]]) -> None:
    """torch's per-rank decision: rank 0's shard takes the step, rank 1's does not, the scales part."""
    assert [rank["fsdp1_nosync"]["stepped"][1] for rank in ranks] == [True, False]
    assert [rank["fsdp1_nosync"]["scales"][1] for rank in ranks] == [2.0**16, 2.0**15]
