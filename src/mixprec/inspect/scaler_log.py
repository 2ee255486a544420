"""`ScalerLog`: an opt-in per-step record of a loss scaler, kept in memory and written as JSON Lines.

It observes the scaler through its public API only, so it works with :class:`mixprec.GradScaler` and
``torch.amp.GradScaler`` alike::

    log = ScalerLog(scaler, "run.jsonl", optimizer=optimizer, model=model)
    for step, (x, y) in enumerate(data):
        with mixprec.autocast("cuda"):
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        log.record(step, loss=loss)        # after update(), before zero_grad()
        optimizer.zero_grad()

Each record has ``step``, ``scale`` (the scale after this step's update, the one the next step uses, as
``mixprec bench --log`` writes it), ``skipped``, ``grad_amax`` (largest ``|grad|`` after unscaling; null
when not finite) and ``loss`` when given; a skipped step also lists ``nonfinite_params``, and with
``histogram_every=N`` every N-th record carries ``grad_log2_hist`` (see :class:`Log2Histogram`).
Skips are read from ``scaler.last_step_skipped`` where the scaler has it; otherwise from the scale
dropping, which a dynamic scaler does exactly when it skips. ``enabled=False`` makes ``record`` a no-op
that never touches the scaler or the gradients. Lines are appended and flushed one at a time; ``close()``
(or leaving the ``with`` block) appends an end-of-log trailer, by which a reader tells a complete log
from one whose writer was stopped.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import IO, Any

import torch
from torch import nn

from mixprec._files import trailer_line, write_atomic
from mixprec.inspect.grads import Source, grad_amax, named_grads, nonfinite_params
from mixprec.inspect.summaries import Log2Histogram

__all__ = ["ScalerLog"]

_MAX_NAMED = 32


def _line(record: dict[str, Any]) -> str:
    return json.dumps(record, allow_nan=False) + "\n"


def _finite_or_none(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


class ScalerLog:
    """Per-step scale, skipped flag, gradient amax and loss of a training run.

    Args:
        scaler: a ``mixprec.GradScaler`` or ``torch.amp.GradScaler`` (anything with ``get_scale()``).
        path: a JSON Lines file to write (truncated by the first record), or None to keep records in
            memory only.
        optimizer: where the gradients are read from (or pass ``model``); without either, ``grad_amax``
            and ``nonfinite_params`` are left out.
        model: names the parameters in ``nonfinite_params`` (and is the gradient source without optimizer).
        enabled: False makes :meth:`record` a no-op.
        histogram_every: add a log2 histogram of all gradients to every N-th record (0: never).

    Raises:
        TypeError: if ``scaler`` has no ``get_scale()``.
        ValueError: for a negative ``histogram_every``.
    """

    def __init__(
        self,
        scaler: Any,
        path: str | Path | None = None,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        model: nn.Module | None = None,
        enabled: bool = True,
        histogram_every: int = 0,
    ) -> None:
        if not callable(getattr(scaler, "get_scale", None)):
            raise TypeError(f"scaler must have a get_scale() method, got {type(scaler).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}"
            )
        if not isinstance(histogram_every, int) or histogram_every < 0:
            raise ValueError(f"histogram_every must be an int >= 0, got {histogram_every!r}")
        self.scaler = scaler
        self.path = None if path is None else Path(path)
        self.source: Source | None = optimizer if optimizer is not None else model
        self.model = model
        self.enabled = enabled
        self.histogram_every = histogram_every
        self.records: list[dict[str, Any]] = []
        self._file: IO[str] | None = None
        self._started = False
        self._next_step = 0
        self._previous_scale: float | None = float(scaler.get_scale()) if enabled else None

    def record(
        self, step: int | None = None, *, loss: torch.Tensor | float | None = None
    ) -> dict[str, Any] | None:
        """Record one step (call after ``scaler.update()``); returns the record, or None when disabled.

        Args:
            step: the step number; default: one more than the last recorded step.
            loss: the step's (unscaled) loss, a tensor or a number.
        """
        if not self.enabled:
            return None
        step = self._next_step if step is None else int(step)
        self._next_step = step + 1
        scale = float(self.scaler.get_scale())
        record: dict[str, Any] = {
            "step": step,
            "scale": _finite_or_none(scale),
            "skipped": self._skipped(scale),
        }
        self._previous_scale = scale
        if loss is not None:
            record["loss"] = _finite_or_none(float(loss.detach() if isinstance(loss, torch.Tensor) else loss))
        if self.source is not None:
            self._add_gradients(record)
        self.records.append(record)
        if self.path is not None:
            self._write(record)
        return record

    def _skipped(self, scale: float) -> bool:
        flag = getattr(self.scaler, "last_step_skipped", None)
        if flag is not None:
            return bool(flag)
        return self._previous_scale is not None and scale < self._previous_scale

    def _add_gradients(self, record: dict[str, Any]) -> None:
        assert self.source is not None  # only called when there is one
        record["grad_amax"] = _finite_or_none(grad_amax(self.source, model=self.model))
        if record["skipped"]:
            names = nonfinite_params(self.source, model=self.model)
            record["nonfinite_params"] = names[:_MAX_NAMED]
            record["nonfinite_param_count"] = len(names)
        if self.histogram_every and len(self.records) % self.histogram_every == 0:
            histogram = Log2Histogram()
            for _, grad in named_grads(self.source, model=self.model):
                histogram.add(grad)
            record["grad_log2_hist"] = histogram.to_dict()

    def _write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            if self._started:  # reopened after close(): rewrite what is held, without the trailer
                write_atomic(self.path, "".join(_line(r) for r in self.records[:-1]))  # type: ignore[arg-type]
            else:
                self.path.parent.mkdir(parents=True, exist_ok=True)  # type: ignore[union-attr]
            self._file = self.path.open("a" if self._started else "w")  # type: ignore[union-attr]
            self._started = True
        self._file.write(_line(record))
        self._file.flush()

    def close(self) -> None:
        """Append the end-of-log trailer and close the file (records stay in memory); a later record
        rewrites the file without the trailer and appends. A log without its trailer is reported as
        incomplete by ``mixprec report`` (see ``mixprec._files``)."""
        if self._file is not None:
            self._file.write(trailer_line(len(self.records)))
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None

    def __enter__(self) -> ScalerLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def skipped_steps(self) -> list[int]:
        """Steps recorded as skipped."""
        return [r["step"] for r in self.records if r["skipped"]]

    def state_dict(self) -> dict[str, Any]:
        """The scale seen last and the next step number (to resume skip detection after a checkpoint)."""
        return {"previous_scale": self._previous_scale, "next_step": self._next_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s fields (the records themselves live in the JSONL file)."""
        missing = {"previous_scale", "next_step"} - set(state)
        if missing:
            raise ValueError(f"ScalerLog state lacks {sorted(missing)}; got keys {sorted(state)}")
        previous = state["previous_scale"]
        self._previous_scale = None if previous is None else float(previous)
        self._next_step = int(state["next_step"])
