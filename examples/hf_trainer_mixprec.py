"""HF Trainer with mixprec: a tiny GPT-2 (random init, nothing downloaded) under a mixprec policy.

python examples/hf_trainer_mixprec.py

Trains 20 steps on CPU in bfloat16 under a policy that keeps the first block's MLP in float32 (mixprec owns
the precision: ``bf16=False`` for the Trainer), checks with ``mixprec.inspect.trace_dtypes`` which dtype
the matmuls ran in, then trains 20 steps in float16 with ``mixprec.GradScaler(hysteresis=2)`` on data whose
step 12 holds an inf: that step is skipped, counted, logged and explained, and the LR schedule does not
advance for it.
"""

import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

import mixprec
from mixprec.inspect import trace_dtypes
from mixprec.integrations.transformers import MixprecTrainer

STEPS, BATCH = 20, 8


class Copies(torch.utils.data.Dataset):
    """Eight token sequences, repeated (the model can memorise them); with ``inf_step`` (1-based), fed as
    embeddings, every sample that step (whatever the sampler) sees holds an inf."""

    def __init__(self, inf_step: int | None = None) -> None:
        eight = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(0))
        self.ids = eight.repeat(STEPS * BATCH // 8, 1)
        self.embeds = None if inf_step is None else torch.zeros(STEPS * BATCH, 16, 32)
        self.inf_step, self.fetched = inf_step, 0

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        if self.embeds is None:
            return {"input_ids": self.ids[i], "labels": self.ids[i]}
        self.fetched += 1  # samples are fetched in the order they are used (no dataloader workers)
        embeds = self.embeds[i].clone()
        if (self.fetched - 1) // BATCH + 1 == self.inf_step:
            embeds[0, 0] = float("inf")
        return {"inputs_embeds": embeds, "labels": self.ids[i]}


def train(out: str, data: Copies, **kwargs) -> tuple[MixprecTrainer, GPT2LMHeadModel]:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))
    args = TrainingArguments(
        output_dir=out, max_steps=STEPS, per_device_train_batch_size=BATCH, learning_rate=3e-3,
        use_cpu=True, report_to="none", logging_steps=1, save_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    trainer = MixprecTrainer(model=model, args=args, train_dataset=data, **kwargs)
    with trace_dtypes(model) as trace:
        trainer.train()
    trainer.trace = trace
    return trainer, model


def main() -> None:
    transformers.logging.set_verbosity_error()
    with tempfile.TemporaryDirectory() as out:
        policy = mixprec.Policy.preset("bf16-mixed").with_modules({"transformer.h.0.mlp": torch.float32})
        trainer, _ = train(out, Copies(), policy=policy)
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        print(f"bf16: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
        for name in ("transformer.h.0.mlp.c_fc", "transformer.h.1.mlp.c_fc"):
            dtypes = sorted(str(d).removeprefix("torch.") for d in trainer.trace.counts[name]["addmm"])
            print(f"  {name} matmuls ran in {', '.join(dtypes)}")

        scaler = mixprec.GradScaler(init_scale=2.0**12, hysteresis=2)
        trainer, _ = train(out, Copies(inf_step=12), dtype=torch.float16, scaler=scaler)
        logs = {entry["step"]: entry for entry in trainer.state.log_history if "loss" in entry}
        last = logs[STEPS]
        print(f"fp16: skipped_steps {last['skipped_steps']:g}, loss_scale {last['loss_scale']:g}")
        rates = ", ".join(f"{logs[step]['learning_rate']:g}" for step in (11, 12, 13, 14))
        print(f"  learning_rate at steps 11, 12, 13, 14: {rates}")  # 4.x logs it after the step's update
        print(f"  scheduler steps {trainer.lr_scheduler.last_epoch} of {STEPS}")
        print("  diagnosis:", *trainer.mixprec_diagnoses)


if __name__ == "__main__":
    main()
