"""The bench's models: plain, standard torch modules with nothing precision-specific in them."""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention with a causal mask through ``F.scaled_dot_product_attention``."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not divisible by heads {heads}")
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (t.view(batch, time, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, time, width))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: attention then a 4x GELU MLP, each with a residual."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.ln_mlp = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_attn(x))
        return x + self.mlp(self.ln_mlp(x))


class CharGPT(nn.Module):
    """A GPT-style character-level language model (token + learned position embeddings, pre-LN blocks)."""

    def __init__(self, vocab_size: int, context: int, width: int, layers: int, heads: int) -> None:
        super().__init__()
        self.context = context
        self.tok_emb = nn.Embedding(vocab_size, width)
        self.pos_emb = nn.Embedding(context, width)
        self.blocks = nn.Sequential(*(Block(width, heads) for _ in range(layers)))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size)
        self.apply(_gpt_init)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(positions)
        return self.head(self.ln_f(self.blocks(x)))


def _gpt_init(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


class SmallCNN(nn.Module):
    """Three 3x3 conv layers (32-64-128 channels) with ReLU and two 2x2 max-pools, then a 2-layer head."""

    def __init__(self, image_size: int, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(64, 128, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        side = image_size // 4
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(128 * side * side, 256), nn.ReLU(), nn.Linear(256, classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class RegressionMLP(nn.Module):
    """The seeds' regression net: a ReLU MLP ending in one output, squeezed to shape (batch,)."""

    def __init__(self, features: int, hidden: int, layers: int = 2) -> None:
        super().__init__()
        sizes = [features] + [hidden] * layers
        body: list[nn.Module] = []
        for fan_in, fan_out in itertools.pairwise(sizes):
            body += [nn.Linear(fan_in, fan_out), nn.ReLU()]
        self.net = nn.Sequential(*body, nn.Linear(hidden, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)
