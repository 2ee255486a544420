"""Hugging Face transformers models from tiny configs: 2 layers, hidden 32, vocab 128, batch 2, seq 12.

Random init (the caller seeds), dropout 0, nothing downloaded. Each case calls the model with labels,
so the loss is transformers' own (an MoE's router auxiliary loss included).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import transformers
from transformers.utils import logging as hf_logging

from tests.models.zoo import Batch, Case, hf_step

hf_logging.set_verbosity_error()

VOCAB, HIDDEN, HEADS, FFN, LAYERS, BATCH, SEQ = 128, 32, 4, 64, 2, 2, 12


def tokens(g: torch.Generator, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(3, VOCAB, (BATCH, seq), generator=g)


def causal_lm_batch(g: torch.Generator) -> Batch:
    ids = tokens(g)
    return {"input_ids": ids, "labels": ids}


def _model(
    cls: str, config: transformers.PreTrainedConfig, attn: str = "sdpa"
) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        return getattr(transformers, cls)._from_config(config, attn_implementation=attn)

    return build


# --------------------------------------------------------------------------- GPT-2
def gpt2_config(**kw: object) -> transformers.GPT2Config:
    return transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **kw,
    )  # fmt: skip


def gpt2_cross_batch(g: torch.Generator) -> Batch:
    batch = causal_lm_batch(g)
    batch["encoder_hidden_states"] = torch.randn(BATCH, 8, HIDDEN, generator=g)
    return batch


# --------------------------------------------------------------------------- encoders, seq2seq
def bert_batch(g: torch.Generator) -> Batch:
    ids = tokens(g)
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0  # one padded sequence: the attention mask takes part
    labels = torch.full_like(ids, -100)
    labels[:, 2:6] = ids[:, 2:6]  # masked-LM labels on a few positions only
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def seq2seq_batch(g: torch.Generator) -> Batch:
    ids = tokens(g)
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": tokens(g, 8)}


def vit_batch(g: torch.Generator) -> Batch:
    return {"pixel_values": torch.randn(BATCH, 3, 16, 16, generator=g), "labels": torch.tensor([1, 7])}


def whisper_batch(g: torch.Generator) -> Batch:
    # Whisper's encoder wants exactly 2 * max_source_positions frames.
    return {"input_features": torch.randn(BATCH, 16, 16, generator=g), "labels": tokens(g, 8)}


def _decoder_config(cls: str, **kw: object) -> transformers.PreTrainedConfig:
    return getattr(transformers, cls)(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=32, **kw,
    )  # fmt: skip


def _configs() -> dict[str, tuple[str, transformers.PreTrainedConfig]]:
    bert = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        intermediate_size=FFN, max_position_embeddings=32, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    t5 = transformers.T5Config(
        vocab_size=VOCAB, d_model=HIDDEN, d_kv=8, d_ff=FFN, num_layers=LAYERS, num_decoder_layers=LAYERS,
        num_heads=HEADS, relative_attention_num_buckets=8, dropout_rate=0.0, decoder_start_token_id=0,
        pad_token_id=0,
    )  # fmt: skip
    vit = transformers.ViTConfig(
        image_size=16, patch_size=4, num_channels=3, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, intermediate_size=FFN, num_labels=10, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    whisper = transformers.WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=16, encoder_layers=LAYERS, decoder_layers=LAYERS, d_model=HIDDEN,
        encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=FFN,
        decoder_ffn_dim=FFN, max_source_positions=8, max_target_positions=16, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, decoder_start_token_id=1, suppress_tokens=None,
        begin_suppress_tokens=None,
    )  # fmt: skip
    return {
        "bert": ("BertForMaskedLM", bert),
        "t5": ("T5ForConditionalGeneration", t5),
        "vit": ("ViTForImageClassification", vit),
        "whisper": ("WhisperForConditionalGeneration", whisper),
        "llama": ("LlamaForCausalLM", _decoder_config("LlamaConfig")),
        "mixtral": (
            "MixtralForCausalLM",
            _decoder_config(
                "MixtralConfig", num_local_experts=4, num_experts_per_tok=2, output_router_logits=True
            ),
        ),
        # Its router runs under `torch.autocast(enabled=False)` ("Force float32").
        "ernie_moe": (
            "Ernie4_5_MoeForCausalLM",
            _decoder_config(
                "Ernie4_5_MoeConfig", moe_intermediate_size=32, moe_k=2, moe_num_experts=4,
                moe_num_shared_experts=1, moe_layer_start_index=0, output_router_logits=True,
            ),
        ),
    }  # fmt: skip


_BATCHES = {
    "bert": bert_batch,
    "t5": seq2seq_batch,
    "vit": vit_batch,
    "whisper": whisper_batch,
    "llama": causal_lm_batch,
    "mixtral": causal_lm_batch,
    "ernie_moe": causal_lm_batch,
}


def checkpointed(build: Callable[[], torch.nn.Module], reentrant: bool) -> Callable[[], torch.nn.Module]:
    """``build`` followed by HF's ``gradient_checkpointing_enable(use_reentrant=...)``, in train mode."""

    def build_checkpointed() -> torch.nn.Module:
        model = build()
        with warnings.catch_warnings():  # 5.x renamed it activation_checkpointing_enable; the old name warns
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        return model

    return build_checkpointed


def _cases() -> dict[str, Case]:
    out = {
        "gpt2_sdpa": Case(_model("GPT2LMHeadModel", gpt2_config()), causal_lm_batch, hf_step),
        "gpt2_eager": Case(_model("GPT2LMHeadModel", gpt2_config(), "eager"), causal_lm_batch, hf_step),
        # torch.autocast(enabled=False) around q @ k^T, then "Error with upcasting" unless it held.
        "gpt2_upcast": Case(
            _model("GPT2LMHeadModel", gpt2_config(reorder_and_upcast_attn=True), "eager"),
            causal_lm_batch,
            hf_step,
        ),
        "gpt2_upcast_cross": Case(
            _model(
                "GPT2LMHeadModel",
                gpt2_config(reorder_and_upcast_attn=True, add_cross_attention=True),
                "eager",
            ),
            gpt2_cross_batch,
            hf_step,
        ),
    }
    for name, (cls, config) in _configs().items():
        out[name] = Case(_model(cls, config), _BATCHES[name], hf_step)
    for name in ("gpt2_sdpa", "llama", "t5", "bert"):
        for reentrant in (False, True):
            case = out[name]
            out[f"{name}_hfckpt_{'reentrant' if reentrant else 'nonreentrant'}"] = Case(
                checkpointed(case.build, reentrant), case.batch, case.step
            )
    return out


CASES = _cases()
