"""An apex-era fine-tuning loop, unchanged but for one import, beside the same run on mixprec's own API.

The loop is the one BERT-era scripts wrote for NVIDIA apex: an fp16 model, ``FP16_Optimizer`` with
dynamic or static (128) loss scaling, a linear warm-up written into ``optimizer.param_groups`` every
step, ``optimizer.backward(loss)`` and ``optimizer.clip_master_grads(1.0)``; and the ``amp`` variant
(``amp.initialize(..., opt_level="O2")``, ``amp.scale_loss``, ``clip_grad_norm_`` on
``amp.master_params``). Each runs twice from the same seed: as written for apex (``mixprec.apex``) and
with mixprec's native API, and the example prints both losses and whether the weights are bit for bit
equal. fp16 has no fast CPU kernel, so the model is tiny (scikit-learn's 8x8 digits).

    python examples/apex_finetune.py [--steps 120] [--api fp16_optimizer|amp] [--loss-scale dynamic|128]
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from sklearn.datasets import load_digits
from torch import nn

import mixprec
from mixprec.apex import FP16_Optimizer, amp  # was: from apex import amp; apex.fp16_utils

BATCH, WARMUP, BASE_LR, MAX_NORM = 32, 20, 2e-3, 1.0


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    g = torch.Generator().manual_seed(0)
    picks = [torch.randint(0, len(x), (BATCH,), generator=g) for _ in range(steps)]
    return [(x[i], y[i]) for i in picks]


def pretrained() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 10))


def warmup_lr(step: int) -> float:
    return BASE_LR * min(1.0, (step + 1) / WARMUP)


def apex_fp16_optimizer(steps: int, loss_scale: str) -> tuple[nn.Module, list[float], Any]:
    """The loop as written for apex.fp16_utils.FP16_Optimizer."""
    model = pretrained().half()
    optimizer = torch.optim.AdamW(model.parameters(), lr=BASE_LR, weight_decay=0.01)
    if loss_scale == "dynamic":
        optimizer = FP16_Optimizer(optimizer, dynamic_loss_scale=True)
    else:
        optimizer = FP16_Optimizer(optimizer, static_loss_scale=float(loss_scale))
    losses = []
    for step, (x, y) in enumerate(batches(steps)):
        for group in optimizer.param_groups:
            group["lr"] = warmup_lr(step)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x.half()).float(), y)
        optimizer.backward(loss)
        optimizer.clip_master_grads(MAX_NORM)
        optimizer.step()
        losses.append(loss.item())
    return model, losses, optimizer


def apex_amp(steps: int, loss_scale: str) -> tuple[nn.Module, list[float], Any]:
    """The loop as written for apex.amp at O2."""
    model = pretrained()
    optimizer = torch.optim.AdamW(model.parameters(), lr=BASE_LR, weight_decay=0.01)
    scale = "dynamic" if loss_scale == "dynamic" else float(loss_scale)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", loss_scale=scale)
    losses = []
    for step, (x, y) in enumerate(batches(steps)):
        for group in optimizer.param_groups:
            group["lr"] = warmup_lr(step)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), MAX_NORM)
        optimizer.step()
        losses.append(loss.item())
    return model, losses, optimizer


def native(steps: int, loss_scale: str, api: str) -> tuple[nn.Module, list[float], Any]:
    """The same training with mixprec's own API: MixedPrecisionOptimizer / initialize and GradScaler."""
    model = pretrained()
    optimizer = torch.optim.AdamW(model.parameters(), lr=BASE_LR, weight_decay=0.01)
    if api == "amp":
        scale = "dynamic" if loss_scale == "dynamic" else float(loss_scale)
        extra = {"max_loss_scale": 2.0**24} if scale == "dynamic" else {}
        model, optimizer = mixprec.initialize(
            model, optimizer, "O2", dtype=torch.float16, loss_scale=scale, **extra
        )
    else:
        model.half()
        scaler = mixprec.GradScaler("cpu", init_scale=2.0**32, growth_interval=1000, min_scale=1.0)
        spec = scaler if loss_scale == "dynamic" else float(loss_scale)
        optimizer = mixprec.MixedPrecisionOptimizer(
            torch.optim.AdamW(model.parameters(), lr=BASE_LR, weight_decay=0.01), scaler=spec
        )
    losses = []
    for step, (x, y) in enumerate(batches(steps)):
        for group in optimizer.param_groups:
            group["lr"] = warmup_lr(step)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x if api == "amp" else x.half()).float(), y)
        optimizer.backward(loss)
        optimizer.clip_master_grads(MAX_NORM)
        optimizer.step()
        losses.append(loss.item())
    return model, losses, optimizer


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--api", choices=["fp16_optimizer", "amp"], default="fp16_optimizer")
    parser.add_argument("--loss-scale", default="dynamic", help="'dynamic' or a number such as 128")
    args = parser.parse_args()
    torch.set_num_threads(1)
    run = apex_fp16_optimizer if args.api == "fp16_optimizer" else apex_amp
    apex_model, apex_losses, apex_opt = run(args.steps, args.loss_scale)
    own_model, own_losses, own_opt = native(args.steps, args.loss_scale, args.api)
    pairs = zip(apex_model.state_dict().values(), own_model.state_dict().values(), strict=True)
    same = all(torch.equal(a, b) for a, b in pairs) and apex_losses == own_losses
    print(f"{args.api}, loss scale {args.loss_scale}, {args.steps} steps")
    for name, losses, opt in (
        ("mixprec.apex", apex_losses, apex_opt),
        ("mixprec native", own_losses, own_opt),
    ):
        print(
            f"{name:15} loss first {losses[0]:.4f}, last {losses[-1]:.4f}; "
            f"skipped steps {opt.skipped_steps}, final loss scale {opt.loss_scale:g}"
        )
    print(f"bitwise identical weights and losses: {same}")


if __name__ == "__main__":
    main()
