"""torch's own modules in tiny sizes: Transformer, TransformerEncoderLayer, MultiheadAttention, RNNs.

Each case is (module, inputs, step). The eval cases run under ``no_grad``, where torch's Transformer
layers and MultiheadAttention take their fused fast path unless autocast is enabled; a region that is
invisible to torch would take another code path than torch.autocast.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tests.models.zoo import Batch, Case

D, HEADS, FFN, BATCH, SEQ, VOCAB = 32, 4, 64, 2, 10, 64


def _mse_step(model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    out = model(*batch["inputs"])
    return F.mse_loss(out, batch["target"]), out


def _features(*shape: int) -> Callable:
    def batch(g: torch.Generator) -> Batch:
        x = torch.randn(*shape, generator=g)
        return {"inputs": (x,), "target": torch.randn(*shape[:-1], D, generator=g)}

    return batch


class Seq2Seq(nn.Module):
    """nn.Transformer (2+2 layers) between an embedding and a vocabulary head, causal target mask."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.core = nn.Transformer(D, HEADS, 2, 2, FFN, dropout=0.0, batch_first=True)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        return self.head(self.core(self.embed(src), self.embed(tgt), tgt_mask=mask, tgt_is_causal=True))


def seq2seq_batch(g: torch.Generator) -> Batch:
    return {
        "src": torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
        "tgt": torch.randint(0, VOCAB, (BATCH, 8), generator=g),
        "labels": torch.randint(0, VOCAB, (BATCH, 8), generator=g),
    }


def seq2seq_step(model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(batch["src"], batch["tgt"])
    return F.cross_entropy(logits.reshape(-1, VOCAB), batch["labels"].reshape(-1)), logits


class Encoder(nn.Module):
    """2-layer nn.TransformerEncoder with a key padding mask; eval under no_grad is its fused fast path.

    Nested tensors are off: with them torch.autocast itself raises on CPU ("expected scalar type Float
    but found BFloat16", torch 2.13), so there is no oracle to compare with.
    """

    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(D, HEADS, FFN, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pad = torch.zeros(x.shape[:2], dtype=torch.bool)
        pad[1, -3:] = True
        return self.encoder(x, src_key_padding_mask=pad)


class SelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(D, HEADS, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, x, x, need_weights=False)[0]


class Recurrent(nn.Module):
    """nn.GRU / nn.LSTM (2 layers) over a sequence; the output sequence is the result."""

    def __init__(self, cls: type[nn.RNNBase]) -> None:
        super().__init__()
        self.rnn = cls(16, D, num_layers=2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x)[0]


class Cell(nn.Module):
    """nn.GRUCell / nn.LSTMCell unrolled over a sequence; the stacked hidden states are the result."""

    def __init__(self, cls: type[nn.RNNCellBase]) -> None:
        super().__init__()
        self.cell = cls(16, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state, outs = None, []
        for t in range(x.shape[1]):
            state = self.cell(x[:, t], state)
            outs.append(state[0] if isinstance(state, tuple) else state)
        return torch.stack(outs, 1)


class Checkpointed(nn.Module):
    """Two MLP blocks with a LayerNorm, each under ``torch.utils.checkpoint`` (reentrant or not).

    ``reentrant=None`` runs the same blocks without checkpointing.
    """

    def __init__(self, reentrant: bool | None, **checkpoint_kwargs: Any) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.checkpoint_kwargs = checkpoint_kwargs
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(D), nn.Linear(D, FFN), nn.GELU(), nn.Linear(FFN, D)) for _ in range(2)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.reentrant is None:
                x = x + block(x)
            else:
                x = x + checkpoint(block, x, use_reentrant=self.reentrant, **self.checkpoint_kwargs)
        return x.softmax(-1)


def checkpointed_batch(g: torch.Generator) -> Batch:
    # The reentrant variant only builds a graph when an input requires grad.
    x = torch.randn(BATCH, SEQ, D, generator=g).requires_grad_()
    return {"inputs": (x,), "target": torch.randn(BATCH, SEQ, D, generator=g)}


CASES = {
    "nn_transformer": Case(Seq2Seq, seq2seq_batch, seq2seq_step),
    "nn_encoder": Case(Encoder, _features(BATCH, SEQ, D), _mse_step),
    "nn_mha": Case(SelfAttention, _features(BATCH, SEQ, D), _mse_step),
    "nn_gru": Case(lambda: Recurrent(nn.GRU), _features(BATCH, SEQ, 16), _mse_step),
    "nn_lstm": Case(lambda: Recurrent(nn.LSTM), _features(BATCH, SEQ, 16), _mse_step),
    "nn_grucell": Case(lambda: Cell(nn.GRUCell), _features(BATCH, SEQ, 16), _mse_step),
    "nn_lstmcell": Case(lambda: Cell(nn.LSTMCell), _features(BATCH, SEQ, 16), _mse_step),
    "ckpt_nonreentrant": Case(lambda: Checkpointed(False), checkpointed_batch, _mse_step),
    "ckpt_reentrant": Case(lambda: Checkpointed(True), checkpointed_batch, _mse_step),
}
