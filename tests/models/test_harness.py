"""The zoo's harness can fail: its comparison sees one ulp, a dtype, a missing gradient; its oracle
really autocasts; the child-process oracle (used when the engine registers process-wide kernels)
gives torch.autocast's bits without importing mixprec.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from tests.models.zoo import DTYPES, assert_bitwise, oracle_in_subprocess, references_in_subprocess, run_case


def test_assert_bitwise_sees_one_ulp_a_dtype_a_sign_a_layout_and_a_missing_gradient() -> None:
    nan = torch.tensor([0.0, float("nan")])
    base = {
        "loss": torch.tensor(1.0),
        "logits": torch.arange(6.0).reshape(2, 3),
        "grad.w": torch.ones(3, dtype=torch.bfloat16),
        "grad.b": None,
        "grad.n": nan,
    }
    assert_bitwise(base, {**base, "grad.n": nan.clone()})  # NaN at the same place is the same bits
    changes = [
        {"loss": torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))},
        {"logits": torch.arange(6.0).reshape(2, 3).t().contiguous().t()},  # same values, strides (1, 2)
        {"grad.w": torch.ones(3)},
        {"grad.b": torch.zeros(1)},
        {"grad.n": torch.tensor([-0.0, float("nan")])},
    ]
    for change in changes:
        with pytest.raises(AssertionError):
            assert_bitwise(base, {**base, **change})


@pytest.mark.parametrize("name", ["gpt2_sdpa", "nn_gru"])
def test_oracle_runs_in_low_precision(name: str) -> None:
    plain = run_case(name, contextlib.nullcontext(), train=True)
    autocast = run_case(name, torch.autocast("cpu", dtype=torch.bfloat16), train=True)
    assert plain["logits"].dtype == torch.float32
    assert not torch.equal(plain["loss"], autocast["loss"])


@pytest.mark.skipif(oracle_in_subprocess(), reason="torch.autocast in this process runs mixprec's kernels")
def test_child_process_oracle_is_torch_autocast() -> None:
    expected = run_case("nn_mha", torch.autocast("cpu", dtype=DTYPES["bf16"]), train=True)
    children = references_in_subprocess(["nn_mha/bf16/1", "nn_lstm/fp16/1"])
    assert_bitwise(expected, children["nn_mha/bf16/1"])
    lstm = children["nn_lstm/fp16/1"]  # a result, or torch.autocast's own error where oneDNN lacks the kernel
    assert isinstance(lstm, dict) or "primitive descriptor" in lstm
