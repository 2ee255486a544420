"""HF transformers: ``MixprecTrainer``, the ``Trainer`` under a mixprec policy, scaler and diagnosis.

Usage::

    from mixprec.integrations.transformers import MixprecTrainer

    policy = mixprec.Policy.preset("bf16-mixed").with_modules({"lm_head": torch.float32})
    trainer = MixprecTrainer(model=model, args=args, train_dataset=data, policy=policy)
    trainer.train()

Why a subclass and not a ``TrainerCallback``: a callback sees neither the forward (it cannot enter an autocast
region around ``compute_loss``), nor ``accelerator.backward`` (where the loss is scaled), nor the log dict
before it is stored. The subclass overrides public methods only (and ``train``, for 4.x's scaler file):

* ``compute_loss_context_manager``: ``compute_loss`` (training and evaluation) runs inside
  :class:`mixprec.autocast`. With ``bf16=True``/``fp16=True`` Accelerate also wraps the model's forward in its
  own ``torch.autocast``, entered inside the mixprec region; the mixprec policy must win there (the engine's
  job: a mixprec region is torch's autocast state).
* ``create_accelerator_and_postprocess``: the accelerator's ``scaler`` is the :class:`mixprec.GradScaler`
  (before ``prepare``), so ``accelerator.backward`` scales, the prepared optimizer steps or skips through it,
  ``accelerator.optimizer_step_was_skipped`` is True on a skipped step and the Trainer then leaves the LR
  schedule where it was; checkpoints save and resume the scaler (``scaler.pt``).
* ``training_step``: on the last micro-batch of an accumulation, gradients are unscaled before the Trainer
  clips them and measures ``grad_norm`` (Accelerate does it itself only for its own fp16 on an accelerator); a
  step whose loss is non-finite, or that the scaler skipped, is diagnosed once (see below).
* ``log``: every training log gains ``loss_scale`` and ``skipped_steps`` (with a scaler).
* ``prediction_step``: loss and logits in float32, as Accelerate's own mixed precision returns a prepared
  model's outputs (the region's fp16 logits would reach ``compute_metrics`` as float16).

Diagnosis: the first time a step is skipped or its loss is non-finite, :func:`mixprec.inspect.find_nonfinite`
re-runs that batch through the Trainer's ``compute_loss`` (a subclass's own loss included) and the sentence is
logged (logger ``"mixprec.integrations"``) and kept in
``trainer.mixprec_diagnoses``. Needs ``pip install 'mixprec[transformers]'``.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
from torch import nn

try:
    import transformers
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "mixprec.integrations.transformers needs HF transformers: pip install 'mixprec[transformers]'"
    ) from error

from mixprec import autocast
from mixprec.integrations._common import Diagnoser, checkpoint_in_region, scaler_metrics, settings
from mixprec.policy import Policy
from mixprec.scaling import GradScaler

__all__ = ["MixprecReplanCallback", "MixprecTrainer"]

# transformers 4.x names scaler.pt but neither saves nor loads it; 5.x does both (_save_scaler, _load_scaler).
_TRAINER_KEEPS_SCALER = hasattr(transformers.Trainer, "_save_scaler")
_SCALER_FILE = "scaler.pt"


class _AfterStep(transformers.TrainerCallback):
    """Tells Accelerate the truth about a skipped step, and runs the pending diagnosis after the step."""

    def __init__(self, trainer: MixprecTrainer) -> None:
        self.trainer = trainer

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self.trainer
        # the Trainer enabled it (activation_checkpointing in 5.x) and the user gave no use_reentrant
        enabled = getattr(args, "activation_checkpointing", None) or getattr(
            args, "gradient_checkpointing", False
        )
        user_kwargs = getattr(args, "activation_checkpointing_kwargs", None)
        user_kwargs = user_kwargs or getattr(args, "gradient_checkpointing_kwargs", None) or {}
        ours = bool(enabled) and "use_reentrant" not in user_kwargs
        model = kwargs.get("model") or trainer.model
        assert isinstance(model, torch.nn.Module), type(model)
        checkpoint_in_region(model, trainer._mixprec_policy, args.device.type, reentrant_is_ours=ours)

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer._report_skip()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer._diagnose_pending_step()

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        scaler = self.trainer.mixprec_scaler
        if scaler is None or _TRAINER_KEEPS_SCALER or not args.should_save:
            return
        folder = os.path.join(
            args.output_dir, f"{transformers.trainer_utils.PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        )
        if os.path.isdir(folder):
            torch.save(scaler.state_dict(), os.path.join(folder, _SCALER_FILE))


class MixprecTrainer(transformers.Trainer):
    """``transformers.Trainer`` whose forward runs under mixprec's policy and whose loss scaling is mixprec's.

    Takes every ``Trainer`` argument, plus (keyword-only):

    Args:
        policy: a :class:`mixprec.Policy` or policy string; default: the device's default policy.
        scaler: a :class:`mixprec.GradScaler`; default: a new one when the region's dtype is float16, none
            for bfloat16 (pass one to count skipped steps there too). Replaces Accelerate's own scaler.
        dtype: the region's dtype (a torch dtype or a name such as "bf16"); default: the policy's compute
            dtype, else bfloat16 with ``bf16=True``,
            float16 with ``fp16=True``, else the device's default (bfloat16 on CPU, float16 on CUDA).
        max_diagnoses: skipped or non-finite steps to explain with find_nonfinite (0: never).

    Attributes:
        mixprec_scaler: the scaler, or None.
        mixprec_diagnoses: the diagnosis sentences logged so far.

    Raises:
        ValueError: for a dtype that contradicts the policy or ``bf16``/``fp16``.
        TypeError: for a scaler that is not a mixprec.GradScaler, or a bad policy.
    """

    def __init__(
        self,
        *args: Any,
        policy: Policy | str | None = None,
        scaler: GradScaler | None = None,
        dtype: torch.dtype | str | None = None,
        max_diagnoses: int = 1,
        **kwargs: Any,
    ) -> None:
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        policy, dtype, self.mixprec_scaler = settings(
            policy, scaler, dtype, _dtype_of(training_args), "the TrainingArguments' bf16/fp16"
        )
        self._mixprec_policy, self._mixprec_dtype = policy, dtype
        self._diagnoser = Diagnoser(max_diagnoses)
        self._pending: tuple[nn.Module, list[Any], str, torch.Tensor | None] | None = None
        self._window: list[Any] = []  # the micro-batches of the accumulation in progress
        super().__init__(*args, **kwargs)
        autocast(self.args.device.type, dtype=dtype, policy=policy)  # validates device and dtype now
        self.add_callback(_AfterStep(self))

    @property
    def mixprec_diagnoses(self) -> list[str]:
        return self._diagnoser.diagnoses

    def mixprec_region(self) -> autocast:
        """A new :class:`mixprec.autocast` with this trainer's device, dtype and policy."""
        return autocast(self.args.device.type, dtype=self._mixprec_dtype, policy=self._mixprec_policy)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's ``train``; on transformers 4.x, which keeps no scaler in checkpoints, the scaler is
        restored from the ``scaler.pt`` this trainer wrote there (a checkpoint without one leaves it as is).
        """
        if resume_from_checkpoint and self.mixprec_scaler is not None and not _TRAINER_KEEPS_SCALER:
            folder = resume_from_checkpoint
            if folder is True:
                folder = transformers.trainer_utils.get_last_checkpoint(self.args.output_dir)
            path = os.path.join(str(folder), _SCALER_FILE)
            if os.path.isfile(path):
                self.mixprec_scaler.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        if self.mixprec_scaler is not None:
            self.accelerator.scaler = self.mixprec_scaler

    def compute_loss_context_manager(self) -> contextlib.ExitStack:
        """The Trainer's own context (an ExitStack in 5.x; torch.autocast or a nullcontext in 4.x), then
        the mixprec region inside it."""
        stack = contextlib.ExitStack()
        stack.enter_context(super().compute_loss_context_manager())
        stack.enter_context(self.mixprec_region())
        return stack

    def training_step(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> torch.Tensor:
        scaler = self.mixprec_scaler
        loss = super().training_step(model, inputs, num_items_in_batch)
        scale = None if scaler is None or scaler.rule.scale is None else scaler.rule.scale.detach().clone()
        if scaler is not None and self.accelerator.sync_gradients and not self._accelerate_unscales():
            scaler.unscale_(_inner_optimizer(self.optimizer))  # before the Trainer clips / measures grads
        window = [*self._window, inputs]
        self._window = [] if self.accelerator.sync_gradients else window
        if self._diagnoser.wanted and self._pending is None:
            if not bool(torch.isfinite(loss).all()):
                self._pending = (model, [inputs], "gave a non-finite loss", scale)
            elif scaler is not None and self.accelerator.sync_gradients:
                # decided after the step, skipped or not; every micro-batch, the one that overflowed found
                self._pending = (model, window, "", scale)
        return loss

    def prediction_step(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
    ) -> tuple[torch.Tensor | None, Any, Any]:
        """The Trainer's, its loss and logits converted to float32 as Accelerate converts a prepared model's
        outputs under its own mixed precision (fp16 logits would reach ``compute_metrics`` as float16)."""
        from accelerate.utils import convert_to_fp32  # a dependency of transformers' Trainer

        loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        return convert_to_fp32(loss), convert_to_fp32(logits), labels

    def _report_skip(self) -> None:
        """Make ``accelerator.optimizer_step_was_skipped`` follow the scaler (read right after this hook).

        Accelerate infers a skip from the scaler not calling ``optimizer.step``; a fused optimizer (the
        Trainer's default ``adamw_torch_fused``) is always called and skips inside its kernel, so Accelerate
        would report no skip and the LR schedule would advance (with torch's GradScaler too).
        """
        from accelerate.optimizer import AcceleratedOptimizer

        if self.mixprec_scaler is not None and isinstance(self.optimizer, AcceleratedOptimizer):
            self.optimizer._is_overflow = self.mixprec_scaler.last_step_skipped  # Accelerate's own flag

    def _accelerate_unscales(self) -> bool:
        """Whether ``accelerator.clip_grad_norm_`` unscales by itself (its own fp16 on an accelerator)."""
        return bool(self.accelerator.native_amp) and self.accelerator.mixed_precision == "fp16"

    def _diagnose_pending_step(self) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        model, window, reason, scale = pending
        if not reason:
            if not self.accelerator.optimizer_step_was_skipped:
                return
            reason = "skipped its optimizer step"
        self._diagnoser.run(
            model,
            window[-1],
            window=window,
            step=self.state.global_step,
            reason=reason,
            region=self.mixprec_region(),
            scale=1.0 if scale is None else float(scale.item()),
            loss_fn=self._batch_loss,
        )

    def _batch_loss(self, model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        """The Trainer's loss of a batch (``compute_loss``, a subclass's own included), on a copy of the
        batch: ``compute_loss`` may pop its labels."""
        loss = self.compute_loss(model, dict(inputs))
        return loss[0] if isinstance(loss, tuple) else loss

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if self.mixprec_scaler is not None and "loss" in logs:
            logs = {**logs, **scaler_metrics(self.mixprec_scaler)}
        for callback in self.callback_handler.callbacks:  # before the reporting callbacks see the logs
            if isinstance(callback, MixprecReplanCallback) and "loss" in logs:
                logs = {**logs, **callback.schedule.metrics()}
        super().log(logs, *args, **kwargs)


class MixprecReplanCallback(transformers.TrainerCallback):
    """Re-plan the model's layer formats during ``Trainer`` training, as a
    :class:`~mixprec.plan.ReplanSchedule` (``every``, ``phases``, ``lr_decay``,
    ``lr_fraction``, ``generator``: its arguments) says; works with ``transformers.Trainer`` and
    :class:`MixprecTrainer`.

    ``on_step_begin`` (before an optimizer step's first micro-batch) applies the step's plan, if any, to the
    model in place (``state.global_step`` numbers the steps); the layers keep their ``nn.Parameter``
    objects, so the optimizer and its state carry on. The learning rate read for ``lr_decay`` is the
    optimizer's first group's. Each training log gains ``low_precision_flop_share`` (with
    ``MixprecTrainer`` before any reporting callback sees it; with the plain ``Trainer`` in
    ``state.log_history`` and for the callbacks after this one). Checkpoints carry the schedule's state in
    ``trainer_state.json`` (key ``"mixprec_replan"``); resuming re-applies its plan before the first step.

    Args:
        make_plan: ``make_plan(model) -> PrecisionPlan``, ``model`` being the Trainer's (unwrapped) model.

    Raises:
        TypeError, ValueError: as ``ReplanSchedule``; during ``train``, a ``make_plan`` that fails or
            returns a plan that does not fit the model stops it, the model unchanged.
    """

    def __init__(self, make_plan: Any, **schedule: Any) -> None:
        from mixprec.plan import ReplanSchedule  # only a re-planning run pays for importing the planner

        self.schedule = ReplanSchedule(make_plan, **schedule)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        saved = (state.stateful_callbacks or {}).get(_REPLAN_KEY)
        if saved is not None and state.global_step > 0:  # resuming from a checkpoint this callback saved
            self.schedule.load_state_dict(saved)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        optimizer = kwargs.get("optimizer")
        lr = float(optimizer.param_groups[0]["lr"]) if optimizer is not None else None
        self.schedule.begin_step(kwargs["model"], state.global_step, lr)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # every step: a checkpoint ("steps", "epoch" or "best") may follow any of them
        state.stateful_callbacks[_REPLAN_KEY] = self.schedule.state_dict()

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if not logs or "loss" not in logs:
            return
        metrics = self.schedule.metrics()
        logs.update(metrics)
        last = state.log_history[-1] if state.log_history else None
        if last is not None and last.get("step") == state.global_step and "loss" in last:
            last.update(metrics)


# Not the class name: the Trainer's restore_callback_states_from_checkpoint rebuilds callbacks stored under
# their class name with no arguments, which a callback holding a make_plan function cannot be.
_REPLAN_KEY = "mixprec_replan"


def _dtype_of(args: Any) -> torch.dtype | None:
    if getattr(args, "bf16", False):
        return torch.bfloat16
    if getattr(args, "fp16", False):
        return torch.float16
    return None


def _inner_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside Accelerate's AcceleratedOptimizer wrapper(s)."""
    from accelerate.optimizer import AcceleratedOptimizer  # a dependency of transformers' Trainer

    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer
