"""Accelerate: ``MixprecAccelerator``, an ``Accelerator`` whose autocast, loss scaling and unscaling are
mixprec's.

The shortest working path is one changed line, the constructor; the loop stays Accelerate's::

    from mixprec.integrations.accelerate import MixprecAccelerator

    scaler = mixprec.GradScaler(hysteresis=2)
    accelerator = MixprecAccelerator(policy=policy, scaler=scaler, dtype=torch.float16)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    for batch in loader:
        loss = model(batch)                   # the prepared forward runs under mixprec.autocast
        accelerator.backward(loss)            # scaled by the mixprec scaler
        accelerator.clip_grad_norm_(model.parameters(), 1.0)   # unscaled first
        optimizer.step()                      # stepped or skipped by the scaler
        scheduler.step()                      # does not advance on a skipped step
        optimizer.zero_grad()
        accelerator.diagnose_step(model, batch, loss)   # explains the first skipped / non-finite step

Why a subclass and not a kwargs handler: ``GradScalerKwargs`` only forwards torch's constructor arguments to
``torch.amp.GradScaler`` (and on CPU Accelerate builds no scaler at all: ``mixed_precision="fp16"`` there
silently trains in fp32), and ``AutocastKwargs`` only forwards ``enabled``/``cache_enabled`` to
``torch.autocast``: neither can carry a policy or another scaler. The subclass sets the public ``scaler``
(read by ``backward``, the prepared optimizers and ``save_state``/``load_state``) and overrides the public
``prepare_model``, ``prepare_optimizer``, ``autocast`` and ``unscale_gradients``. Needs
``pip install 'mixprec[accelerate]'``.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Generator
from typing import Any

import torch
from torch import nn

try:
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.utils import convert_outputs_to_fp32
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "mixprec.integrations.accelerate needs HF Accelerate: pip install 'mixprec[accelerate]'"
    ) from error

from mixprec import autocast, is_autocast_enabled
from mixprec.integrations._common import Diagnoser, check_policy, check_scaler, checkpoint_in_region, settings
from mixprec.policy import Policy
from mixprec.scaling import GradScaler

__all__ = ["MixprecAccelerator"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@functools.cache
def _warn_once_names() -> None:
    warnings.warn(
        "MixprecAccelerator: the policy pins modules by qualified name, but the model was called outside "
        "`with accelerator.autocast():`, so the region starts inside the model's own call and names are "
        "resolved relative to its children; call the model inside `with accelerator.autocast():`",
        UserWarning,
        stacklevel=4,
    )


class _SkipAwareOptimizer(AcceleratedOptimizer):
    """AcceleratedOptimizer whose ``step_was_skipped`` follows the scaler's decision.

    Accelerate infers a skip from the scaler not calling ``optimizer.step``; a fused optimizer is always
    called and skips inside its kernel, so Accelerate would report no skip (with torch's GradScaler too).
    """

    def step(self, closure: Any = None) -> None:
        super().step(closure)
        if self.scaler is not None and self.gradient_state.sync_gradients:
            self._is_overflow = bool(self.scaler.last_step_skipped)


class MixprecAccelerator(Accelerator):
    """``accelerate.Accelerator`` running prepared models under :class:`mixprec.autocast` and scaling the loss
    with a :class:`mixprec.GradScaler`.

    Takes every ``Accelerator`` argument, plus (keyword-only):

    Args:
        policy: a :class:`mixprec.Policy` or policy string; default: the device's default policy.
        scaler: a :class:`mixprec.GradScaler`; default: a new one when the region's dtype is float16, none for
            bfloat16. It replaces any scaler Accelerate built.
        dtype: the region's dtype (a torch dtype or a name such as "bf16"); default: the policy's compute
            dtype, else that of ``mixed_precision`` ("bf16"/"fp16"), else the device's default (bfloat16
            on CPU, float16 on CUDA). With
            ``mixed_precision="no"`` (recommended) mixprec alone decides each op's dtype; with "bf16"/"fp16"
            Accelerate's own torch.autocast also runs, inside the mixprec region.
        max_diagnoses: how many skipped / non-finite steps :meth:`diagnose_step` explains (0: none).

    Attributes:
        mixprec_scaler: the scaler, or None.
        mixprec_steps: backward passes that ended a gradient accumulation (optimizer steps taken or skipped).
        mixprec_diagnoses: the diagnosis sentences so far.

    Raises:
        ValueError: for a dtype that contradicts the policy or ``mixed_precision``.
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
        check_policy(policy)
        check_scaler(scaler)  # both before Accelerate is set up; the dtype needs its mixed_precision
        diagnoser = Diagnoser(max_diagnoses)
        super().__init__(*args, **kwargs)
        flag = _DTYPES.get(str(self.mixed_precision))
        policy, dtype, scaler = settings(
            policy, scaler, dtype, flag, f"mixed_precision={self.mixed_precision!r}"
        )
        autocast(self.device.type, dtype=dtype, policy=policy)  # validates device and dtype
        self.mixprec_policy, self.mixprec_dtype, self.mixprec_scaler = policy, dtype, scaler
        self._diagnoser = diagnoser
        self._step_scale: torch.Tensor | None = None
        self.mixprec_steps = 0
        if scaler is not None:
            self.scaler = scaler

    @property
    def mixprec_diagnoses(self) -> list[str]:
        return self._diagnoser.diagnoses

    def mixprec_region(self, enabled: bool = True, cache_enabled: bool | None = None) -> autocast:
        """A new :class:`mixprec.autocast` with this accelerator's device, dtype and policy."""
        device, dtype, policy = self.device.type, self.mixprec_dtype, self.mixprec_policy
        return autocast(device, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled, policy=policy)

    @contextlib.contextmanager
    def autocast(self, autocast_handler: Any = None) -> Generator[None, None, None]:
        """The mixprec region; an ``AutocastKwargs`` handler (this call's, else the accelerator's) gives
        ``enabled`` (False: an fp32 island, as with Accelerate) and ``cache_enabled``."""
        handler = self.autocast_handler if autocast_handler is None else autocast_handler
        enabled = True if handler is None else bool(handler.enabled)
        with self.mixprec_region(enabled, None if handler is None else handler.cache_enabled):
            yield

    def prepare_model(
        self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ):  # type: ignore[no-untyped-def]
        """Accelerate's preparation, then the model's forward wrapped in the mixprec region; its floating
        outputs are converted to float32, as Accelerate's own mixed precision does.

        A pin by qualified name (``policy.with_modules({"encoder.0": ...})``) is resolved relative to the
        first module called inside the region; the wrapped forward enters it inside the model's own call,
        where the names are the children's. Call the model inside ``with accelerator.autocast():`` for such
        pins (a warning says so once); pins by module class or by filter need nothing. An HF model's
        gradient checkpointing, enabled before this call, recomputes under the region when the policy pins
        or edits (see ``checkpoint_in_region``; ValueError for a
        reentrant one).
        """
        model = super().prepare_model(
            model, device_placement=device_placement, evaluation_mode=evaluation_mode
        )
        checkpoint_in_region(model, self.mixprec_policy, self.device.type)  # HF gradient checkpointing
        forward = model.forward
        by_name = self.mixprec_policy is not None and any(
            isinstance(key, str) for key, _ in self.mixprec_policy.module_overrides
        )

        @functools.wraps(forward)
        def forward_in_region(*args: Any, **kwargs: Any) -> Any:
            if by_name and not is_autocast_enabled(self.device.type):
                _warn_once_names()
            with self.mixprec_region():  # nested in accelerator.autocast(), it changes nothing
                return forward(*args, **kwargs)

        model.forward = convert_outputs_to_fp32(forward_in_region)
        return model

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None):  # type: ignore[no-untyped-def]
        """Accelerate's wrapper, made to report the scaler's skip decision truthfully."""
        prepared = super().prepare_optimizer(optimizer, device_placement=device_placement)
        if self.mixprec_scaler is not None and type(prepared) is AcceleratedOptimizer:
            prepared.__class__ = _SkipAwareOptimizer  # adds a step override only; no new state
        return prepared

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Accelerate's backward (the loss scaled by the mixprec scaler); counts optimizer steps."""
        super().backward(loss, **kwargs)
        if self.sync_gradients:
            self.mixprec_steps += 1
        scale = None if self.mixprec_scaler is None else self.mixprec_scaler.rule.scale
        self._step_scale = None if scale is None else scale.detach().clone()  # for a diagnosis; no sync

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """Unscale with the mixprec scaler (Accelerate does it only for its own fp16 on an accelerator)."""
        if self.mixprec_scaler is None:
            return super().unscale_gradients(optimizer)
        optimizers = self._optimizers if optimizer is None else optimizer
        for opt in optimizers if isinstance(optimizers, (list, tuple)) else [optimizers]:
            while isinstance(opt, AcceleratedOptimizer):
                opt = opt.optimizer
            self.mixprec_scaler.unscale_(opt)

    def diagnose_step(
        self,
        model: nn.Module,
        inputs: Any,
        loss: torch.Tensor | None = None,
        *,
        loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
        step: int | None = None,
    ) -> str | None:
        """After ``optimizer.step()``: if that step was skipped or ``loss`` is non-finite, re-run ``inputs``
        under :func:`mixprec.inspect.find_nonfinite` (at most ``max_diagnoses`` times), log the sentence
        (logger ``"mixprec.integrations"``) and return it; else None.

        Args:
            model: the prepared model; it is called as ``model(inputs)`` (``*inputs`` for a tuple,
                ``**inputs`` for a dict).
            inputs: the batch as the model takes it.
            loss: the step's loss, checked for inf/nan.
            loss_fn: ``loss_fn(model, batch) -> loss`` when the output is not the loss (nor holds ``loss``),
                as :func:`mixprec.inspect.find_nonfinite` takes it; ``batch`` is ``inputs``.
            step: the step number for the sentence (default: :attr:`mixprec_steps`, the backward passes
                that ended an accumulation, so the 1-based number of the step just taken).

        Raises:
            TypeError: a ``loss_fn`` that is not callable or takes one required argument (a loss of the
                output, ``loss_fn(output)``: the message shows the ``loss_fn(model, batch)`` to write).
        """
        if loss_fn is not None:
            from mixprec.inspect._modules import model_loss  # the one check of inspect's loss_fn dialect

            loss_fn = model_loss(loss_fn, "MixprecAccelerator.diagnose_step")
        if not self._diagnoser.wanted:
            return None
        nonfinite = loss is not None and not bool(torch.isfinite(loss.detach()).all())
        skipped = self.mixprec_scaler is not None and self.optimizer_step_was_skipped
        if not (nonfinite or skipped):
            return None
        return self._diagnoser.run(
            model,
            inputs,
            step=self.mixprec_steps if step is None else step,
            reason="skipped its optimizer step" if skipped else "gave a non-finite loss",
            region=self.mixprec_region(),
            scale=1.0 if self._step_scale is None else float(self._step_scale.item()),
            loss_fn=loss_fn,
        )
