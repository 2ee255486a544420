"""The reference algorithms the master-weight paths must reproduce, run in the same process as the code.

Two small oracles, each the textbook form of what mixprec optimises:

* :class:`ScratchCompensated`: pure bf16 weights stepped through fp32 *scratch* copies. The torch optimizer
  steps fp32 copies of the weights (gradients cast to fp32), and the update ``scratch - weight`` is applied
  to the bf16 weight by Kahan summation or stochastic rounding (Zamirai et al. 2020, "Revisiting BFloat16
  Training")::

      kahan:       v = scratch + c;  w = round(v);  c = v - w     # c: a bf16 buffer per weight
      stochastic:  w = truncate(bits(scratch) + 16 random bits)   # rounds up with the dropped fraction

* :class:`PersistentMasters`: apex O2 as Micikevicius et al. 2018 describe it, with a persistent fp32
  gradient copy per master and ``torch.amp.GradScaler`` (torch as the oracle of the scale) on the masters.

They use torch's optimizers and foreach ops only, so a test compares mixprec with them bit for bit on any
CPU: both sides see the same bf16 forward and backward of the same process.
"""

from __future__ import annotations

import torch

_KEEP_HIGH_16_BITS = -65536  # 0xFFFF0000 as int32: clears the low 16 bits of an fp32 pattern


class ScratchCompensated:
    """A torch optimizer stepping fp32 scratch copies of bf16 weights; ``make(params)`` builds it."""

    def __init__(self, make, weights: list[torch.Tensor], method: str, seed: int) -> None:
        self.weights = weights
        self.method = method
        self.scratch = [torch.nn.Parameter(w.detach().float()) for w in weights]
        self.optimizer = make(self.scratch)
        self.compensation = [torch.zeros_like(w) for w in weights] if method == "kahan" else []
        self.generator = torch.Generator().manual_seed(seed)

    @torch.no_grad()
    def step(self) -> None:
        for s, w in zip(self.scratch, self.weights, strict=True):
            s.copy_(w)
            s.grad = w.grad.float()
        self.optimizer.step()
        if self.method == "kahan":
            torch._foreach_add_(self.scratch, self.compensation)
            torch._foreach_copy_(self.weights, self.scratch)
            torch._foreach_sub_(self.scratch, self.weights)
            torch._foreach_copy_(self.compensation, self.scratch)
        else:
            for w, s in zip(self.weights, self.scratch, strict=True):
                bits = s.view(torch.int32)
                noise = torch.randint(0, 2**16, s.shape, dtype=torch.int32, generator=self.generator)
                bits.add_(noise).bitwise_and_(_KEEP_HIGH_16_BITS)
                w.copy_(s)  # exact: the low 16 bits are zero

    def zero_grad(self) -> None:
        for w in self.weights:
            w.grad = None

    def named_tensors(self) -> dict[str, torch.Tensor]:
        out = {f"comp.{i}": c for i, c in enumerate(self.compensation)}
        return {**out, **state_tensors(self.optimizer)}


class PersistentMasters:
    """fp32 masters with persistent fp32 gradients behind a model of bf16 (and kept fp32) parameters."""

    def __init__(self, make, params: list[torch.Tensor]) -> None:
        self.params = params
        self.low = [p for p in params if p.dtype == torch.bfloat16]
        self.masters = [torch.nn.Parameter(p.detach().float()) for p in self.low]
        by_id = dict(zip(map(id, self.low), self.masters, strict=True))
        self.optimizer = make([by_id.get(id(p), p) for p in params])
        for m in self.masters:
            m.grad = torch.zeros_like(m)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    @torch.no_grad()
    def step(self) -> None:
        torch._foreach_copy_([m.grad for m in self.masters], [p.grad for p in self.low])
        self.scaler.step(self.optimizer)
        self.scaler.update()
        torch._foreach_copy_(self.low, self.masters)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def named_tensors(self) -> dict[str, torch.Tensor]:
        out = {f"master.{i}": m for i, m in enumerate(self.masters)}
        return {**out, **state_tensors(self.optimizer)}


def state_tensors(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The optimizer's tensor state by parameter index, as fp32 (``step`` counters left out)."""
    out = {}
    for index, state in optimizer.state_dict()["state"].items():
        for key, value in state.items():
            if torch.is_tensor(value) and key != "step":
                out[f"state.{index}.{key}"] = value.float()
    return out
