"""Training scenarios whose results the original (pre-issue-12) code recorded in ``original_digests.json``.

The scenarios use only public API that both the original and the current code have, so the digests can be
regenerated from the original source tree::

    PYTHONPATH=<old>/src python tests/master/original_scenarios.py > tests/master/original_digests.json

Each scenario returns named tensors; :func:`digest` hashes their bytes (dtype and shape included), so a test
compares bit for bit without storing weights.
"""

from __future__ import annotations

import hashlib
import json

import torch
from torch import nn

from mixprec.master.recipes import initialize

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
# Not recorded from the original (it had no bf16 state): beta2 = 0.99 keeps Adam's state in bf16 now.
BF16_STATE = {
    "adam-0.99": lambda ps: torch.optim.Adam(ps, lr=1e-3, betas=(0.9, 0.99)),
    "adamw-0.99": lambda ps: torch.optim.AdamW(ps, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1),
}


def train(
    level: str, optimizer: str, overflow: bool = False, fp32_state: bool = False, **overrides
) -> dict[str, torch.Tensor]:
    """``STEPS`` steps; ``fp32_state`` (current code only) keeps a CompensatedOptimizer's state in fp32."""
    net = model(batchnorm=level == "O2")
    make = {**OPTIMIZERS, **BF16_STATE}[optimizer]
    net, opt = initialize(net, make(net.parameters()), level, **overrides)
    if fp32_state:
        opt.optimizer.state_dtype = torch.float32
    g = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        x = torch.randn(16, 8, generator=g)
        opt.zero_grad()
        loss = net(x).float().square().mean()
        if overflow and step == OVERFLOW_STEP:
            loss = loss * float("inf")
        opt.backward(loss)
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
                out[f"state.{index}.{key}"] = value.float()  # state may now be kept in bf16
    return out


def scenarios() -> dict[str, dict[str, torch.Tensor]]:
    runs = {}
    for name in OPTIMIZERS:
        runs[f"kahan/{name}"] = train("bf16-true", name, weight_update="kahan")
        runs[f"stochastic/{name}"] = train("bf16-true", name, weight_update="stochastic")
    runs["O2/adam/overflow"] = train("O2", "adam", overflow=True)
    runs["O2/sgd-momentum/overflow"] = train("O2", "sgd-momentum", overflow=True)
    return runs


def digest(tensors: dict[str, torch.Tensor], prefix: str = "") -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        if not name.startswith(prefix):
            continue
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


PARTS = ("model.", "master.", "state.", "comp.")

if __name__ == "__main__":
    torch.set_num_threads(1)
    print(json.dumps({k: {p: digest(v, p) for p in PARTS} for k, v in scenarios().items()}, indent=1))
