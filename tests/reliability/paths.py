"""Every master-weight path of mixprec as data: a name, how to build it, what its gradients are.

The optimizer-edit cases and the long-run tests iterate over :data:`PATHS`, so a new path is one entry.
Each builder takes a fresh fp32 model and a torch optimizer built on it and returns ``(model, optimizer)``
with ``backward(loss)``, ``step()`` and ``zero_grad()``; ``forward`` casts inputs as the path needs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import mixprec


@dataclass(frozen=True)
class Path:
    """One way mixprec steps a model's weights.

    Args:
        name: readable id.
        build: ``build(model, optimizer) -> (model, wrapped optimizer)``.
        grad_dtype: dtype of the gradients the optimizer sees before unscaling (the model's dtype).
        guarded: whether the huge-gradient guard covers it (a step whose gradient square overflows the
            optimizer state is skipped).
    """

    name: str
    build: Callable[[nn.Module, torch.optim.Optimizer], tuple[nn.Module, Any]]
    grad_dtype: torch.dtype
    guarded: bool = True


def _init(level: str, **kw: Any) -> Callable[[nn.Module, torch.optim.Optimizer], tuple[nn.Module, Any]]:
    return lambda model, opt: mixprec.initialize(model, opt, level, **kw)


class _Cast(nn.Module):
    """A model in a half dtype whose inputs are cast to it (what ``initialize`` does for O2/O3)."""

    def __init__(self, inner: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.inner = inner.to(dtype)
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.to(self.dtype)).float()


def _direct_mpo(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[nn.Module, Any]:
    cast = _Cast(model, torch.bfloat16)
    return cast, mixprec.MixedPrecisionOptimizer(opt)


PATHS: tuple[Path, ...] = (
    Path("O1", _init("O1"), torch.float32),
    Path("O2", _init("O2"), torch.bfloat16),
    Path("O2-fp16", _init("O2", dtype=torch.float16), torch.float16),
    Path("bf16-true", _init("bf16-true"), torch.bfloat16),
    Path("16-true", _init("16-true"), torch.float16),
    Path("MixedPrecisionOptimizer", _direct_mpo, torch.bfloat16),
    Path("bf16-true+kahan", _init("bf16-true", weight_update="kahan"), torch.bfloat16, guarded=False),
    Path("bf16-true+stochastic", _init("bf16-true", weight_update="stochastic"), torch.bfloat16, False),
)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def prepared(path: Path, lr: float = 1e-2, steps: int = 1) -> dict[str, Any]:
    """``{"model", "opt", "x", "y"}``: the path built on Adam and stepped ``steps`` times."""
    net = model()
    net, opt = path.build(net, torch.optim.Adam(net.parameters(), lr=lr))
    torch.manual_seed(1)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    for _ in range(steps):
        train_step(net, opt, x, y)
    return {"model": net, "opt": opt, "x": x, "y": y}


def train_step(net: nn.Module, opt: Any, x: torch.Tensor, y: torch.Tensor, factor: float = 1.0) -> float:
    """One step on ``factor`` times the MSE loss; returns the unscaled loss."""
    opt.zero_grad()
    loss = (net(x).float() - y).pow(2).mean()
    opt.backward(loss * factor)
    opt.step()
    return float(loss.detach())
