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
# oneDNN may lack a low-precision LSTM (fp16 on an AVX512-BF16 CPU, bf16 and fp16 under AVX2): there
# torch.autocast itself raises "could not create a primitive descriptor", and mixprec must raise it too.
NO_KERNEL = "primitive descriptor"


def _params() -> list:
    return [pytest.param(n, d, id=f"{n}-{d}") for n in HF_MODELS + TORCH_MODULES for d in DTYPES]


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize(("name", "dtype"), _params())
def test_model_matches_torch_autocast(name: str, dtype: str, mode: str) -> None:
    train = mode == "train"
    try:
        expected = reference(name, DTYPES[dtype], train)
    except RuntimeError as error:  # this CPU's oneDNN has no such kernel: the same error from mixprec
        if NO_KERNEL not in str(error):
            raise
        with pytest.raises(RuntimeError, match=NO_KERNEL):
            run_case(name, mixprec.autocast("cpu", dtype=DTYPES[dtype]), train)
        return
    actual = run_case(name, mixprec.autocast("cpu", dtype=DTYPES[dtype]), train)
    assert not train or any(k.startswith("grad.") and v is not None for k, v in expected.items())
    assert_bitwise(expected, actual)
