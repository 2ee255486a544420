"""Third-party models under mixprec.autocast vs torch.autocast: loss, logits and every gradient bitwise.

Each case is built twice from one seed and runs one step in each region (train: forward, loss,
backward; eval: a ``no_grad`` forward). A mixprec region is meant to be torch's autocast state, so
code written for torch.autocast (``autocast(enabled=False)`` islands, eval fast paths that check
``torch.is_autocast_enabled()``, composite RNNs) must give torch's bits.
"""

from __future__ import annotations

import pytest

import mixprec
from tests.models.zoo import DTYPES, assert_bitwise, reference, run_case

HF_MODELS = [
    "gpt2_sdpa",
    "gpt2_eager",
    "gpt2_upcast",  # reorder_and_upcast_attn: q @ k^T under torch.autocast(enabled=False)
    "gpt2_upcast_cross",  # the same as a cross-attention decoder with encoder_hidden_states
    "bert",
    "t5",
    "llama",
    "vit",
    "whisper",
    "mixtral",
    "ernie_moe",  # router under torch.autocast(enabled=False), "Force float32"
]
TORCH_MODULES = ["nn_transformer", "nn_encoder", "nn_mha", "nn_gru", "nn_lstm", "nn_grucell", "nn_lstmcell"]
# oneDNN has no fp16 LSTM on CPU: torch.autocast itself raises "could not create a primitive descriptor".
NO_ORACLE = {("nn_lstm", "fp16"): "torch.autocast itself raises on CPU (oneDNN has no fp16 LSTM)"}


def _params() -> list:
    out = []
    for name in HF_MODELS + TORCH_MODULES:
        for dtype in DTYPES:
            reason = NO_ORACLE.get((name, dtype))
            marks = [pytest.mark.skip(reason=reason)] if reason else []
            out.append(pytest.param(name, dtype, marks=marks, id=f"{name}-{dtype}"))
    return out


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize(("name", "dtype"), _params())
def test_model_matches_torch_autocast(name: str, dtype: str, mode: str) -> None:
    train = mode == "train"
    expected = reference(name, DTYPES[dtype], train)
    actual = run_case(name, mixprec.autocast("cpu", dtype=DTYPES[dtype]), train)
    assert not train or any(k.startswith("grad.") and v is not None for k, v in expected.items())
    assert_bitwise(expected, actual)
