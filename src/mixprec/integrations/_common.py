"""What the integrations share: argument checks, the scaler's metrics and the in-loop diagnosis."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from mixprec.policy import Policy
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
    dtype: torch.dtype | None,
    flag: torch.dtype | None,
    flag_name: str,
) -> tuple[Policy | None, torch.dtype | None, GradScaler | None]:
    """An integration's (policy, region dtype, scaler), all checked: the dtype reconciled with the
    framework's own flag and the policy, and a default mixprec.GradScaler for float16.

    Raises:
        TypeError / ValueError: as :func:`check_policy`, :func:`check_scaler`, :func:`framework_dtype`
            and :func:`region_dtype`.
    """
    policy = check_policy(policy)
    scaler = check_scaler(scaler)
    dtype = region_dtype(policy, framework_dtype(dtype, flag, flag_name), "dtype")
    if scaler is None and dtype == torch.float16:
        scaler = GradScaler()
    return policy, dtype, scaler


def scaler_metrics(scaler: GradScaler) -> dict[str, float]:
    """``{"loss_scale": ..., "skipped_steps": ...}`` as floats, for a logger (one host sync)."""
    return {"loss_scale": float(scaler.get_scale()), "skipped_steps": float(scaler.skipped_steps)}


def loss_of(output: Any) -> torch.Tensor:
    """The loss inside a model's or training step's output: the tensor itself, ``output["loss"]``,
    ``output.loss`` or ``output[0]``."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict) and "loss" in output:
        return output["loss"]
    if getattr(output, "loss", None) is not None:
        return output.loss
    return output[0]


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
        loss_fn: Callable[[Any], torch.Tensor] | None = None,
    ) -> str:
        """Run find_nonfinite on ``model(inputs)`` (loss from :func:`loss_of`, times ``scale``); log and keep
        the sentence.

        Args:
            model: what to call on ``inputs`` (a tensor, a tuple of positional args or a dict of kwargs).
            step: the global step, for the sentence.
            reason: what happened ("skipped its optimizer step", "gave a non-finite loss").
            region: the mixprec.autocast the step ran under (its device type, dtype and policy are reused).
            scale: the loss scale at that step.
            loss_fn: ``loss_fn(output) -> loss`` instead of :func:`loss_of`.
            rename: maps the report's module name (e.g. strips a wrapper's prefix).
        """
        from mixprec.inspect import find_nonfinite  # only a diagnosis pays for importing inspect

        get_loss = loss_of if loss_fn is None else loss_fn
        report = find_nonfinite(
            model,
            inputs,
            loss_fn=lambda output: get_loss(output).float() * scale,
            dtype=region.fast_dtype,
            device_type=region.device_type,
            policy=region.policy,
        )
        if report is not None and rename is not None:
            report = dataclasses.replace(report, module=rename(report.module))
        if report is None:
            found = (
                f"every value stayed finite when find_nonfinite re-ran that batch at loss scale {scale:g}, "
                "so the inf/nan did not come from this batch's forward or backward alone (look at the data "
                "pipeline, gradient accumulation or the optimizer)"
            )
        else:
            found = str(report)
        sentence = f"mixprec: step {step} {reason}. {found}"
        logger.warning(sentence)
        self.diagnoses.append(sentence)
        return sentence
