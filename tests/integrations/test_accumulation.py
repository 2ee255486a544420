"""Under gradient accumulation MixprecTrainer diagnoses the micro-batch that overflowed, not the last one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import mixprec  # noqa: E402
from mixprec.integrations.transformers import MixprecTrainer  # noqa: E402
from tests.integrations import _tiny_hf as tiny  # noqa: E402


class Plain(nn.Module):
    """Two linears, no normalisation: a large input makes the head's weight gradient large."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": nn.functional.cross_entropy(self.head(self.body(x)), labels)}


class Data(torch.utils.data.Dataset):
    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(64, 16, generator=generator)
        self.y = torch.randint(0, 4, (64,), generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


class LargeThird:
    """The default collator, but the third batch built (micro-batch 1 of step 2) is 1000x larger: finite in
    the forward, its scaled backward overflows; the fourth (the last of step 2) is clean."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        batch = transformers.default_data_collator(features)
        self.calls += 1
        if self.calls == 3:
            batch["x"] = batch["x"] * 1000
        return batch


def test_the_overflowing_micro_batch_is_diagnosed(tmp_path: Path) -> None:
    torch.manual_seed(0)
    args = tiny.training_args(str(tmp_path), max_steps=4, gradient_accumulation_steps=2)
    scaler = mixprec.GradScaler(init_scale=2.0**10)
    trainer = MixprecTrainer(
        model=Plain(), args=args, train_dataset=Data(), data_collator=LargeThird(), dtype=torch.float16,
        scaler=scaler,
    )  # fmt: skip
    trainer.train()
    assert scaler.skipped_steps == 1
    (sentence,) = trainer.mixprec_diagnoses
    assert sentence.startswith("mixprec: step 2 skipped its optimizer step. In micro-batch 1 of 2: Backward:")
    assert "module 'head'" in sentence
