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


def _grads(reentrant: bool | None, policy: mixprec.Policy | None, **kwargs: object) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = Checkpointed(reentrant, **kwargs)
    batch = checkpointed_batch(torch.Generator().manual_seed(0))
    (x,), target = batch["inputs"], batch["target"]
    with mixprec.autocast("cpu", dtype=torch.bfloat16, policy=policy):
        loss = nn.functional.mse_loss(model(x), target)
    loss.backward()
    return [p.grad for p in model.parameters()] + [x.grad]


def _differs(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return not all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _policies() -> tuple[mixprec.Policy, mixprec.Policy, mixprec.Policy]:
    # Each edit must matter, or the tests would prove nothing (block 0's layer_norm in bf16, which
    # torch's CPU lists leave in fp32 here; block 1 pinned to fp32).
    default = mixprec.Policy.for_device("cpu", torch.bfloat16)
    op_edit = default.with_ops(lower=["layer_norm"])
    return default, op_edit, op_edit.with_modules({"blocks.1": torch.float32})


def test_custom_policy_and_pinned_module_survive_the_recompute() -> None:
    """torch's non-reentrant checkpoint with mixprec's context_fn replays the policy, pins included."""
    default, op_edit, policy = _policies()
    plain = _grads(None, policy)
    assert _differs(plain, _grads(None, op_edit)), "the module pin changed nothing"
    assert _differs(_grads(None, default), _grads(None, op_edit)), "the op edit changed nothing"
    actual = _grads(False, policy, context_fn=mixprec.autocast_context_fn)
    for i, (expected, got) in enumerate(zip(plain, actual, strict=True)):
        assert got.dtype == expected.dtype, f"gradient {i}"
        assert torch.equal(got, expected), f"gradient {i}"


def test_custom_policy_without_context_fn_fails_loudly_or_is_documented_lost() -> None:
    """Without the hook, torch's checkpoint replays torch's state only: the non-reentrant variant
    raises; the reentrant one has no hook at all and recomputes in torch's dtypes (README)."""
    _, _, policy = _policies()
    with pytest.raises(torch.utils.checkpoint.CheckpointError, match="different metadata"):
        _grads(False, policy)
    assert _differs(_grads(None, policy), _grads(True, policy))
