"""Lightning: ``MixprecPrecision`` (precision plugin); ``MixprecDiagnostics``, ``MixprecReplan`` (callbacks).

Usage::

    import lightning as L
    from mixprec.integrations.lightning import MixprecDiagnostics, MixprecPrecision

    policy = mixprec.Policy.preset("bf16-mixed").with_modules({"head": torch.float32})
    trainer = L.Trainer(plugins=[MixprecPrecision("bf16-mixed", policy=policy)],
                        callbacks=[MixprecDiagnostics()])

The plugin takes the place of Lightning's ``MixedPrecision`` (one hook per concern, as Lightning's plugins
do): the forward of every training/validation/test/predict step runs under :class:`mixprec.autocast`, the
loss is scaled by a :class:`mixprec.GradScaler`, the optimizer step is unscaled, skipped and updated by it,
and ``loss_scale`` and ``skipped_steps`` are logged each step. Its ``state_dict`` (the scaler's) is saved in
Lightning checkpoints and restored on resume. ``MixprecReplan`` changes the layers' formats during
training (a precision plan re-made or switched). Needs ``pip install 'mixprec[lightning]'``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from typing import Any, Literal

import torch
from torch import nn

try:
    import lightning.pytorch as pl
    from lightning.fabric.plugins.precision.amp import _optimizer_handles_unscaling
    from lightning.pytorch.plugins.precision import Precision
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "mixprec.integrations.lightning needs Lightning (the 'lightning' package): "
        "pip install 'mixprec[lightning]'"
    ) from error

from mixprec import autocast
from mixprec.integrations._common import (
    Diagnoser,
    check_policy,
    check_scaler,
    checkpoint_in_region,
    loss_of,
    nonfinite_grads,
    region_dtype,
    scaler_metrics,
)
from mixprec.policy import Policy
from mixprec.scaling import GradScaler

__all__ = ["MixprecDiagnostics", "MixprecPrecision", "MixprecReplan"]

_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


class MixprecPrecision(Precision):
    """Lightning precision plugin running mixprec's engine, policy and scaler.

    Args:
        precision: ``"bf16-mixed"`` or ``"16-mixed"`` (the region's dtype; a policy with a compute dtype of
            its own must agree).
        policy: a :class:`mixprec.Policy` or policy string; default: the device's default policy.
        scaler: a :class:`mixprec.GradScaler`; default: a new one for ``"16-mixed"``, none for
            ``"bf16-mixed"`` (pass one to count skipped steps in bf16 too).
        device: the autocast device type; default: that of the LightningModule when the Trainer connects
            the plugin.
        log_metrics: log ``loss_scale`` and ``skipped_steps`` (floats, on_step) after every optimizer step
            when there is a scaler (one host sync per step, after the one the skip decision takes).

    Attributes:
        scaler: the GradScaler, or None.
        last_step_skipped: whether the last optimizer step was skipped. A skipped step still advances the
            LR schedule, as Lightning's own ``"16-mixed"`` does (the result stays bitwise equal to it); to
            hold it, step the scheduler yourself only ``if not trainer.precision_plugin.last_step_skipped``.
        steps: optimizer steps taken or skipped so far.

    Raises:
        ValueError: for another precision string, or a policy whose compute dtype contradicts it.
        TypeError: for a scaler that is not a mixprec.GradScaler, or a bad policy.
    """

    def __init__(
        self,
        precision: Literal["bf16-mixed", "16-mixed"] = "bf16-mixed",
        *,
        policy: Policy | str | None = None,
        scaler: GradScaler | None = None,
        device: str | torch.device | None = None,
        log_metrics: bool = True,
    ) -> None:
        if precision not in _DTYPES:
            raise ValueError(f"precision must be 'bf16-mixed' or '16-mixed', got {precision!r}")
        policy = check_policy(policy)
        dtype = region_dtype(policy, _DTYPES[precision], f"precision={precision!r}")
        scaler = check_scaler(scaler)
        if device is not None:
            autocast(str(device), dtype=dtype, policy=policy)  # validates device and dtype now
        self.precision = precision  # type: ignore[assignment]
        self.policy, self.dtype = policy, dtype
        self.scaler = GradScaler() if scaler is None and precision == "16-mixed" else scaler
        self.device = None if device is None else str(device)
        self.log_metrics = bool(log_metrics)
        self.last_step_skipped = False
        self._step_scale: torch.Tensor | None = None
        self.steps = 0  # optimizer steps taken or skipped, for the diagnostics callback
        self._skips: list[tuple[list[str], float]] = []  # (non-finite grads, scale) per skip, until read

    def region(self) -> autocast:
        """A new :class:`mixprec.autocast` for this plugin's device, dtype and policy."""
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        return autocast(self.device, dtype=self.dtype, policy=self.policy)

    def connect(
        self, model: nn.Module, optimizers: list[torch.optim.Optimizer], lr_schedulers: list[Any]
    ) -> tuple[nn.Module, list[torch.optim.Optimizer], list[Any]]:
        """Take the autocast device from the (already placed) model if none was given; make an HF model's
        gradient checkpointing recompute under the region when the policy pins or edits (ValueError for
        a reentrant one, see ``checkpoint_in_region``)."""
        if self.device is None:
            first = next(model.parameters(), None)
            self.device = "cpu" if first is None else first.device.type
        checkpoint_in_region(model, self.policy, self.device)
        return super().connect(model, optimizers, lr_schedulers)

    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """Every step's forward under :class:`mixprec.autocast`."""
        with self.region():
            yield

    def pre_backward(self, tensor: torch.Tensor, module: pl.LightningModule) -> torch.Tensor:  # type: ignore[override]
        if not isinstance(module, pl.LightningModule) or module._trainer is None:  # Fabric calls it too
            raise TypeError(
                "mixprec.integrations.lightning.MixprecPrecision is the plugin for lightning.pytorch's "
                "Trainer; for lightning.fabric.Fabric use mixprec.integrations.fabric.MixprecPrecision"
            )
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        return super().pre_backward(tensor, module)

    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Any,
        model: pl.LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        """As Lightning's MixedPrecision: closure, unscale (for clipping), step or skip, update; then log."""
        if self.scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ValueError("mixprec's loss scaling does not work with LBFGS (its closure re-runs backward)")
        closure_result = closure()
        skip_unscaling = closure_result is None and model.automatic_optimization  # backward was skipped
        if not _optimizer_handles_unscaling(optimizer) and not skip_unscaling:
            self.scaler.unscale_(optimizer)
        self._after_closure(model, optimizer)
        if skip_unscaling:
            return closure_result
        scale = self.scaler.rule.scale
        self._step_scale = None if scale is None else scale.detach().clone()  # no sync
        step_output = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        self.last_step_skipped = self.scaler.last_step_skipped
        self.steps += 1
        if self.last_step_skipped and len(self._skips) < 8:  # now: a manual loop may zero them later
            mine = {id(p) for group in optimizer.param_groups for p in group["params"]}
            named = ((name, p) for name, p in model.named_parameters() if id(p) in mine)
            self._skips.append((nonfinite_grads(named), self.last_step_scale))
        if self.log_metrics and getattr(model, "_trainer", None) is not None:
            for name, value in scaler_metrics(self.scaler).items():
                model.log(name, value, on_step=True, on_epoch=False, batch_size=1)
        return step_output

    def clip_gradients(
        self, optimizer: torch.optim.Optimizer, clip_val: float = 0.0, *args: Any, **kwargs: Any
    ) -> None:  # type: ignore[override]
        """Lightning's clipping, refused (as Lightning does) for optimizers that unscale inside their step."""
        if clip_val > 0 and self.scaler is not None and _optimizer_handles_unscaling(optimizer):
            raise RuntimeError(
                f"{type(optimizer).__qualname__} unscales inside its step (a fused optimizer), so its "
                "gradients cannot be clipped before the step"
            )
        super().clip_gradients(optimizer, clip_val, *args, **kwargs)

    @property
    def last_step_scale(self) -> float:
        """The loss scale the last optimizer step was taken (or skipped) at; 1.0 without a scaler."""
        return 1.0 if self._step_scale is None else float(self._step_scale.item())

    def take_skips(self) -> list[tuple[list[str], float]]:
        """The skipped steps since the last call: for each, the parameters whose gradients held inf/nan
        (up to 5 names) and the loss scale; the list is emptied."""
        skips, self._skips = self._skips, []
        return skips

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state (torch's keys plus mixprec's counters); empty without a scaler."""
        return {} if self.scaler is None else self.scaler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the scaler from :meth:`state_dict`."""
        if self.scaler is not None:
            self.scaler.load_state_dict(state_dict)


class _TrainingStep(nn.Module):
    """A LightningModule's ``training_step(batch, batch_idx)`` as a forward, for find_nonfinite."""

    def __init__(self, module: pl.LightningModule) -> None:
        super().__init__()
        self.module = module

    def forward(self, batch: Any, batch_idx: int) -> Any:
        return self.module.training_step(batch, batch_idx)


@contextlib.contextmanager
def _logging_muted(module: pl.LightningModule) -> Generator[None, None, None]:
    """``self.log``/``log_dict`` do nothing while the diagnosis re-runs training_step (restored after)."""
    names = ("log", "log_dict")
    saved: dict[str, Any] = {name: module.__dict__[name] for name in names if name in module.__dict__}
    module.log = module.log_dict = lambda *args, **kwargs: None  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        for name in ("log", "log_dict"):
            module.__dict__.pop(name, None)
        module.__dict__.update(saved)


def _manual_finding(skips: list[tuple[list[str], float]]) -> str:
    """What a manual-optimization step recorded, and why it is not re-run."""
    found = ""
    for names, scale in skips:
        held = ", ".join(repr(name) for name in names) or "no parameter (the inf/nan was elsewhere)"
        found += f"The gradients of {held} held inf/nan at loss scale {scale:g}. "
    return found + (
        "training_step uses manual optimization (it calls its optimizers, schedulers and backward itself), "
        "so mixprec does not re-run it to find the op; call mixprec.inspect.find_nonfinite on the module "
        "with that batch outside fit() for the op and phase"
    )


class MixprecDiagnostics(pl.Callback):
    """When a step is skipped or its loss is non-finite, explain it and log the sentence (logger
    ``"mixprec.integrations"``), numbered by Lightning's ``trainer.global_step`` after that step.

    Automatic optimization: the batch's ``training_step`` is re-run under
    :func:`mixprec.inspect.find_nonfinite` (it calls no optimizer there; ``self.log`` is muted), which
    names the module, op and phase; under gradient accumulation every micro-batch of the skipped step is
    re-run until the one that overflowed is found. Manual optimization (one or several optimizers, a
    ``training_step`` returning None, a loss or a dict): the step calls its optimizers, schedulers and
    ``manual_backward`` itself, so it is never re-run; the sentence gives what :class:`MixprecPrecision`
    recorded when the step was skipped (the parameters whose gradients held inf/nan, the loss scale).

    Works with :class:`MixprecPrecision` (its region and the step's loss scale are reused) and, for
    non-finite losses, with Lightning's own "bf16-mixed"/"16-mixed" (re-run under mixprec's default policy
    in that dtype); with other precisions it does nothing.

    Args:
        max_diagnoses: diagnoses per fit (default 1: the first incident).

    Attributes:
        diagnoses: the sentences logged so far.
    """

    def __init__(self, max_diagnoses: int = 1) -> None:
        self._diagnoser = Diagnoser(max_diagnoses)
        self._window: list[tuple[Any, int]] = []  # the micro-batches since the last optimizer step
        self._steps_seen = 0

    @property
    def diagnoses(self) -> list[str]:
        return self._diagnoser.diagnoses

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        found = trainer.precision_plugin
        plugin = found if isinstance(found, MixprecPrecision) else None
        skips = plugin.take_skips() if plugin is not None else []
        stepped = plugin is not None and plugin.steps != self._steps_seen
        self._steps_seen = plugin.steps if plugin is not None else 0
        window = [*self._window, (batch, batch_idx)]
        accumulating = pl_module.automatic_optimization and not stepped
        self._window = window if accumulating else []  # kept until the step they feed
        if not self._diagnoser.wanted:
            return
        loss = loss_of(outputs)
        nonfinite = isinstance(loss, torch.Tensor) and not bool(torch.isfinite(loss).all())
        if not (skips or nonfinite):
            return
        reason = "skipped its optimizer step" if skips else "gave a non-finite loss"
        step = trainer.global_step + (0 if stepped else 1)  # a micro-batch belongs to the step it feeds
        if not pl_module.automatic_optimization:
            self._diagnoser.note(step, reason, _manual_finding(skips))
            return
        if plugin is not None:
            region, scale = plugin.region(), skips[0][1] if skips else plugin.last_step_scale
        elif str(trainer.precision) in _DTYPES:
            region, scale = autocast(pl_module.device.type, dtype=_DTYPES[str(trainer.precision)]), 1.0
        else:
            return  # a full- or pure-low-precision run: no mixed-precision region to re-run it in
        with _logging_muted(pl_module):
            self._diagnoser.run(
                _TrainingStep(pl_module),
                (batch, batch_idx),
                step=step,
                reason=reason,
                region=region,
                scale=scale,
                rename=lambda name: name.removeprefix("module").removeprefix("."),
                window=window if skips else None,
            )


class MixprecReplan(pl.Callback):
    """Re-plan the LightningModule's layer formats as a :class:`~mixprec.plan.ReplanSchedule`
    (``every``, ``phases``, ``lr_decay``, ``lr_fraction``, ``generator``: its arguments) says, before each
    optimizer step's first forward (``on_train_batch_start``, once per global step; ``lr_decay`` reads the
    first optimizer's first group). Layers keep their ``nn.Parameter`` objects, so the optimizer's state
    carries on. Logs ``low_precision_flop_share`` each step (``log_metrics``); checkpoints keep the
    schedule's state, and a resumed fit re-applies its plan first. ``make_plan(pl_module) -> PrecisionPlan``.

    Raises:
        TypeError, ValueError: as ``ReplanSchedule``; during ``fit``, a ``make_plan`` that fails or
            returns a plan that does not fit the module stops it, the module unchanged.
    """

    def __init__(
        self, make_plan: Callable[[nn.Module], Any], *, log_metrics: bool = True, **schedule: Any
    ) -> None:
        from mixprec.plan import ReplanSchedule  # only a re-planning run pays for importing the planner

        self.schedule = ReplanSchedule(make_plan, **schedule)
        self.log_metrics = bool(log_metrics)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        optimizers = trainer.optimizers
        lr = float(optimizers[0].param_groups[0]["lr"]) if optimizers else None
        self.schedule.begin_step(pl_module, trainer.global_step, lr)
        if self.log_metrics:
            for name, value in self.schedule.metrics().items():
                pl_module.log(name, value, on_step=True, on_epoch=False, batch_size=1)

    def state_dict(self) -> dict[str, Any]:
        return self.schedule.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.schedule.load_state_dict(state_dict)
