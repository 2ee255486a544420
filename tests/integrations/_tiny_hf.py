"""A tiny GPT-2 (random init, nothing downloaded) trained by HF's Trainer.

Shared by the tests and by the oracle: ``python _tiny_hf.py OUT`` trains with the Trainer's own ``bf16=True``
path in a process that never imports mixprec (a mixprec engine may register process-wide kernels), and saves
the per-step losses and the final weights to OUT.
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

transformers.logging.set_verbosity_error()

VOCAB, SEQ, BATCH, STEPS, WIDTH = 64, 16, 4, 20, 32


def make_model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=WIDTH, n_layer=2, n_head=2)
    return GPT2LMHeadModel(config)


class TokenData(torch.utils.data.Dataset):
    """STEPS * BATCH fixed random token sequences; labels are the inputs (causal LM)."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, VOCAB, (STEPS * BATCH, SEQ), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class EmbedData(TokenData):
    """The same, fed as ``inputs_embeds``."""

    def __init__(self) -> None:
        super().__init__()
        self.embeds = torch.randn(STEPS * BATCH, SEQ, WIDTH, generator=torch.Generator().manual_seed(1))

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"inputs_embeds": self.embeds[i], "labels": self.ids[i]}


class InfCollator:
    """The default collator, but the batches it builds ``inf_steps``-th (1-based) hold an inf embedding.

    Batches are collated in the order they are used, whatever the sampler, so these are those steps.
    """

    def __init__(self, inf_steps: tuple[int, ...]) -> None:
        self.inf_steps, self.calls = inf_steps, 0

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        batch = transformers.default_data_collator(features)
        self.calls += 1
        if self.calls in self.inf_steps:
            batch["inputs_embeds"][0, 3, 5] = float("inf")
        return batch


def training_args(out_dir: str, **overrides: Any) -> TrainingArguments:
    settings: dict[str, Any] = dict(
        output_dir=out_dir,
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        learning_rate=1e-3,
        use_cpu=True,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    return TrainingArguments(**{**settings, **overrides})


def train(
    trainer_cls: type = Trainer, out_dir: str = "", data: Any = None, args: dict | None = None, **kw: Any
):
    """Train make_model() for STEPS steps; return (trainer, model)."""
    model = make_model()
    trainer = trainer_cls(
        model=model, args=training_args(out_dir, **(args or {})), train_dataset=data or TokenData(), **kw
    )
    trainer.train()
    return trainer, model


def result(trainer: Trainer, model: torch.nn.Module) -> dict[str, Any]:
    """Per-step losses (logging_steps=1, so each is that step's loss) and a copy of the weights."""
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


if __name__ == "__main__":
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        torch.save(result(*train(Trainer, tmp, args={"bf16": True})), sys.argv[1])
