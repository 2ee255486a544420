"""Pure bf16 weights that keep small updates: Kahan-compensated or stochastically rounded updates.

A bf16 weight of 1.0 ignores any update below 2**-9. :class:`CompensatedOptimizer` keeps the weights in
bf16 (no fp32 master copy) and still lets small updates add up (Zamirai et al. 2020, "Revisiting BFloat16
Training").

The inner optimizer is untouched: it steps fp32 *scratch* copies that exist only during ``step()``, and the
wrapper applies ``update = scratch_after - weight`` to the bf16 weight in one of two ways::

    kahan:       v = w + update + c;  w = round(v);  c = v - w        # c: a bf16 buffer per param
    stochastic:  w = round_stochastic(w + update)    # up with probability (w + update - down) / ulp

Kahan carries what rounding dropped into the next step (2 bytes per param); stochastic rounding is unbiased in
expectation and needs no buffer (bf16 only: it truncates fp32 bit patterns after adding 16 random bits).

Scratch is materialized in chunks of at most ``scratch_numel`` elements and freed after each chunk, so the
fp32 copy never exists for the whole model at once. Chunking is exact for per-parameter optimizers (SGD, Adam,
AdamW, RMSprop, ...); an optimizer that couples parameters (a global norm inside ``step``) needs
``scratch_numel=None`` (one chunk).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.optim import Optimizer

from mixprec.master import LOW_PRECISION_DTYPES, OptimizerWrapper

__all__ = ["METHODS", "CompensatedOptimizer"]

METHODS: dict[str, frozenset[torch.dtype]] = {
    "kahan": frozenset(LOW_PRECISION_DTYPES),
    "stochastic": frozenset({torch.bfloat16}),
}
_STATE_KEYS = ("method", "optimizer", "compensation", "generators")
_KEEP_HIGH_16_BITS = -65536  # 0xFFFF0000 as int32: clears the low 16 bits of an fp32 pattern


class CompensatedOptimizer(OptimizerWrapper):
    """Steps low-precision weights in place through fp32 scratch, compensating the rounding of each update.

    Args:
        optimizer: a torch optimizer built on the (bf16) model parameters. It is taken over: its low-precision
            params are replaced by fp32 scratch params that hold storage only during ``step()``.
        method: ``"kahan"`` or ``"stochastic"``.
        seed: seed of the stochastic-rounding generators (default: ``torch.initial_seed()``).
        scratch_numel: most fp32 scratch elements alive at once; None steps all params in one chunk.

    Raises:
        ValueError: for an unknown method or a parameter dtype the method cannot round.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        method: str = "kahan",
        *,
        seed: int | None = None,
        scratch_numel: int | None = 2**24,
    ) -> None:
        if method not in METHODS:
            raise ValueError(f"unknown compensation method {method!r}; accepted: {sorted(METHODS)}")
        if scratch_numel is not None and scratch_numel < 1:
            raise ValueError(f"scratch_numel must be a positive int or None, got {scratch_numel!r}")
        super().__init__(optimizer)
        self.method = method
        self.scratch_numel = scratch_numel
        self.seed = torch.initial_seed() if seed is None else seed  # reads, never draws from, torch's RNG
        self.model_params: list[torch.Tensor] = []
        self.scratch_params: list[torch.Tensor] = []
        self.compensation: list[torch.Tensor] = []
        self.generators: dict[str, torch.Generator] = {}
        for group in optimizer.param_groups:
            group["params"] = [self._scratch_for(p) for p in group["params"]]

    def _scratch_for(self, param: torch.Tensor) -> torch.Tensor:
        """An fp32 stand-in for a low-precision param, without storage until a step needs it."""
        if param.dtype not in LOW_PRECISION_DTYPES:
            return param
        if param.dtype not in METHODS[self.method]:
            raise ValueError(
                f"method {self.method!r} cannot round to {param.dtype}; "
                f"dtypes it supports: {sorted(str(d) for d in METHODS[self.method])}"
            )
        if self.optimizer.state.get(param):
            raise ValueError("wrap the optimizer before its first step: it already holds state for a param")
        scratch = torch.nn.Parameter(torch.empty_like(param, dtype=torch.float32), param.requires_grad)
        scratch.untyped_storage().resize_(0)
        self.model_params.append(param)
        self.scratch_params.append(scratch)
        if self.method == "kahan":
            self.compensation.append(torch.zeros_like(param))
        return scratch

    def gradient_params(self) -> list[torch.Tensor]:
        """The model's params (scratch holds no gradient until :meth:`step` makes one from theirs)."""
        scratch_ids = {id(s) for s in self.scratch_params}
        own = [p for group in self.param_groups for p in group["params"] if id(p) not in scratch_ids]
        return [*self.model_params, *own]

    def _chunks(self, indices: list[int]) -> list[list[int]]:
        """Consecutive runs of params whose scratch fits ``scratch_numel`` (a bigger param is alone)."""
        if self.scratch_numel is None:
            return [indices]
        chunks: list[list[int]] = [[]]
        size = 0
        for i in indices:
            numel = self.model_params[i].numel()
            if chunks[-1] and size + numel > self.scratch_numel:
                chunks.append([])
                size = 0
            chunks[-1].append(i)
            size += numel
        return chunks

    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        """Step the inner optimizer chunk by chunk on fp32 scratch and apply the updates with compensation."""
        if closure is not None:
            raise ValueError("CompensatedOptimizer.step does not take a closure")
        live = [i for i, p in enumerate(self.model_params) if p.grad is not None]
        own = [p for p in self.gradient_params()[len(self.model_params) :] if p.grad is not None]
        own_grads = [p.grad for p in own]
        try:
            for n, chunk in enumerate(self._chunks(live)):
                for param, grad in zip(own, own_grads, strict=True):
                    # params without scratch (fp32 ones) step once, with the first chunk
                    param.grad = grad if n == 0 else None
                self._materialize(chunk)
                self.optimizer.step()
                with torch.no_grad():
                    self._apply(chunk)
                self._release(chunk)
        finally:
            for param, grad in zip(own, own_grads, strict=True):
                param.grad = grad

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the inner optimizer, with fp32 scratch for its low-precision params."""
        self.optimizer.add_param_group(param_group)
        group = self.optimizer.param_groups[-1]
        group["params"] = [self._scratch_for(p) for p in group["params"]]

    def _materialize(self, chunk: list[int]) -> None:
        scratch = [self.scratch_params[i] for i in chunk]
        for s, i in zip(scratch, chunk, strict=True):
            s.untyped_storage().resize_(s.numel() * s.element_size())
            s.grad = self.model_params[i].grad.to(torch.float32)
        if scratch:
            with torch.no_grad():
                torch._foreach_copy_(scratch, [self.model_params[i] for i in chunk])

    def _release(self, chunk: list[int]) -> None:
        for i in chunk:
            self.scratch_params[i].grad = None
            self.scratch_params[i].untyped_storage().resize_(0)

    def _apply(self, chunk: list[int]) -> None:
        if not chunk:
            return
        scratch = [self.scratch_params[i] for i in chunk]
        weights = [self.model_params[i] for i in chunk]
        if self.method == "kahan":
            _kahan_add(weights, scratch, [self.compensation[i] for i in chunk])
        else:
            for w, s in zip(weights, scratch, strict=True):
                _round_stochastic_into(w, s, self._generator(s.device))

    def _generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        if key not in self.generators:
            self.generators[key] = torch.Generator(device=device).manual_seed(self.seed)
        return self.generators[key]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's gradients (scratch never holds any between steps)."""
        self._zero_grads(self.model_params, set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """Inner optimizer state, Kahan compensation buffers and stochastic-rounding generator states."""
        return {
            "method": self.method,
            "optimizer": self.optimizer.state_dict(),
            "compensation": [c.detach() for c in self.compensation],
            "generators": {key: g.get_state() for key, g in self.generators.items()},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved.

        Raises:
            ValueError: for missing keys, another method, or compensation buffers of other shapes.
        """
        missing = [k for k in _STATE_KEYS if k not in state_dict]
        if missing:
            raise ValueError(f"state_dict lacks {missing}; a CompensatedOptimizer state has {_STATE_KEYS}")
        if state_dict["method"] != self.method:
            raise ValueError(
                f"state_dict was saved with method {state_dict['method']!r}, this is {self.method!r}"
            )
        saved = state_dict["compensation"]
        if [t.shape for t in saved] != [c.shape for c in self.compensation]:
            raise ValueError("saved compensation buffers do not match this optimizer's parameters")
        self.optimizer.load_state_dict(state_dict["optimizer"])
        with torch.no_grad():
            for buffer, value in zip(self.compensation, saved, strict=True):
                buffer.copy_(value)
        for key, rng_state in state_dict["generators"].items():
            self._generator(torch.device(key)).set_state(rng_state)


def _kahan_add(weights: list[torch.Tensor], scratch: list[torch.Tensor], comp: list[torch.Tensor]) -> None:
    """Kahan step: ``scratch`` holds ``w + update`` (fp32, from the inner optimizer) and is used as workspace.

    ``y = update + c`` and ``c' = y - (new - w)`` of the textbook form simplify to ``v = scratch + c``,
    ``new = round(v)``, ``c' = v - new``: four passes instead of seven.
    """
    torch._foreach_add_(scratch, comp)  # v = w + update + what earlier roundings dropped
    torch._foreach_copy_(weights, scratch)  # new = round-to-nearest(v)
    torch._foreach_sub_(scratch, weights)  # v - new, exact in fp32: new is v's bf16 neighbour
    torch._foreach_copy_(comp, scratch)


def _round_stochastic_into(weight: torch.Tensor, value: torch.Tensor, generator: torch.Generator) -> None:
    """``weight = value`` rounded to bf16 stochastically; ``value`` (fp32) is used as workspace."""
    bits = value.view(torch.int32)
    noise = torch.randint(0, 2**16, value.shape, dtype=torch.int32, device=value.device, generator=generator)
    bits.add_(noise).bitwise_and_(_KEEP_HIGH_16_BITS)  # carry into bit 16 with probability = dropped fraction
    weight.copy_(value)  # exact: the low 16 bits are zero
