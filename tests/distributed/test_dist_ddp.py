"""mixprec under DistributedDataParallel (issue 7, (2)): autocast + GradScaler, master weights, fp16 hook."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from dist_harness import requires_gloo, run_ranks

pytestmark = requires_gloo


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks("ddp", tmp_path_factory.mktemp("ddp"))


def test_parameters_are_bit_identical_across_ranks(ranks: list[dict[str, Any]]) -> None:
    for p0, p1 in zip(ranks[0]["params"], ranks[1]["params"], strict=True):
        assert torch.equal(p0, p1)
    assert [rank["identical"] for rank in ranks] == [True, True]  # mixprec.distributed.replicas_identical


def test_ddp_matches_one_process_on_the_whole_batch(ranks: list[dict[str, Any]]) -> None:
    """fp16 autocast rounds per-rank and whole-batch sums differently; after 6 steps the gap is ~1e-4."""
    assert ranks[0]["scales"] == ranks[0]["reference_scales"]
    for ddp, single in zip(ranks[0]["params"], ranks[0]["reference"], strict=True):
        torch.testing.assert_close(ddp, single, rtol=1e-3, atol=1e-3)


def test_master_weights_under_ddp_skip_a_bad_batch_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        assert rank["master"]["skipped"] == [False, False, True, False]  # nan fed to rank 1 only, step 2
        assert rank["master"]["identical"]
    assert ranks[0]["master"]["scale"] == ranks[1]["master"]["scale"]


def test_fp16_compression_overflows_and_the_scaler_backs_off(ranks: list[dict[str, Any]]) -> None:
    """Scaled gradients above 65504 turn inf in fp16_compress_hook's cast: the scaler skips and backs off
    on every rank until they fit, then steps; without the hook the same scale never overflows."""
    for rank in ranks:
        plain, fp16 = rank["compress_none"], rank["compress_fp16"]
        assert not any(plain["skipped"]) and plain["scale"] == 2.0**24
        assert fp16["skipped"][0] and not fp16["skipped"][-1]
        assert fp16["scale"] < 2.0**24
        assert plain["identical"] and fp16["identical"]
    assert ranks[0]["compress_fp16"] == ranks[1]["compress_fp16"]
