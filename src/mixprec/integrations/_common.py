"""What the integrations share: argument checks, the scaler's metrics and the in-loop diagnosis."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from mixprec.autocast.checkpoint import autocast_context_fn
from mixprec.policy import Policy
from mixprec.policy.names import as_dtype
from mixprec.policy.policy import check_policy
from mixprec.scaling import GradScaler

__all__ = ["Diagnoser", "check_policy", "check_scaler", "framework_dtype", "region_dtype", "scaler_metrics"]

logger = logging.getLogger("mixprec.integrations")


def check_scaler(scaler: GradScaler | None) -> GradScaler | None:
    """``scaler`` if it is a :class:`mixprec.GradScaler` or None.

    Raises:
        TypeError: for anything else (a ``torch.amp.GradScaler`` has no skip counters or hysteresis).
    """
    if scaler is None or isinstance(scaler, GradScaler):
        return scaler
    raise TypeError(
        f"scaler must be a mixprec.GradScaler or None, got {type(scaler).__module__}.{type(scaler).__name__}"
        " (torch's GradScaler has no skip counters; mixprec.GradScaler takes the same arguments)"
    )


def region_dtype(policy: Policy | None, dtype: torch.dtype | None, source: str) -> torch.dtype | None:
    """The region's dtype: ``dtype`` (what ``source`` asked for) unless the policy names one of its own.

    Raises:
        ValueError: when both name a dtype and they differ.
    """
    compute = None if policy is None else policy.compute_dtype
    if dtype is not None and compute is not None and compute != dtype:
        raise ValueError(f"{source} asks for {dtype}, but the policy's compute dtype is {compute}; give one")
    return dtype if compute is None else compute


def framework_dtype(
    dtype: torch.dtype | None, flag: torch.dtype | None, flag_name: str
) -> torch.dtype | None:
    """``dtype`` (the user's) or else the one the framework's own mixed-precision flag names.

    Raises:
        ValueError: when both are given and differ (the framework's torch.autocast would run in another
            dtype inside the mixprec region).
    """
    if dtype is not None and flag is not None and dtype != flag:
        raise ValueError(f"dtype={dtype} contradicts {flag_name} ({flag}); drop one of them")
    return dtype if dtype is not None else flag


def settings(
    policy: Policy | str | None,
    scaler: GradScaler | None,
    dtype: torch.dtype | str | None,
    flag: torch.dtype | None,
    flag_name: str,
) -> tuple[Policy | None, torch.dtype | None, GradScaler | None]:
    """An integration's (policy, region dtype, scaler), all checked: the dtype reconciled with the
    framework's own flag and the policy, and a default mixprec.GradScaler for float16.

    Raises:
        TypeError, ValueError: as :func:`check_policy`, :func:`check_scaler`, :func:`framework_dtype`
            and :func:`region_dtype`; for a ``dtype`` that is no dtype or dtype name.
    """
    policy = check_policy(policy)
    scaler = check_scaler(scaler)
    dtype = None if dtype is None else as_dtype(dtype, "dtype")  # "bf16" as autocast takes it
    source = "dtype" if dtype is not None else flag_name  # the setting the user gave, named in an error
    dtype = region_dtype(policy, framework_dtype(dtype, flag, flag_name), source)
    if scaler is None and dtype == torch.float16:
        scaler = GradScaler()
    return policy, dtype, scaler


def checkpoint_in_region(
    model: nn.Module, policy: Policy | None, device_type: str, *, reentrant_is_ours: bool = False
) -> int:
    """Make a Hugging Face model's gradient checkpointing recompute under the mixprec region.

    torch's checkpoint replays torch's autocast state only; a policy that pins modules or edits ops
    would recompute in other dtypes ("Recomputed values ... have different metadata"). Every module that
    HF's ``gradient_checkpointing_enable`` armed (``gradient_checkpointing`` True and a
    ``_gradient_checkpointing_func``) gets that function called with ``use_reentrant=False`` and
    ``context_fn=mixprec.autocast_context_fn``; one log line says so. Nothing changes for a policy
    without pins or edits, or where the user gave a ``context_fn`` of their own.

    Args:
        model: the model (any nn.Module; only HF-armed submodules are touched).
        policy: the integration's policy.
        device_type: the region's device type.
        reentrant_is_ours: the reentrant variant was the framework's default, not the user's choice
            (transformers 4.x defaults to it): switch it to non-reentrant instead of refusing it.

    Returns:
        How many modules now checkpoint under the region.

    Raises:
        ValueError: when checkpointing was enabled with ``use_reentrant=True`` by the user (the reentrant
            variant has no hook to replay the region); the message names the fix.
    """
    if policy is None or not (policy.module_overrides or policy.resolve(device_type).deviations):
        return 0
    armed = [
        module
        for module in model.modules()
        if getattr(module, "gradient_checkpointing", False) is True
        and callable(getattr(module, "_gradient_checkpointing_func", None))
    ]
    rewired = 0
    for module in armed:
        original: Callable[..., Any] = module._gradient_checkpointing_func  # type: ignore[assignment]
        keywords = getattr(original, "keywords", {})
        if getattr(original, "_mixprec_region", False) or keywords.get("context_fn") is not None:
            continue
        if keywords.get("use_reentrant", False) and not reentrant_is_ours:
            raise ValueError(
                f"{type(module).__name__} checkpoints with use_reentrant=True, which cannot replay the "
                "mixprec "
                "region a pinned or edited policy needs on recompute; enable it with "
                "gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False, "
                "'context_fn': mixprec.autocast_context_fn}), or leave use_reentrant unset"
            )
        module._gradient_checkpointing_func = _in_region(original)  # type: ignore[assignment]
        rewired += 1
    if rewired:
        logger.info(
            "mixprec: gradient checkpointing of %d module(s) recomputes under the mixprec region "
            "(use_reentrant=False, context_fn=mixprec.autocast_context_fn), since the policy pins modules "
            "or edits ops",
            rewired,
        )
    return rewired


def _in_region(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        kwargs.update(use_reentrant=False, context_fn=autocast_context_fn)
        return original(function, *args, **kwargs)

    checkpoint._mixprec_region = True  # type: ignore[attr-defined]
    return checkpoint


def scaler_metrics(scaler: GradScaler) -> dict[str, float]:
    """``{"loss_scale": ..., "skipped_steps": ...}`` as floats, for a logger (one host sync)."""
    return {"loss_scale": float(scaler.get_scale()), "skipped_steps": float(scaler.skipped_steps)}


class _NoLoss(ValueError):
    """The re-run step's output holds no loss and no ``loss_fn`` was given: raised as it is, not as an
    error of a ``loss_fn`` the caller never passed."""


def _require_loss(loss: torch.Tensor | None) -> torch.Tensor:
    if loss is None:
        raise ValueError("loss_fn(model, batch) returned None; it must return the loss")
    return loss


def loss_of(output: Any) -> torch.Tensor | None:
    """The loss inside a model's or training step's output: the tensor itself, ``output["loss"]``,
    ``output.loss`` or ``output[0]``; None when there is none (a manual-optimization step returning None
    or a dict without ``"loss"``)."""
    if output is None or isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict):
        return output.get("loss")
    if getattr(output, "loss", None) is not None:
        return output.loss
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return None


def nonfinite_grads(named_params: Any, limit: int = 5) -> list[str]:
    """Names of the first ``limit`` parameters whose ``.grad`` holds inf/nan (one host sync in all; called
    only after a step was skipped)."""
    named = [(name, param.grad) for name, param in named_params if param.grad is not None]
    if not named:
        return []
    bad = torch.stack([~torch.isfinite(grad).all() for _, grad in named]).tolist()
    return [name for (name, _), flag in zip(named, bad, strict=True) if flag][:limit]


class Diagnoser:
    """Explains a skipped step or a non-finite loss by re-running that batch under
    :func:`mixprec.inspect.find_nonfinite`, at most ``max_diagnoses`` times per run.

    The sentence is logged (logger ``"mixprec.integrations"``, level WARNING) and kept in
    :attr:`diagnoses`. The re-run multiplies the loss by the loss scale in force at that step, so an
    overflow of the scaled backward shows up as it did in training; the model comes back bitwise as it was.

    Args:
        max_diagnoses: re-runs allowed (0 turns diagnosis off).

    Raises:
        ValueError: for a negative or non-int ``max_diagnoses``.
    """

    def __init__(self, max_diagnoses: int = 1) -> None:
        if isinstance(max_diagnoses, bool) or not isinstance(max_diagnoses, int) or max_diagnoses < 0:
            raise ValueError(f"max_diagnoses must be an int >= 0, got {max_diagnoses!r}")
        self.max_diagnoses = max_diagnoses
        self.diagnoses: list[str] = []

    @property
    def wanted(self) -> bool:
        """Whether another diagnosis may run."""
        return len(self.diagnoses) < self.max_diagnoses

    def run(
        self,
        model: nn.Module,
        inputs: Any,
        *,
        step: int,
        reason: str,
        region: Any,
        scale: float = 1.0,
        rename: Callable[[str], str] | None = None,
        loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
        window: list[Any] | None = None,
    ) -> str:
        """Run find_nonfinite on ``inputs`` (the loss ``loss_fn(model, batch)``, or :func:`loss_of` the output
        of ``model(inputs)``, times ``scale``); log and keep the sentence.

        Args:
            model: what to call on ``inputs`` (a tensor, a tuple of positional args or a dict of kwargs).
            step: the framework's global step after that step (1-based: the n-th step is ``step n``).
            reason: what happened ("skipped its optimizer step", "gave a non-finite loss").
            region: the mixprec.autocast the step ran under (its device type, dtype and policy are reused).
            scale: the loss scale at that step.
            loss_fn: ``loss_fn(model, batch) -> loss``, as :func:`mixprec.inspect.find_nonfinite` takes it,
                instead of :func:`loss_of` the model's output.
            rename: maps the report's module name (e.g. strips a wrapper's prefix).
            window: every micro-batch of a gradient accumulation, in order (``inputs`` is then ignored):
                each is re-run until one reports, and the sentence names it.
        """
        from mixprec.inspect import find_nonfinite  # only a diagnosis pays for importing inspect
        from mixprec.inspect._modules import call_model, describe

        def output_loss(model: nn.Module, batch: Any) -> torch.Tensor:
            output = call_model(model, batch)
            loss = loss_of(output)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:  # logits, say: no loss to re-run
                raise _NoLoss(
                    f"the diagnosis re-ran the step, but the model's output ({describe(output)}) holds no "
                    "loss; pass loss_fn=, loss_fn(model, batch) -> loss"
                )
            return loss

        get_loss = output_loss if loss_fn is None else loss_fn
        batches = [inputs] if not window else list(window)
        report, where_found = None, 0
        for where_found, batch in enumerate(batches):  # noqa: B007 - the index of the batch that reported
            try:
                report = find_nonfinite(
                    model,
                    batch,
                    loss_fn=lambda model, batch: _require_loss(get_loss(model, batch)).float() * scale,
                    dtype=region.fast_dtype,
                    device_type=region.device_type,
                    policy=region.policy,
                )
            except ValueError as error:  # find_nonfinite wraps what a loss_fn raises
                if isinstance(error.__cause__, _NoLoss):
                    raise error.__cause__ from None
                raise
            if report is not None:
                break
        if report is not None and rename is not None:
            state = None if report.state is None else rename(report.state)
            report = dataclasses.replace(report, module=rename(report.module), state=state)
        where = "that batch" if len(batches) == 1 else f"the {len(batches)} micro-batches of that step"
        if report is None:
            found = (
                f"every value stayed finite when find_nonfinite re-ran {where} at loss scale {scale:g}, "
                "so the inf/nan did not come from this batch's forward or backward alone (look at the data "
                "pipeline or the optimizer)"
            )
        else:
            found = str(report)
            if len(batches) > 1:
                found = f"In micro-batch {where_found + 1} of {len(batches)}: {found}"
        return self.note(step, reason, found)

    def note(self, step: int, reason: str, found: str) -> str:
        """Log and keep ``"mixprec: step {step} {reason}. {found}"`` (a diagnosis made without a re-run)."""
        sentence = f"mixprec: step {step} {reason}. {found}"
        logger.warning(sentence)
        self.diagnoses.append(sentence)
        return sentence
