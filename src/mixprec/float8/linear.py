"""`Float8Linear`: an ``nn.Linear`` whose three matmuls run in fp8 (the module swapped in by conversion);
`Float8Conv1D`: the same for ``transformers``' ``Conv1D`` (GPT-2's linear layers, weight stored (in, out))."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from mixprec.float8.config import Float8Config, LinearMMConfig
from mixprec.float8.fsdp import Float8AllGatherWeight, Float8GatheredWeight
from mixprec.formats import as_dtype
from mixprec.lowbit.gemm import LowbitLinearFunction
from mixprec.lowbit.history import ROLES
from mixprec.lowbit.linear import Conv1DShape
from mixprec.lowbit.swap import register_converted

__all__ = [
    "ROLES",
    "AmaxHistoryError",
    "Float8Conv1D",
    "Float8Layer",
    "Float8Linear",
    "check_amax_history",
    "check_float8_state",
]


class Float8Layer(nn.Module):
    """What every fp8 layer has (:class:`Float8Linear`, :class:`Float8Conv1D`): the config, the amax
    buffers, their checkpoint rules and the fp8 linear map ``input @ weight.T`` of an (out, in) weight."""

    config: Float8Config
    amax_history: torch.Tensor | None
    fp8_stats: torch.Tensor

    def _add_buffers(self, device: torch.device) -> None:
        if self.config.delayed:
            history = torch.zeros(
                len(ROLES), self.config.amax_history_len, dtype=torch.float32, device=device
            )
            self.register_buffer("amax_history", history)
        else:
            self.amax_history = None
        self.register_buffer("fp8_stats", torch.zeros(2, len(ROLES), device=device), persistent=False)

    def _fp8_linear(
        self, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``input @ weight.T + bias`` with the three GEMMs of ``self.config`` (weight (out, in))."""
        if not torch.is_tensor(input) or not input.is_floating_point():
            got = input.dtype if torch.is_tensor(input) else type(input).__name__
            raise TypeError(f"{type(self).__name__} input must be a floating-point tensor, got {got}")
        device_type = input.device.type
        if torch.is_autocast_enabled(device_type):
            input = input.to(torch.get_autocast_dtype(device_type))
        config = self.config  # its recipe, scaling and GEMM options are resolved once per config
        out = LowbitLinearFunction.apply(
            input, weight, config.resolved_lowbit_recipe, None, config.gemm_options,
            self.amax_history, self.fp8_stats, self.training,
        )  # fmt: skip
        if bias is not None:
            out = out + bias.to(out.dtype)
        return out

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        # Checkpoints move between nn.Linear, dynamic and delayed modules: a missing history starts empty,
        # a history is ignored by a dynamic module. (state_dict is torch's per-module copy.)
        key = prefix + "amax_history"
        if self.amax_history is not None and key in state_dict:
            check_amax_history(self, state_dict[key], key)  # before any of this module's tensors change
        if self.amax_history is not None and key not in state_dict:
            state_dict[key] = torch.zeros_like(self.amax_history)
        elif self.amax_history is None:
            state_dict.pop(key, None)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing, unexpected, errors)

    @property
    def linear_mm_config(self) -> LinearMMConfig:
        """torchao's per-GEMM settings (``output``, ``grad_input``, ``grad_weight``), read from ``config``."""
        return self.config.linear_mm_config

    def last_amax(self) -> dict[str, float]:
        """The amax of input, weight and grad_output at their last cast (0.0 before any); host sync."""
        return dict(zip(ROLES, self.fp8_stats[0].tolist(), strict=True))

    def last_scale(self) -> dict[str, float]:
        """The scale used at the last cast of input, weight and grad_output (0.0 before any); host sync."""
        return dict(zip(ROLES, self.fp8_stats[1].tolist(), strict=True))


class Float8Linear(Float8Layer, nn.Linear):
    """``nn.Linear`` with fp8 matmuls: e4m3 input and weight, e5m2 output gradient, per-tensor scales.

    Same parameters (``weight`` (out, in), ``bias`` (out,)) and the same call as ``nn.Linear``: input
    (..., in_features) of any float dtype, output (..., out_features) in the input's dtype, or in the
    autocast dtype inside a ``torch.autocast`` / ``mixprec.autocast`` region (as ``F.linear`` there).
    The bias is added in the output dtype after the fp8 matmul.

    Buffers:
        ``amax_history`` (delayed scaling only): float32[3, amax_history_len], rows input, weight,
            grad_output, newest first; persistent, so it is in ``state_dict()`` and a resumed run continues
            bitwise; a checkpoint without one (from ``nn.Linear`` or dynamic scaling) loads with an empty
            history, and a dynamic module ignores one. It advances in training mode only (input and
            weight at each forward, grad_output at each backward); in eval mode it is read, not written.
        ``fp8_stats`` (not in ``state_dict``): float32[2, 3], the last amax (row 0) and scale (row 1) of
            input, weight and grad_output, for diagnostics.

    Args:
        in_features, out_features, bias, device, dtype: as ``nn.Linear`` (``dtype`` may be a name, "bf16").
        config: the :class:`Float8Config` (default: dynamic scaling).

    Raises:
        TypeError: if ``config`` is not a :class:`Float8Config`.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | str | None = None,
        *,
        config: Float8Config | None = None,
    ) -> None:
        config = _check_config(config)
        dtype = None if dtype is None else as_dtype(dtype, "dtype")
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.config = config
        self._add_buffers(self.weight.device)
        self._wrap_weight_for_fsdp()

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: Float8Config | None = None) -> Float8Linear:
        """A Float8Linear sharing ``linear``'s parameter objects (an optimizer built before keeps working).

        Raises:
            TypeError: if ``linear`` is not an ``nn.Linear`` or ``config`` not a :class:`Float8Config`.
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be a torch.nn.Linear, got {type(linear).__name__}")
        config = _check_config(config)
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=False, config=config)
        new.weight = linear.weight
        new.bias = linear.bias
        new._add_buffers(linear.weight.device)
        new._wrap_weight_for_fsdp()
        new.train(linear.training)
        return new

    def _wrap_weight_for_fsdp(self) -> None:
        # FSDP2 all-gathers a Float8AllGatherWeight in fp8 (mixprec.float8.fsdp); it shares the storage.
        if self.config.enable_fsdp_float8_all_gather and not isinstance(self.weight, Float8AllGatherWeight):
            wrapped = Float8AllGatherWeight(self.weight.detach(), self.config)
            self.weight = nn.Parameter(wrapped, requires_grad=self.weight.requires_grad)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._wrap_weight_for_fsdp()  # an fp8 all-gather weight is pickled as the plain one

    @classmethod
    def from_float(cls, mod: nn.Linear, config: Float8Config | None = None) -> Float8Linear:
        """torchao's name for :meth:`from_linear`."""
        return cls.from_linear(mod, config)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if torch.is_tensor(input) and input.is_floating_point() and _quantized_for_inference(self.weight):
            return nn.functional.linear(input, self.weight, self.bias)
        return self._fp8_linear(input, self.weight, self.bias)

    def extra_repr(self) -> str:
        casts = self.config.cast_configs_str()
        return f"{super().extra_repr()}, cast_configs={casts}, fp8={self.config.short_str()}"


class Float8Conv1D(Conv1DShape, Float8Layer):
    """``transformers``' ``Conv1D`` (``y = x @ weight + bias``, ``weight`` (in, out): GPT-2's linear layers)
    with :class:`Float8Linear`'s fp8 GEMMs, run over ``weight.t()``.

    It holds the ``Conv1D``'s own ``weight`` and ``bias`` Parameter objects, so ``state_dict`` keys, an
    optimizer's param groups and tied weights are unchanged, and its numerics are those of a
    :class:`Float8Linear` of weight ``weight.t()`` with the same config, bit for bit. ``nf`` / ``nx`` are
    Conv1D's (``out_features`` / ``in_features`` too). Buffers as :class:`Float8Linear`'s.

    Raises:
        TypeError: for a ``conv1d`` without a 2-D ``weight`` (nx, nf), with a ``bias`` that is not a tensor
            or None, or a bad ``config``.
        ValueError: for ``enable_fsdp_float8_all_gather=True``: the fp8 all-gather wraps (out, in) weights.
    """

    def __init__(self, conv1d: nn.Module, config: Float8Config | None = None) -> None:
        config = _check_config(config)
        weight, bias = self.parameters_of(conv1d)
        if config.enable_fsdp_float8_all_gather:
            raise ValueError(
                "Float8Conv1D does not take enable_fsdp_float8_all_gather=True: the fp8 all-gather wraps "
                "nn.Linear's (out, in) weights; keep Conv1D out with module_filter_fn or unset the flag"
            )
        super().__init__()
        self.config = config
        self._hold(weight, bias)
        self._add_buffers(weight.device)
        self.train(conv1d.training)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self._fp8_linear(input, self.weight.t(), self.bias)

    def extra_repr(self) -> str:
        return f"nf={self.nf}, nx={self.nx}, fp8={self.config.short_str()}"


def _quantized_for_inference(weight: torch.Tensor) -> bool:
    """A frozen tensor-subclass weight (torchao's ``quantize_`` after training) runs its own linear."""
    own = (torch.Tensor, nn.Parameter, Float8AllGatherWeight, Float8GatheredWeight)
    return not weight.requires_grad and type(weight) not in own


class AmaxHistoryError(ValueError, RuntimeError):
    """A refused ``amax_history``: a ValueError as mixprec's bad input is, and the RuntimeError that
    ``nn.Module.load_state_dict`` raises for a tensor that does not fit."""


def _dtype_name(dtype: torch.dtype) -> str:
    """A dtype as messages spell it: "float32", not "torch.float32"."""
    return str(dtype).removeprefix("torch.")


def check_amax_history(module: Float8Layer, value: object, key: str) -> None:
    """Refuse a loaded ``amax_history`` that does not fit ``module`` or would poison its scales.

    Raises:
        AmaxHistoryError: (a ValueError and a RuntimeError) not a tensor of ``module.amax_history``'s
            shape (another ``amax_history_len``), or holding a negative, inf or nan entry (an inf amax
            gives every later scale 0, a nan every output nan).
    """
    assert module.amax_history is not None, "only a delayed-scaling module has an amax history to check"
    expected = tuple(module.amax_history.shape)
    if not torch.is_tensor(value) or tuple(value.shape) != expected or not value.is_floating_point():
        got = type(value).__name__
        if isinstance(value, torch.Tensor):
            got = f"{_dtype_name(value.dtype)} {tuple(value.shape)}"
        ours = f"{_dtype_name(module.amax_history.dtype)} {expected}"
        raise AmaxHistoryError(
            f"{key} is {got}, this module's is {ours} "
            f"(amax_history_len={module.config.amax_history_len}); load it into a module of that length"
        )
    bad = ~torch.isfinite(value) | (value < 0)
    if bool(bad.any()):
        raise AmaxHistoryError(
            f"{key} holds {int(bad.sum())} entries that are not finite amaxes >= 0 "
            f"(first: {value[bad][0].item()}); an amax history must be finite and non-negative"
        )


def check_float8_state(model: nn.Module, state_dict: dict[str, object], prefix: str = "") -> None:
    """Check every delayed-scaling ``amax_history`` of ``state_dict`` meant for ``model``'s fp8 layers, so
    that a load which would fail changes nothing (see :func:`check_amax_history`)."""
    for fqn, module in model.named_modules(prefix=prefix.rstrip(".")):
        if isinstance(module, Float8Layer) and module.amax_history is not None:
            key = f"{fqn}.amax_history" if fqn else "amax_history"
            if key in state_dict:
                check_amax_history(module, state_dict[key], key)


def _check_config(config: Float8Config | None) -> Float8Config:
    if config is None:
        return Float8Config()
    if not isinstance(config, Float8Config):
        raise TypeError(f"config must be a mixprec.float8.Float8Config or None, got {type(config).__name__}")
    return config


def describe_config(config: Float8Config) -> str:
    """``Float8Config(...)`` with only the fields that differ from the default (cast configs shortened)."""
    default = Float8Config()
    diff = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if value == getattr(default, f.name):
            continue
        if f.name.startswith("cast_config_"):
            value = f"{value.scaling_granularity.value}/{str(value.target_dtype).removeprefix('torch.')}"
            diff.append(f"{f.name}={value}")
        else:
            diff.append(f"{f.name}={value!r}")
    return f"Float8Config({', '.join(diff)})"


register_converted(Float8Linear, lambda m: f"Float8Linear, {describe_config(m.config)}")
register_converted(Float8Conv1D, lambda m: f"Float8Conv1D, {describe_config(m.config)}")
