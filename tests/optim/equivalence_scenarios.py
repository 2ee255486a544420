"""Training scenarios run twice in one process: by mixprec and by the reference in ``scratch_reference.py``.

Each scenario returns named tensors (model weights, masters, optimizer state, Kahan buffers after ``STEPS``
steps); the tests compare the two sides bit for bit, so the result holds on any CPU and kernel set.
"""

from __future__ import annotations

import torch
from scratch_reference import PersistentMasters, ScratchCompensated
from torch import nn

from mixprec.amp import initialize

STEPS = 20
OVERFLOW_STEP = 7


def model(seed: int = 0, batchnorm: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    layers = [nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 4)]
    if batchnorm:
        layers.insert(1, nn.BatchNorm1d(32))
    return nn.Sequential(*layers)


OPTIMIZERS = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
    "adam-l2": lambda ps: torch.optim.Adam(ps, lr=1e-3, weight_decay=0.1),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.01, nesterov=True),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3),  # no fast path: the generic wrapper
}
# beta2 = 0.99 keeps Adam's state in bf16 by default (the reference keeps it in fp32).
BF16_STATE = {
    "adam-0.99": lambda ps: torch.optim.Adam(ps, lr=1e-3, betas=(0.9, 0.99)),
    "adamw-0.99": lambda ps: torch.optim.AdamW(ps, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1),
}


def _batches(overflow: bool):
    g = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        yield torch.randn(16, 8, generator=g), overflow and step == OVERFLOW_STEP


def _loss(out: torch.Tensor, overflow: bool) -> torch.Tensor:
    loss = out.float().square().mean()
    return loss * float("inf") if overflow else loss


def train(
    level: str, optimizer: str, overflow: bool = False, fp32_state: bool = False, **overrides
) -> dict[str, torch.Tensor]:
    """``STEPS`` steps through ``initialize``; ``fp32_state`` keeps a CompensatedOptimizer's state in fp32."""
    net = model(batchnorm=level == "O2")
    make = {**OPTIMIZERS, **BF16_STATE}[optimizer]
    net, opt = initialize(net, make(net.parameters()), level, **overrides)
    if fp32_state:
        opt.optimizer.state_dtype = torch.float32
    for x, blow_up in _batches(overflow):
        opt.zero_grad()
        opt.backward(_loss(net(x), blow_up))
        opt.step()
    out = {f"model.{k}": v for k, v in net.state_dict().items()}
    for i, master in enumerate(getattr(opt, "master_params", [])):
        out[f"master.{i}"] = master
    for i, comp in enumerate(getattr(opt.optimizer, "compensation", [])):
        out[f"comp.{i}"] = comp
    inner = opt.optimizer.optimizer if hasattr(opt.optimizer, "optimizer") else opt.optimizer
    for index, state in inner.state_dict()["state"].items():
        for key, value in state.items():
            if torch.is_tensor(value) and key != "step":
                out[f"state.{index}.{key}"] = value.float()  # state may be kept in bf16
    return out


def train_reference(level: str, optimizer: str, overflow: bool = False, weight_update: str = "kahan"):
    """The same scenario by the reference: the model cast by hand, the reference optimizer stepping it."""
    net = model(batchnorm=level == "O2").bfloat16()
    make = {**OPTIMIZERS, **BF16_STATE}[optimizer]
    if level == "O2":
        net[1].float()  # BatchNorm kept in fp32
        ref = PersistentMasters(make, list(net.parameters()))
    else:
        ref = ScratchCompensated(make, list(net.parameters()), weight_update, seed=torch.initial_seed())
    for x, blow_up in _batches(overflow):
        ref.zero_grad()
        loss = _loss(net(x.bfloat16()), blow_up)
        ref.backward(loss) if level == "O2" else loss.backward()
        ref.step()
    return {**{f"model.{k}": v for k, v in net.state_dict().items()}, **ref.named_tensors()}
