"""lowbit_allreduce_hook and LowbitReduceScatter on 2 gloo ranks (issue 30 item 3).

The oracle is DDP's / FSDP2's own fp32 reduction of the same gradients, in the same run.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from dist_harness import requires_gloo, run_ranks

from mixprec.distributed import LowbitCommState, LowbitReduceScatter, lowbit_allreduce_hook

pytestmark = requires_gloo


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks("lowbit_comm", tmp_path_factory.mktemp("lowbit_comm"), timeout=150)


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.flatten() for t in tensors])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize(
    ("case", "bound"), [("grads_fp8", 0.06), ("grads_bf16", 0.01), ("fsdp2_fp8", 0.06), ("fsdp2_bf16", 0.01)]
)
def test_reduced_gradients_bitwise_equal_on_every_rank_and_close_to_fp32(
    ranks, case: str, bound: float
) -> None:
    mine, theirs = (_flat(rank[case]["grads"]) for rank in ranks)
    assert torch.equal(mine.view(torch.int32), theirs.view(torch.int32))
    reference = _flat(ranks[0][case.replace("fp8", "fp32").replace("bf16", "fp32")]["grads"])
    assert 0 < _rel(mine, reference) < bound  # measured 0.027 (fp8), 0.0019 (bf16)


def test_fp8_hands_collectives_half_the_bytes_of_bf16(ranks) -> None:
    for rank in ranks:
        numel = rank["grads_fp8"]["numel"]
        assert rank["grads_bf16"]["bytes"] == 2 * numel
        fp8 = rank["grads_fp8"]["bytes"]
        assert numel < fp8 < numel + 64  # one byte a value, plus 4 bytes of amax per bucket
        assert rank["fsdp2_fp8"]["bytes"] * 1.8 < rank["fsdp2_bf16"]["bytes"]


@pytest.mark.parametrize("case", ["train_fp8", "train_fp8_ef", "train_bf16"])
def test_training_converges_like_fp32(ranks, case: str) -> None:
    for rank in ranks:
        assert rank[case]["identical"]
        assert rank[case]["losses"][-1] < 0.02 * rank[case]["losses"][0]
        assert abs(rank[case]["full"] - rank["train_fp32"]["full"]) < 0.05
    assert [r["train_fp8_ef"]["residuals"] for r in ranks] == [1, 1]  # one bucket, its residual kept


def test_inf_on_one_rank_makes_every_rank_non_finite(ranks) -> None:
    assert [r["nonfinite"]["finite"] for r in ranks] == [[False] * 4, [False] * 4]


@pytest.mark.parametrize("bad", ["fp16", "e4m3", None, 8])
def test_unknown_format_refused(bad: object) -> None:
    with pytest.raises(ValueError, match=r"one of \['fp8', 'bf16'\], got"):
        lowbit_allreduce_hook(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"one of \['fp8', 'bf16'\], got"):
        LowbitReduceScatter(bad)  # type: ignore[arg-type]


def test_state_arguments_checked() -> None:
    with pytest.raises(TypeError, match="error_feedback must be a bool"):
        LowbitCommState(error_feedback="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="process_group must be a ProcessGroup"):
        LowbitCommState(process_group="world")  # type: ignore[arg-type]


def test_reduce_scatter_refuses_premul_sum() -> None:
    op = torch.distributed.ReduceOp.PREMUL_SUM  # what FSDP passes for a custom gradient divide factor
    out = torch.empty(2)
    with pytest.raises(ValueError, match="SUM or AVG"):
        LowbitReduceScatter("fp8")(out, torch.ones(4), None, op)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A 1-rank gloo group in a child process, as the 2-rank ones (dist_scenarios.lowbit_comm_one_rank)."""
    out = tmp_path_factory.mktemp("one_rank")
    return run_ranks("lowbit_comm_one_rank", out, world_size=1, timeout=120)[0]


def test_comm_state_round_trips_and_resumes_error_feedback(one_rank) -> None:
    result = one_rank["round_trip"]
    assert result["residuals"] and result["bytes_sent"] > 0
    assert result["fresh_bytes_sent"] == result["bytes_sent"]
    assert result["fresh_residuals"].keys() == result["residuals"].keys()
    assert all(torch.equal(result["fresh_residuals"][k], v) for k, v in result["residuals"].items())
    # the loaded state holds its own copy: changing the saved dict afterwards did not reach it
    assert not torch.equal(result["fresh_residuals"][0], result["mutated_saved"])
    # the residual is what the next step adds back: equal states give bitwise-equal next gradients
    assert torch.equal(result["next_grad"], result["next_grad_loaded"])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"error_feedback": False}, "error_feedback=False"),
        ({"residuals": {"0": torch.zeros(3)}}, "not a bucket index"),
        ({"residuals": {0: torch.zeros(3, dtype=torch.bfloat16)}}, "float32"),
        ({"bytes_sent": -1}, "bytes_sent"),
    ],
)
def test_comm_state_refuses_a_bad_state_and_keeps_its_own(change: dict, message: str) -> None:
    state = LowbitCommState(error_feedback=True)
    state.residuals, state.bytes_sent = {0: torch.ones(3)}, 12
    bad = {**state.state_dict(), **change}
    with pytest.raises(ValueError, match=message):
        state.load_state_dict(bad)
    assert torch.equal(state.residuals[0], torch.ones(3)) and state.bytes_sent == 12
    with pytest.raises(ValueError, match="missing keys"):
        state.load_state_dict({})


def test_the_fp8_hook_runs_where_torch_names_the_gather_all_gather_into_tensor(one_rank) -> None:
    """``dist.all_gather_single`` came with torch 2.13; before it (torch >= 2.11 is supported, and the H200
    runs 2.11) the same collective is ``all_gather_into_tensor``. One gloo rank: the hook must send and
    decode its bucket through that name."""
    result = one_rank["gather_fallback"]
    assert result["calls"] == 1 and result["bytes_sent"] > 0
    assert result["finite"] == [True, True]
