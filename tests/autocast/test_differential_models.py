"""Whole models, forward and backward, under mixprec.autocast vs torch.autocast on CPU."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec


def conv_net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.GroupNorm(4, 16),
        nn.GELU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    )


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int = 50, d: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, 4, dim_feedforward=64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        return self.head(self.encoder(self.embed(tokens), mask=mask, is_causal=True))


def run(model: nn.Module, inputs: torch.Tensor, target: torch.Tensor, region) -> tuple:
    model.zero_grad(set_to_none=True)
    with region:
        out = model(inputs)
        loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return out, loss, grads


CASES = {
    "conv": (
        conv_net,
        lambda g: torch.randn(4, 3, 16, 16, generator=g),
        lambda g: torch.randint(0, 10, (4,), generator=g),
    ),
    "transformer": (
        TinyTransformer,
        lambda g: torch.randint(0, 50, (2, 12), generator=g),
        lambda g: torch.randint(0, 50, (2, 12), generator=g),
    ),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_model_matches_torch_autocast(case: str, dtype: torch.dtype) -> None:
    build, make_input, make_target = CASES[case]
    torch.manual_seed(0)
    model = build()
    twin = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    inputs, target = make_input(g), make_target(g)
    out_t, loss_t, grads_t = run(model, inputs, target, torch.autocast("cpu", dtype=dtype))
    out_m, loss_m, grads_m = run(twin, inputs, target, mixprec.autocast("cpu", dtype=dtype))
    assert out_m.dtype == out_t.dtype == dtype
    assert loss_m.dtype == loss_t.dtype == torch.float32
    torch.testing.assert_close(out_m, out_t, rtol=0, atol=0)
    torch.testing.assert_close(loss_m, loss_t, rtol=0, atol=0)
    assert grads_m.keys() == grads_t.keys()
    for name in grads_t:
        assert grads_m[name].dtype == grads_t[name].dtype, name
        torch.testing.assert_close(grads_m[name], grads_t[name], rtol=0, atol=0, msg=name)
    # and the region really changed something: fp32 gives a different loss
    _, loss_fp32, _ = run(copy.deepcopy(model), inputs, target, torch.autocast("cpu", enabled=False))
    assert not torch.equal(loss_fp32, loss_m)
