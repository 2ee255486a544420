"""Activation checkpointing inside a region: gradients bitwise equal to torch.autocast's.

``torch.utils.checkpoint`` (reentrant and not) around two MLP blocks, and transformers'
``gradient_checkpointing_enable()`` on GPT-2, Llama, T5 and BERT. The recompute in backward runs
outside the ``with`` block, so it is exact only if it sees the autocast state the forward saw.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mixprec
from tests.models.zoo import DTYPES, assert_bitwise, reference, run_case
from tests.models.zoo_torch import Checkpointed, checkpointed_batch

VARIANTS = ["nonreentrant", "reentrant"]
CASES = [f"ckpt_{v}" for v in VARIANTS] + [
    f"{model}_hfckpt_{v}" for model in ("gpt2_sdpa", "llama", "t5", "bert") for v in VARIANTS
]


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("name", CASES)
def test_checkpointed_gradients_match_torch_autocast(name: str, dtype: str) -> None:
    expected = reference(name, DTYPES[dtype], train=True)
    actual = run_case(name, mixprec.autocast("cpu", dtype=DTYPES[dtype]), train=True)
    assert all(
        v is not None for k, v in expected.items() if k.startswith("grad.")
    )  # reentrant: inputs needed grad
    assert_bitwise(expected, actual)


def _grads(reentrant: bool | None, policy: mixprec.Policy | None) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = Checkpointed(reentrant)
    batch = checkpointed_batch(torch.Generator().manual_seed(0))
    (x,), target = batch["inputs"], batch["target"]
    with mixprec.autocast("cpu", dtype=torch.bfloat16, policy=policy):
        loss = nn.functional.mse_loss(model(x), target)
    loss.backward()
    return [p.grad for p in model.parameters()] + [x.grad]


def _differs(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return not all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("reentrant", [False, True], ids=VARIANTS)
def test_custom_policy_and_pinned_module_survive_the_recompute(reentrant: bool) -> None:
    # No torch oracle for a custom policy: the checkpointed model must match the same model without
    # checkpointing, in the same region. Each edit must matter, or the test would prove nothing
    # (block 0's layer_norm in bf16, which torch's CPU lists leave in fp32 here; block 1 pinned to fp32).
    default = mixprec.Policy.for_device("cpu", torch.bfloat16)
    op_edit = default.with_ops(lower=["layer_norm"])
    policy = op_edit.with_modules({"blocks.1": torch.float32})
    plain = _grads(None, policy)
    assert _differs(plain, _grads(None, op_edit)), "the module pin changed nothing"
    assert _differs(_grads(None, default), _grads(None, op_edit)), "the op edit changed nothing"
    for i, (expected, actual) in enumerate(zip(plain, _grads(reentrant, policy), strict=True)):
        assert actual.dtype == expected.dtype, f"gradient {i}"
        assert torch.equal(actual, expected), f"gradient {i}"
