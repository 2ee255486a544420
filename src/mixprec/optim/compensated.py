"""Pure low-precision weights that keep small updates: :class:`CompensatedOptimizer`.

A bf16 weight of 1.0 ignores any update below 2**-9. The wrapper keeps the weights in bf16 (or fp16), with
no fp32 master copy, and still lets small updates add up (Zamirai et al. 2020, "Revisiting BFloat16
Training"), in one of three ways::

    kahan:       v = w + update + c;  w = round(v);  c = v - w        # c: a bf16 buffer per weight
    stochastic:  w = round_stochastic(w + update)    # up with probability (w + update - down) / ulp
    nearest:     w = round(w + update)               # plain rounding (the update still computed in fp32)

Kahan carries what rounding dropped into the next step (2 bytes per weight); stochastic rounding is unbiased
in expectation and needs no buffer (bf16 only).

Two paths, chosen per optimizer:

* ``torch.optim.Adam``, ``AdamW`` and ``SGD``: mixprec steps the torch optimizer's own groups and state with
  foreach updates on the low-precision weights (``mixprec.optim.updates``; Adam/AdamW on bf16 weights
  with Kahan or stochastic rounding in one fused pass, ``mixprec.optim.fused_adam``). Each moving
  average is kept in bf16 where it can move in bf16, else fp32 (``state_dtype``): at torch's default Adam
  betas a bf16 first moment and an fp32 second moment. No fp32 copy of the model exists at any time.
* any other optimizer: it steps fp32 scratch copies of at most ``scratch_numel`` weights at a time (exact for
  per-parameter optimizers; one that couples parameters needs ``scratch_numel=None``), its state stays fp32.

Either path works through at most ``scratch_numel`` weights at a time, so no fp32 temporary ever spans
the whole model. Adam's ``step`` counter lives where the step reads it, as torch places it: on the
weight's device for the fused pass and low-bit states (torch's fused kernel reads it there, as in torch's
fused and capturable Adam), on the host for the foreach path (its bias corrections are host numbers, as
in torch's foreach Adam); a counter found elsewhere (loaded from a state_dict) moves once
(``updates.step_counters``).

With ``skip_nonfinite`` (the default) a step is skipped, state and weights untouched, when a gradient is
inf/nan or (Adam) its square would overflow the second moment; the fused Adam path checks inside its pass
(the fp32 copies of the gradients it makes anyway, before anything is written) when the step holds at most
``rounding.FOLD`` values (``rounding.CUDA_FOLD`` on a CUDA device), the others and bigger steps check the
gradients first. ``skipped_steps`` and
``last_step_skipped`` report it, and each skip warns.

Why not build on torch-optimi (whose ``kahan_sum`` this mirrors)? Its Adam has other hyperparameter
semantics than the torch optimizer a user hands to ``initialize`` (debiased betas, eps 1e-6, decay outside
the compensation), always keeps bf16 state (which freezes at beta2 = 0.999), overwrites ``.grad`` as
workspace, and has no stochastic rounding; it stays a benchmark peer, not a dependency (step times side by
side: docs/measured-figures.md).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.optim import Optimizer

from mixprec._generators import DeviceGenerators
from mixprec.formats import as_dtype
from mixprec.optim import updates
from mixprec.optim.fused_adam import AdamUnit, adam_step, check_lowbit_params, step_groups
from mixprec.optim.guard import HugeGradientGuard, grads_fit, grads_of
from mixprec.optim.rounding import CHUNK, CUDA_CHUNK, CUDA_FOLD, FOLD, Workspace
from mixprec.optim.sharding import agree_finite, local, local_params, replaced_params
from mixprec.optim.state import check_compensated_state, load_inner_state
from mixprec.optim.state_formats import TorchMoments
from mixprec.optim.wrapper import LOW_PRECISION_DTYPES, OptimizerWrapper, check_state_format

__all__ = ["METHODS", "CompensatedOptimizer"]

METHODS: dict[str, frozenset[torch.dtype]] = {
    "kahan": frozenset(LOW_PRECISION_DTYPES),
    "stochastic": frozenset({torch.bfloat16}),
    "nearest": frozenset(LOW_PRECISION_DTYPES),
}
_STATE_KEYS = ("method", "optimizer", "compensation", "generators")
_STATE_DTYPES = (None, torch.float32)


class CompensatedOptimizer(OptimizerWrapper):
    """Steps low-precision weights in place, compensating (or stochastically rounding) each update.

    Args:
        optimizer: a torch optimizer built on the (bf16/fp16) model parameters, before its first step.
            Its ``param_groups`` keep holding those parameters.
        method: ``"kahan"``, ``"stochastic"`` or ``"nearest"``.
        seed: seed of the stochastic-rounding generators (default: ``torch.initial_seed()``).
        scratch_numel: most weights stepped at once (consecutive whole tensors), which bounds the fp32
            temporaries: the scratch copies of the generic path, the fp32 values of fp32-state updates;
            None: all at once. It also caps the fused Adam pass's chunks (slices of the flattened
            tensors), which are at most ``rounding.CHUNK`` (2**18) values on a CPU and ``rounding.CUDA_CHUNK``
            (2**24) on a CUDA device: its workspace holds up to five fp32 buffers of a chunk (weights,
            gradients, both moments, Kahan buffers; 320 MiB on a GPU at the default) plus, for stochastic
            rounding, 2 bytes of random bits per chunk value, and a ``state_format`` step allocates up to
            8 bytes per value of a tensor's slice of the chunk for the moment it is encoding.
        state_dtype: None (bf16 where the method allows it, see ``mixprec.optim.updates.moment_dtypes``)
            or ``torch.float32`` (or its name, "fp32"; always fp32 state: bit for bit the torch optimizer
            stepping an fp32 scratch copy of each weight, then rounding it).
        skip_nonfinite: skip (and warn about) a step whose gradients are inf/nan or would overflow the
            optimizer state; False steps whatever comes, as torch does.
        state_format: None (the moments as ``state_dtype`` says) or ``"bf16"``, ``"int8"``, ``"fp8"``: Adam's
            moments stored in that low-bit format (``mixprec.optim.state_formats``), stepped chunk by
            chunk (``mixprec.optim.fused_adam``); needs ``torch.optim.Adam``/``AdamW`` (with any
            foreach/fused/capturable flag: the step is one fused pass whatever they say) and
            ``state_dtype=None``.

    Warns:
        UserWarning: when no parameter is bfloat16/float16 and ``state_format`` is None: fp32 parameters
            step exactly as the torch optimizer steps them, with nothing to compensate.

    Attributes:
        skipped_steps: steps skipped by ``skip_nonfinite`` so far.
        last_step_skipped: whether the latest ``step()`` was skipped by it.

    Raises:
        TypeError: ``optimizer`` is not an Optimizer, ``scratch_numel`` not an int, ``skip_nonfinite`` not
            a bool.
        ValueError: unknown method, a parameter dtype the method cannot round, a non-positive
            ``scratch_numel``, another ``state_dtype``, an unknown ``state_format`` (or one with an optimizer
            other than Adam/AdamW, or with ``state_dtype``), or an optimizer that already holds state.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        method: str = "kahan",
        *,
        seed: int | None = None,
        scratch_numel: int | None = 2**24,
        state_dtype: torch.dtype | str | None = None,
        skip_nonfinite: bool = True,
        state_format: str | None = None,
    ) -> None:
        if isinstance(state_dtype, str):
            state_dtype = as_dtype(state_dtype, "state_dtype")
        _check_args(optimizer, method, seed, scratch_numel, state_dtype)
        if not isinstance(skip_nonfinite, bool):
            raise TypeError(f"skip_nonfinite must be True or False, got {skip_nonfinite!r}")
        _check_params(optimizer, method, [p for g in optimizer.param_groups for p in g["params"]])
        _check_storage(optimizer, state_format, state_dtype)
        super().__init__(optimizer)
        self.method = method
        self.scratch_numel = scratch_numel
        self.state_dtype = state_dtype
        self.seed = torch.initial_seed() if seed is None else seed  # reads, never draws from, torch's RNG
        self.skip_nonfinite = skip_nonfinite
        self.state_format = state_format
        self.skipped_steps = 0
        self.last_step_skipped = False
        self.algorithm = self._fast_algorithm()
        self.model_params: list[torch.Tensor] = []
        self.compensation: list[torch.Tensor] = []
        self.generators = DeviceGenerators(self.seed)  # one per device the params are on, made lazily
        bounds = (CHUNK, FOLD, CUDA_CHUNK, CUDA_FOLD)  # scratch_numel caps the workspace on every device
        self.workspace = Workspace(*(min(n, scratch_numel or n) for n in bounds))
        for group in optimizer.param_groups:
            self._adopt(group["params"])
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if params and not self.model_params and state_format is None:
            # Rounding error only arises when the weights are bf16/fp16: on fp32 weights the wrapper is
            # the torch optimizer plus the non-finite skip, which a user asking for compensation should know.
            warnings.warn(
                f"CompensatedOptimizer({method!r}): none of the optimizer's {len(params)} parameters is "
                "bfloat16 or float16, so there is nothing to compensate: fp32 parameters step exactly as the "
                "torch optimizer steps them (plus the non-finite skip). Cast the model first "
                "(model.to(torch.bfloat16)) and build the optimizer on it, or use "
                "mixprec.initialize(model, optimizer, 'bf16-true', weight_update='kahan')",
                UserWarning,
                stacklevel=2,
            )

    def _fast_algorithm(self) -> str | None:
        """``updates.fast_algorithm`` of the inner optimizer; a low-bit state takes capturable Adam too."""
        return updates.fast_algorithm(self.optimizer, capturable=self.state_format is not None)

    def _adopt(self, params: list[torch.Tensor]) -> None:
        if self.state_format is not None:
            check_lowbit_params(params)
        for param in params:
            if param.dtype in LOW_PRECISION_DTYPES:
                self.model_params.append(param)
                state = self.optimizer.state.get(param, {})
                for key, value in state.items():  # built with the optimizer (Adagrad's sum): fp32, as stepped
                    if key != "step" and torch.is_tensor(value) and value.dtype in LOW_PRECISION_DTYPES:
                        state[key] = value.float()
                if self.method == "kahan":
                    shard = local(param)  # FSDP2: a buffer for this rank's shard only
                    self.compensation.append(torch.zeros_like(shard, memory_format=torch.preserve_format))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the inner optimizer; its low-precision params get compensation buffers."""
        if not isinstance(param_group, dict) or "params" not in param_group:
            raise TypeError(f"param_group must be a dict with 'params', got {param_group!r}")
        params = param_group["params"]
        params = [params] if torch.is_tensor(params) else list(params)
        held = [p for group in self.param_groups for p in group["params"]]
        _check_unique(held + params, "param_group")
        _check_params(self.optimizer, self.method, params)
        if self.state_format is not None:
            check_lowbit_params(params)
        self.optimizer.add_param_group({**param_group, "params": params})
        self._adopt(self.optimizer.param_groups[-1]["params"])
        self.algorithm = self._fast_algorithm()

    def _follow_groups(self) -> None:
        """Adopt low-precision params put into ``param_groups`` by hand (compensation buffers, a check)."""
        held = [p for group in self.param_groups for p in group["params"]]
        known = {id(p) for p in self.model_params}
        new = [
            p for p in held if id(p) not in known and torch.is_tensor(p) and p.dtype in LOW_PRECISION_DTYPES
        ]
        if not new and len(held) == len({id(p) for p in held}):
            return
        _check_unique(held, "param_groups")
        _check_params(self.optimizer, self.method, new)
        self._adopt(new)
        self.algorithm = self._fast_algorithm()

    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        """One step of the inner optimizer's algorithm, applied with this wrapper's rounding method."""
        if closure is not None:
            raise ValueError("CompensatedOptimizer.step does not take a closure")
        self._follow_groups()
        if self.state_format is not None and self.algorithm != "adam":
            raise ValueError(
                f"state_format={self.state_format!r} steps Adam/AdamW only; a param group added since "
                "makes the optimizer unsupported (amsgrad, differentiable or tensor options)"
            )
        with torch.no_grad():
            stepped = self._step_shards()
        self.last_step_skipped = not stepped
        if not stepped:
            self.skipped_steps += 1
            warnings.warn(
                "skipped an optimizer step: a gradient is inf/nan or its square overflows the optimizer "
                f"state (CompensatedOptimizer's update pass); weights and state unchanged, "
                f"{self.skipped_steps} such step(s) skipped so far",
                RuntimeWarning,
                stacklevel=2,
            )

    def _step_shards(self) -> bool:
        """Step this rank's shards of FSDP2 (DTensor) params as plain tensors, the other params as they are;
        ranks agree on skipping a non-finite step (one all-reduce, only with DTensor params)."""
        held = [p for group in self.param_groups for p in group["params"]]
        model_params = self.model_params
        with local_params(self.optimizer) as swapped:
            if not swapped:
                return self._step_fast() if self.algorithm is not None else self._step_generic()
            self.model_params = [swapped.get(id(p), p) for p in model_params]
            try:
                if self.skip_nonfinite:
                    graded = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
                    if not agree_finite(held, grads_fit(graded)):
                        return False
                stepped = self._step_fast() if self.algorithm is not None else self._step_generic()
            finally:
                self.model_params = model_params
        if stepped:  # the shards changed in place, so the DTensor params did (a torch optimizer bumps them)
            stepped_params = [p for p in held if id(p) in swapped and p.grad is not None]
            torch.autograd.graph.increment_version(stepped_params)
        return stepped

    def _step_lowbit(self) -> bool:
        """Adam/AdamW with low-bit moments; False when ``skip_nonfinite`` skipped it (checked before
        anything is created or written)."""
        graded = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        if self.skip_nonfinite and not grads_fit(graded):
            return False
        buffers = {id(p): c for p, c in zip(self.model_params, self.compensation, strict=False)}
        stochastic = self.method == "stochastic"
        step_groups(
            self.optimizer,
            self.state_format,  # type: ignore[arg-type]
            self.workspace,
            kahan_of=lambda p: buffers.get(id(p)),
            generator_of=self._generator if stochastic else None,
        )
        return True

    def _step_fast(self) -> bool:
        """Torch's Adam/AdamW/SGD on the groups' own state; False when ``skip_nonfinite`` skipped it."""
        if self.state_format is not None:
            return self._step_lowbit()
        slots = {id(p): i for i, p in enumerate(self.model_params)}
        fused, unfused, fresh = [], [], []
        for group in self.param_groups:
            buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
            for param in group["params"]:
                if param.grad is not None:
                    buckets.setdefault((param.device, param.dtype), []).append(param)
            for (device, dtype), bucket in buckets.items():
                low = dtype in LOW_PRECISION_DTYPES
                dtypes = self._moment_dtypes(dtype, group) if low else (dtype,)
                kahan = None
                if low and self.method == "kahan":
                    kahan = [self.compensation[slots[id(p)]] for p in bucket]
                if self._fusable(dtype, bucket, kahan):
                    fresh += [p for p in bucket if p not in self.optimizer.state]
                    states = [self.optimizer.state[p] for p in bucket]
                    generator = self._generator(device) if self.method == "stochastic" else None
                    fused.append(AdamUnit(group, states, bucket, kahan, TorchMoments(dtypes), generator))
                else:
                    unfused.append((group, bucket, low, torch.float32 if torch.float32 in dtypes else dtype))
        unfused_fit = not (self.skip_nonfinite and unfused) or grads_fit(
            [p for _, bucket, _, _ in unfused for p in bucket]
        )
        if not unfused_fit or (fused and not adam_step(fused, self.workspace, self.skip_nonfinite)):
            for param in fresh:  # the state dicts the units were handed, still empty: as before the step
                del self.optimizer.state[param]
            return False
        for group, bucket, low, state_dtype in unfused:
            self._step_unfused(group, bucket, low, state_dtype, slots)
        return True

    def _fusable(self, dtype: torch.dtype, params: list[torch.Tensor], kahan: Any) -> bool:
        return (
            dtype == torch.bfloat16
            and self.method != "nearest"
            and self.algorithm == "adam"
            and self.state_dtype is None
            and updates.contiguous(params, grads_of(params), kahan or [])
        )

    def _step_unfused(self, group, bucket, low, state_dtype, slots) -> None:
        device = bucket[0].device
        generator = self._generator(device) if low and self.method == "stochastic" else None
        for params in self._chunks(bucket):  # bounds the fp32 temporaries of fp32-state updates
            kahan = None
            if low and self.method == "kahan":
                kahan = [self.compensation[slots[id(p)]] for p in params]
            states = [self.optimizer.state[p] for p in params]
            updates.step_group(
                self.algorithm,  # type: ignore[arg-type]
                group,
                states,
                params,
                kahan,
                self.method,
                state_dtype,
                generator,
                self.workspace,
            )

    def _moment_dtypes(self, dtype: torch.dtype, group: dict[str, Any]) -> tuple[torch.dtype, ...]:
        dtypes = updates.moment_dtypes(dtype, self.algorithm, group)  # type: ignore[arg-type]
        return dtypes if self.state_dtype is None else tuple(self.state_dtype for _ in dtypes)

    def _chunks(self, params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """Consecutive runs of params whose scratch fits ``scratch_numel`` (a bigger param is alone)."""
        if self.scratch_numel is None:
            return [params]
        chunks: list[list[torch.Tensor]] = [[]]
        size = 0
        for param in params:
            if chunks[-1] and size + param.numel() > self.scratch_numel:
                chunks.append([])
                size = 0
            chunks[-1].append(param)
            size += param.numel()
        return chunks

    def _step_generic(self) -> bool:
        """Step the inner optimizer chunk by chunk on fp32 scratch copies, then round into the weights.

        During a chunk's ``inner.step()`` its groups hold only that chunk's scratch params (and, in the
        first chunk, the fp32 params, which step once), keyed to the same state; both are put back after.
        Returns False when ``skip_nonfinite`` skipped the step.
        """
        slots = {id(p): i for i, p in enumerate(self.model_params)}
        low = [p for p in self.model_params if p.grad is not None]
        own = {id(p) for g in self.param_groups for p in g["params"] if id(p) not in slots}
        if self.skip_nonfinite:
            graded = low + [
                p for g in self.param_groups for p in g["params"] if id(p) in own and p.grad is not None
            ]
            if graded and not grads_fit(graded):
                return False
        originals = [group["params"] for group in self.param_groups]
        for n, chunk in enumerate(self._chunks(low) if low else [[]]):
            scratch = {id(p): _scratch(p) for p in chunk}
            groups = [
                [scratch[id(p)] for p in params if id(p) in scratch]
                + ([p for p in params if id(p) in own] if n == 0 else [])
                for params in originals
            ]
            with replaced_params(self.optimizer, groups, scratch):
                self.optimizer.step()
            kahan = [self.compensation[slots[id(p)]] for p in chunk] if self.method == "kahan" else None
            if chunk:
                device = chunk[0].device
                generator = self._generator(device) if self.method == "stochastic" else None
                updates.round_into(self.method, chunk, [scratch[id(p)] for p in chunk], kahan, generator)
        return True

    def _generator(self, device: torch.device) -> torch.Generator:
        return self.generators.on(device)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of every parameter in the groups."""
        self.optimizer.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """Inner optimizer state, Kahan compensation buffers, stochastic-rounding generator states,
        ``skipped_steps`` and the ``state_format`` when one is set."""
        return self._with_state_format(
            {
                "method": self.method,
                "optimizer": self.optimizer.state_dict(),
                "compensation": [c.detach() for c in self.compensation],
                "generators": self.generators.state_dict(),
                "skipped_steps": self.skipped_steps,
            }
        )

    def scaler_guard(self) -> HugeGradientGuard | None:
        """None for Kahan/stochastic updates (their update pass checks the gradients), else the guard of
        its fp32 state."""
        return None if self.method in ("kahan", "stochastic") else HugeGradientGuard(torch.float32)

    def shard_parts(self) -> tuple[dict[str, Any], list[Any], list[Any], str]:
        """The inner state belongs to the groups' params, ``compensation`` to ``model_params``."""
        inner = [p for g in self.param_groups for p in g["params"]]
        return self.state_dict(), inner, list(self.model_params), "compensation"

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved; validated in full before anything changes.

        Raises:
            TypeError: ``state_dict`` is not a dict.
            ValueError: missing keys, another method, compensation buffers of other shapes or dtypes,
                generator states or an optimizer state that do not fit, a ``skipped_steps`` that is not
                an int >= 0.

        Generator states are per device (``mixprec._generators``): one saved on a device this process has
        none of (a GPU checkpoint read on a CPU-only machine) is kept for it, and a device without a saved
        state starts afresh from ``seed``. A state dict saved before ``skipped_steps`` was part of it
        leaves the count as it is.
        """
        check_compensated_state(self, state_dict)
        load_inner_state(self.optimizer, state_dict["optimizer"])
        for buffer, value in zip(self.compensation, state_dict["compensation"], strict=True):
            buffer.copy_(value)
        self.generators.load_state_dict(state_dict["generators"], "state_dict['generators']")
        self.skipped_steps = state_dict.get("skipped_steps", self.skipped_steps)


def _scratch(param: torch.Tensor) -> torch.nn.Parameter:
    """An fp32 copy of a low-precision param with an fp32 copy of its gradient (exists during a step)."""
    scratch = torch.nn.Parameter(param.detach().float(), param.requires_grad)
    scratch.grad = grads_of([param])[0].float()
    return scratch


def _check_args(optimizer: Any, method: Any, seed: Any, scratch_numel: Any, state_dtype: Any) -> None:
    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, OptimizerWrapper):
        raise TypeError(
            f"optimizer is already wrapped ({type(optimizer).__name__}); pass the torch optimizer"
        )
    if not isinstance(method, str) or method not in METHODS:
        raise ValueError(f"unknown compensation method {method!r}; accepted: {sorted(METHODS)}")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise TypeError(f"seed must be an int or None, got {seed!r}")
    if scratch_numel is not None and (not isinstance(scratch_numel, int) or isinstance(scratch_numel, bool)):
        raise TypeError(f"scratch_numel must be a positive int or None, got {scratch_numel!r}")
    if scratch_numel is not None and scratch_numel < 1:
        raise ValueError(f"scratch_numel must be a positive int or None, got {scratch_numel!r}")
    if state_dtype not in _STATE_DTYPES:
        raise ValueError(f"state_dtype must be None (automatic) or torch.float32, got {state_dtype!r}")


def _check_storage(optimizer: Optimizer, state_format: Any, state_dtype: Any) -> None:
    if check_state_format(optimizer, state_format) is not None and state_dtype is not None:
        raise ValueError(
            f"state_format={state_format!r} sets the moments' storage; state_dtype must stay None, "
            f"got {state_dtype!r}"
        )


def _check_unique(params: list[Any], where: str) -> None:
    """torch.optim's rule: a parameter is in one group, once."""
    if len({id(p) for p in params}) != len(params):
        raise ValueError(
            f"{where}: some parameters appear in more than one parameter group (or twice in one), "
            "as torch.optim refuses; each parameter may be added once"
        )


def has_stepped(optimizer: Optimizer, param: torch.Tensor) -> bool:
    """Whether ``optimizer`` holds state for ``param`` from a step: state a torch optimizer makes when it
    is built (Adagrad's ``sum`` and a ``step`` of 0) does not count."""
    state = optimizer.state.get(param)
    if not state:
        return False
    step = state.get("step")
    return step is None or float(step) != 0


def _check_params(optimizer: Optimizer, method: str, params: list[Any]) -> None:
    for param in params:
        if not torch.is_tensor(param):
            raise TypeError(f"optimizer params must be tensors, got {type(param).__name__}")
        if param.dtype in LOW_PRECISION_DTYPES and param.dtype not in METHODS[method]:
            raise ValueError(
                f"method {method!r} cannot round to {param.dtype}; "
                f"dtypes it supports: {sorted(str(d) for d in METHODS[method])}"
            )
        if has_stepped(optimizer, param):
            raise ValueError(
                f"the optimizer already holds state for a param of shape {tuple(param.shape)}: "
                "wrap the optimizer before its first step"
            )
