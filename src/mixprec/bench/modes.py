"""Mode registry: the precision recipes the bench compares, each a small object that runs one training step.

A mode is prepared once with the workload's fp32 ``(model, optimizer)``, then ``train_step`` does what a
user's loop does in that recipe (forward under its autocast, loss, backward, optimizer step, loss scaling),
and ``observe`` reports the loss scale and whether the step was skipped, outside the timed region.

A mode whose probe step fails on a device (a kernel this torch build lacks there, a missing optional
dependency) says why through ``unavailable()`` and is left out of the run with that message.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import mixprec


class TrainMode:
    """Base class: plain fp32 training, no autocast, no scaling."""

    def __init__(self, spec: ModeSpec, device_type: str) -> None:
        self.spec = spec
        self.device_type = device_type
        self.model: nn.Module  # set by prepare(), before any step
        self.optimizer: Any = None
        self.skipped_steps = 0

    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    @property
    def torch_optimizer(self) -> torch.optim.Optimizer:
        """The ``torch.optim.Optimizer`` whose ``param_groups`` a learning-rate scheduler should drive."""
        if isinstance(self.optimizer, torch.optim.Optimizer):
            return self.optimizer
        return self.optimizer.optimizer  # a mixprec wrapper holds the torch optimizer it steps

    def context(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.context():
            return self.model(x)

    def train_step(self, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        with self.context():
            loss = loss_fn(self.model(x), y)
        loss.backward()
        self.optimizer.step()
        return loss.detach()

    def observe(self) -> tuple[float | None, bool]:
        """(loss scale or None when the mode does not scale, whether the last step was skipped)."""
        return None, False


class AutocastMode(TrainMode):
    """An autocast region around forward and loss, plus a GradScaler when the spec asks for one."""

    def __init__(self, spec: ModeSpec, device_type: str) -> None:
        super().__init__(spec, device_type)
        autocast_name, scaler_name = spec.parts
        self._autocast = getattr(mixprec, autocast_name) if autocast_name != "torch" else torch.autocast
        self.scaler = None
        if spec.scaled:
            scaler_cls = getattr(mixprec, scaler_name) if scaler_name != "torch" else torch.amp.GradScaler
            self.scaler = scaler_cls(device_type)
        self._last_scale = float(self.scaler.get_scale()) if self.scaler is not None else math.inf

    def context(self) -> contextlib.AbstractContextManager:
        return self._autocast(self.device_type, dtype=self.spec.dtype)

    def train_step(self, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable) -> torch.Tensor:
        if self.scaler is None:
            return super().train_step(x, y, loss_fn)
        self.optimizer.zero_grad(set_to_none=True)
        with self.context():
            loss = loss_fn(self.model(x), y)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return loss.detach()

    def observe(self) -> tuple[float | None, bool]:
        if self.scaler is None:
            return None, False
        scale = float(self.scaler.get_scale())
        flag = getattr(self.scaler, "last_step_skipped", None)
        # torch's scaler has no skip flag; a dynamic scale only ever drops when a step was skipped.
        skipped = bool(flag) if flag is not None else scale < self._last_scale
        self._last_scale = scale
        self.skipped_steps += skipped
        return scale, skipped


class Float8Mode(AutocastMode):
    """bf16 autocast with every ``nn.Linear`` converted by ``mixprec.float8.convert_to_float8_training``.

    On a CPU ``torch._scaled_mm`` emulates fp8, so these steps are slower than bf16 there: the figure that
    counts on a CPU is the held-out loss against bf16; on a Hopper GPU the speed is real. Not in the CPU
    defaults for that reason (ask for them with ``--modes fp8-dynamic,fp8-delayed``).
    """

    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        from mixprec.float8 import Float8Config, convert_to_float8_training

        config = Float8Config(scaling=self.spec.options["scaling"])
        # The swap keeps the parameter objects, so the optimizer built on the model still steps them.
        convert_to_float8_training(model, config=config)
        super().prepare(model, optimizer)


class MasterWeightsMode(TrainMode):
    """A ``mixprec.initialize`` recipe: a 16-bit model behind mixprec's optimizer (fp32 masters for O2)."""

    def __init__(self, spec: ModeSpec, device_type: str) -> None:
        super().__init__(spec, device_type)
        self._initialize = mixprec.initialize
        self._last_scale: float | None = None

    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        # The prepared model casts its own inputs (and outputs, per level): call it as a user would.
        self.model, self.optimizer = self._initialize(model, optimizer, **self.spec.options)
        self._last_scale = self._scale()

    def train_step(self, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable) -> torch.Tensor:
        self.optimizer.zero_grad()
        loss = loss_fn(self.model(x), y)
        self.optimizer.backward(loss)
        self.optimizer.step()
        return loss.detach()

    def _scale(self) -> float | None:
        scaler = getattr(self.optimizer, "scaler", None)
        if scaler is not None and not scaler.is_enabled():
            return None  # no loss scaling at this level (its loss_scale reads 1.0)
        scale = getattr(self.optimizer, "loss_scale", None)
        if isinstance(getattr(scaler, "rule", None), mixprec.StaticScale) and scale == 1.0:
            return None  # a static scale of 1 (bf16-true) only skips non-finite steps: it does not scale
        return None if scale is None else float(scale)

    def observe(self) -> tuple[float | None, bool]:
        scale = self._scale()
        flag = getattr(getattr(self.optimizer, "scaler", self.optimizer), "last_step_skipped", None)
        if flag is not None:
            skipped = bool(flag)
        else:
            skipped = scale is not None and self._last_scale is not None and scale < self._last_scale
        self._last_scale = scale
        self.skipped_steps += skipped
        return scale, skipped


@dataclass(frozen=True)
class ModeSpec:
    """A registered mode: its compute dtype, the class that runs it and the mixprec parts it needs.

    ``parts`` names (autocast, scaler) sources for ``AutocastMode``: ``"torch"`` or a mixprec name.
    ``options`` are keyword arguments for ``mixprec.initialize(model, optimizer, **options)``.
    """

    name: str
    dtype: torch.dtype
    summary: str
    runner: type[TrainMode] = TrainMode
    parts: tuple[str, str] = ("torch", "torch")
    scaled: bool = False
    requires: tuple[str, ...] = ()
    options: Mapping[str, Any] = field(default_factory=dict)

    def create(self, device_type: str) -> TrainMode:
        return self.runner(self, device_type)

    def probe(self, device: str) -> None:
        """One training step on a tiny conv + linear model; raises whatever this mode raises here."""
        mode = self.create(torch.device(device).type)
        model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.Flatten(), nn.Linear(64, 2)).to(device)
        mode.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        x, y = torch.randn(3, 1, 6, 6, device=device), torch.randn(3, 2, device=device)
        mode.train_step(x, y, lambda out, target: (out.float() - target).pow(2).mean())
        mode.observe()

    def unavailable(self, device: str) -> str | None:
        """Why this mode cannot run in this build, or None when a probe step on a tiny model succeeds."""
        needs = ", ".join(f"mixprec.{name}" for name in self.requires)
        try:
            self.probe(device)
        except ImportError as exc:
            return f"needs {needs}: a part it imports is missing ({exc})"
        except Exception as exc:
            return f"a probe step failed: {type(exc).__name__}: {exc}"
        return None


_BF16, _FP16, _FP32 = torch.bfloat16, torch.float16, torch.float32


def _amp(name: str, dtype: torch.dtype, source: str, summary: str) -> ModeSpec:
    scaled = dtype == torch.float16
    requires = () if source == "torch" else (("autocast", "GradScaler") if scaled else ("autocast",))
    parts = ("torch", "torch") if source == "torch" else ("autocast", "GradScaler")
    return ModeSpec(name, dtype, summary, AutocastMode, parts, scaled, requires)


def _master(name: str, compute: torch.dtype, summary: str, **options: Any) -> ModeSpec:
    return ModeSpec(name, compute, summary, MasterWeightsMode, requires=("initialize",), options=options)


#: Every precision mode the bench can run, by name (filled by ``register``).
MODES: dict[str, ModeSpec] = {}


def _fp8(name: str, scaling: str, summary: str) -> ModeSpec:
    return ModeSpec(
        name,
        torch.bfloat16,
        summary,
        Float8Mode,
        ("autocast", "torch"),
        requires=("autocast",),
        options={"scaling": scaling},
    )


def register(*specs: ModeSpec) -> None:
    """Add modes to the registry (``mixprec bench --modes NAME``); a name may be registered once."""
    for spec in specs:
        if spec.name in MODES or spec.name in ALIASES:
            raise ValueError(f"mode {spec.name!r} is already registered")
        MODES[spec.name] = spec


#: Names that resolve per device to the bench mode that runs that recipe there: the presets of
#: ``mixprec.PRESETS`` and apex's levels (O1's and O3's dtype is fp16 on CUDA, bf16 elsewhere, as in
#: ``mixprec.initialize``). A device missing from an alias's entry has no bench mode for it
#: (``UNRUNNABLE`` says what is closest).
ALIASES: dict[str, dict[str, str]] = {
    "torch-amp": {"cpu": "torch-amp-bf16", "cuda": "torch-amp-fp16"},
    "32-true": {"cpu": "fp32", "cuda": "fp32"},
    "O0": {"cpu": "fp32", "cuda": "fp32"},
    "bf16-mixed": {"cpu": "mixprec-bf16", "cuda": "mixprec-bf16"},
    "16-mixed": {"cpu": "mixprec-fp16", "cuda": "mixprec-fp16"},
    "O1": {"cpu": "mixprec-bf16", "cuda": "mixprec-fp16"},
    "O2": {"cpu": "O2-bf16", "cuda": "O2-fp16"},
    "O3": {"cpu": "bf16-true"},
    "16-true": {},
}
#: Why an alias has no bench mode (on the devices its ``ALIASES`` entry lacks), and what comes closest.
UNRUNNABLE: dict[str, str] = {
    "16-true": "fp16 weights without fp32 masters have no bench mode; the closest are 'bf16-true' (bf16 "
    "weights, no masters) and 'O2-fp16' (fp16 weights, fp32 masters)",
    "O3": "O3 on CUDA is fp16 weights without fp32 masters ('16-true'), which has no bench mode; the "
    "closest are 'bf16-true' (bf16 weights, no masters) and 'O2-fp16' (fp16 weights, fp32 masters)",
}

# ---- the reference: plain fp32
register(ModeSpec("fp32", _FP32, "plain fp32 training"))

# ---- autocast + loss scaling: torch's and mixprec's
register(
    _amp("torch-amp-bf16", _BF16, "torch", "torch.autocast(bf16), no loss scaling"),
    _amp("torch-amp-fp16", _FP16, "torch", "torch.autocast(fp16) + torch.amp.GradScaler"),
    _amp("mixprec-bf16", _BF16, "mixprec", "mixprec.autocast(bf16), no loss scaling"),
    _amp("mixprec-fp16", _FP16, "mixprec", "mixprec.autocast(fp16) + mixprec.GradScaler"),
)

# ---- 16-bit models: mixprec.initialize recipes (fp32 master weights, or pure bf16)
register(
    _master(
        "O2-bf16",
        _BF16,
        "initialize('O2', dtype=bf16): bf16 model, fp32 master weights",
        opt_level="O2",
        dtype=_BF16,
    ),
    _master(
        "O2-fp16",
        _FP16,
        "initialize('O2', dtype=fp16): fp16 model, fp32 masters, loss scaling",
        opt_level="O2",
        dtype=_FP16,
    ),
    _master(
        "bf16-true",
        _BF16,
        "initialize('bf16-true'): bf16 weights and math, no master weights",
        opt_level="bf16-true",
    ),
    _master(
        "bf16-true-kahan",
        _BF16,
        "bf16-true + weight_update='kahan': Kahan-compensated bf16 updates",
        opt_level="bf16-true",
        weight_update="kahan",
    ),
)

# ---- fp8 training: the model's nn.Linear layers swapped for Float8Linear, the rest under bf16 autocast
register(
    _fp8("fp8-dynamic", "dynamic", "fp8 Linear layers, scale from each tensor's amax (torchao's recipe)"),
    _fp8("fp8-delayed", "delayed", "fp8 Linear layers, scale from an amax history (Transformer Engine's)"),
)

# A new family is a TrainMode subclass if the step differs, a ModeSpec per recipe, and DEFAULT_MODES where
# it runs by default.

#: The modes ``mixprec bench`` runs by default on each device type.
DEFAULT_MODES: dict[str, tuple[str, ...]] = {
    "cpu": ("fp32", "torch-amp-bf16", "mixprec-bf16", "O2-bf16", "bf16-true", "bf16-true-kahan"),
    "cuda": (
        "fp32",
        "torch-amp-fp16",
        "torch-amp-bf16",
        "mixprec-fp16",
        "mixprec-bf16",
        "O2-fp16",
        "bf16-true",
        "bf16-true-kahan",
        "fp8-dynamic",
        "fp8-delayed",
    ),
}
