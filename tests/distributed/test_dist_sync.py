"""GradScaler(sync=...): ranks that own different parameters skip or step together (issue 7, (1) and (4))."""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
import torch
from dist_harness import requires_gloo, run_ranks

import mixprec
from mixprec.scaling.skip import RankSync, agree_max

pytestmark = requires_gloo


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks("sharded", tmp_path_factory.mktemp("sharded"))


def both(ranks: list[dict[str, Any]], case: str, key: str) -> list[Any]:
    return [rank[case][key] for rank in ranks]


@pytest.mark.parametrize("case", ["sync", "fused"])
def test_only_rank_1_overflows_and_both_skip(ranks: list[dict[str, Any]], case: str) -> None:
    assert both(ranks, case, "stepped0") == [False, False]
    assert both(ranks, case, "scale0") == [2.0**15, 2.0**15]
    assert both(ranks, case, "stepped1") == [True, True]  # the next, clean step goes ahead everywhere
    assert both(ranks, case, "skipped_steps") == [1, 1]


@pytest.mark.parametrize("case", ["sync", "fused"])
def test_one_collective_per_step(ranks: list[dict[str, Any]], case: str) -> None:
    assert both(ranks, case, "collectives0") == [1, 1]
    assert both(ranks, case, "collectives1") == [1, 1]


@pytest.mark.parametrize("case", ["nosync", "fused_nosync"])
def test_without_sync_rank_0_steps_while_rank_1_skips(ranks: list[dict[str, Any]], case: str) -> None:
    """torch's behaviour, kept by sync=False: the replicas diverge and so do the scales."""
    assert both(ranks, case, "stepped0") == [True, False]
    assert both(ranks, case, "scale0") == [2.0**16, 2.0**15]
    assert both(ranks, case, "collectives0") == [0, 0]


def test_two_optimizers_agree_per_optimizer_with_one_collective_each(ranks: list[dict[str, Any]]) -> None:
    assert both(ranks, "two_optimizers", "a_stepped") == [True, True]
    assert both(ranks, "two_optimizers", "b_stepped") == [False, False]
    assert both(ranks, "two_optimizers", "scale") == [2.0**15, 2.0**15]
    assert both(ranks, "two_optimizers", "collectives") == [2, 2]  # update() adds none


def test_update_after_unscale_without_step_agrees(ranks: list[dict[str, Any]]) -> None:
    assert both(ranks, "unscale_only", "scale") == [2.0**15, 2.0**15]
    assert both(ranks, "unscale_only", "collectives") == [1, 1]
    assert both(ranks, "unscale_only_nosync", "scale") == [2.0**16, 2.0**15]


@pytest.mark.parametrize("case", ["master", "master_default_scaler"])
def test_master_weight_optimizer_skips_on_every_rank(ranks: list[dict[str, Any]], case: str) -> None:
    assert both(ranks, case, "stepped") == [False, False]
    assert both(ranks, case, "scale") == [2.0**15, 2.0**15]


def test_master_weight_optimizer_without_sync_diverges(ranks: list[dict[str, Any]]) -> None:
    assert both(ranks, "master_nosync", "stepped") == [True, False]


def test_headroom_growth_uses_the_largest_amax_of_all_ranks(ranks: list[dict[str, Any]]) -> None:
    rank0_alone, rank1_alone = both(ranks, "headroom_nosync", "scale")
    assert rank0_alone > rank1_alone  # tiny gradients on rank 0 would let its scale jump further
    assert both(ranks, "headroom", "scale") == [rank1_alone, rank1_alone]
    assert both(ranks, "headroom", "collectives") == [1, 1]  # amax travels with found_inf


# -- single process ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["yes", "Auto", 1, 0, None, "true"])
def test_sync_accepts_auto_true_false_only(bad: Any) -> None:
    with pytest.raises(ValueError, match=r"sync must be one of 'auto', True, False; got"):
        mixprec.GradScaler(sync=bad)


def test_sync_typo_gets_a_hint() -> None:
    with pytest.raises(ValueError, match=r"did you mean True\?"):
        mixprec.GradScaler(sync="true")


def test_agree_max_is_the_max_over_ranks_in_one_collective_nan_as_inf(ranks: list[dict[str, Any]]) -> None:
    assert both(ranks, "agree_max", "agreed") == [[3.0, 2.0, float("inf")]] * 2
    assert both(ranks, "agree_max", "collectives") == [1, 1]
    assert both(ranks, "agree_max", "given")[0] == [1.0, 2.0, 0.0]  # the caller's tensor is not written


def test_agree_max_on_one_process_returns_the_values_and_refuses_integers() -> None:
    values = torch.tensor([1.0, float("nan")])
    assert agree_max(values) is values
    with pytest.raises(TypeError, match="floating-point tensor, got torch.int64"):
        agree_max(torch.tensor([1]))


def test_process_group_must_be_a_process_group() -> None:
    with pytest.raises(TypeError, match="process_group must be a torch.distributed.ProcessGroup"):
        mixprec.GradScaler(process_group="world")


def test_process_group_with_sync_false_is_refused() -> None:
    with pytest.raises(ValueError, match="process_group was given with sync=False"):
        RankSync(False, process_group=object())  # type: ignore[arg-type]


def _one_step(scaler: mixprec.GradScaler) -> float:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(torch.ones(1, 3)).sum()).backward()
    scaler.step(optimizer)
    scaler.update()
    return scaler.get_scale()


@pytest.mark.parametrize("sync", ["auto", False])
def test_one_process_needs_no_collective(sync: Any) -> None:
    assert not mixprec.GradScaler(sync=sync).rank_sync.is_active()
    assert _one_step(mixprec.GradScaler(sync=sync)) == 2.0**16


def test_sync_true_without_torch_distributed_says_so() -> None:
    with pytest.raises(RuntimeError, match=r"sync=True\) needs torch.distributed to be initialised"):
        _one_step(mixprec.GradScaler(sync=True))


def test_sync_setting_survives_pickle_and_deepcopy() -> None:
    scaler = mixprec.GradScaler(sync=False)
    for copied in (pickle.loads(pickle.dumps(scaler)), copy.deepcopy(scaler)):
        assert copied.rank_sync.sync is False
        assert copied.rank_sync.process_group is None


def test_compression_hook_names_the_formats() -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from mixprec.distributed import compression_hook

    assert compression_hook("fp16") is default_hooks.fp16_compress_hook
    assert compression_hook("bf16") is default_hooks.bf16_compress_hook
    with pytest.raises(ValueError, match=r"one of \['bf16', 'fp16'\], got 'float16'"):
        compression_hook("float16")


def test_replicas_identical_is_true_in_one_process() -> None:
    from mixprec.distributed import replicas_identical

    assert replicas_identical(torch.nn.Linear(2, 2).to(torch.bfloat16))
