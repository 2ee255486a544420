"""`NonfiniteReport`: where a non-finite value first appeared, and what to do about it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mixprec import formats
from mixprec.inspect._modules import OUTSIDE, display_name

__all__ = ["NonfiniteReport"]


@dataclass(frozen=True)
class NonfiniteReport:
    """The first place a non-finite value appeared; ``str(report)`` is one sentence with a suggestion.

    Attributes:
        module: qualified name as in ``model.named_modules()`` ("" is the root module), or
            ``"(outside the model)"`` for ops in ``loss_fn``.
        phase: "forward" or "backward".
        op: the op's name ("linear", "__matmul__", ...); in backward, the forward op whose gradient it is.
        dtype: dtype of the non-finite result.
        value: "inf" or "nan".
        input_range: (min, max) over the finite values of the op's inputs (in backward: of the
            gradients flowing into it), or None when it had no finite floating input.
        inputs_finite: whether all of those inputs were finite.
        finite_in_fp32: forward only: whether the same op on the same inputs is finite in float32
            (None where it was not re-run, e.g. in-place ops).
        node: backward only: the autograd node that produced the first non-finite gradient.
        state: the parameter that already held inf/nan, or buffer that held nan, before anything ran
            (qualified name; ``op`` is ``"parameter"`` or ``"buffer"``, ``module`` its owner): the model's
            state is broken, an earlier step wrote it, and nothing was run (None otherwise).
    """

    module: str
    phase: str
    op: str
    dtype: torch.dtype
    value: str
    input_range: tuple[float, float] | None
    inputs_finite: bool
    finite_in_fp32: bool | None = None
    node: str | None = None
    state: str | None = None

    @property
    def input_absmax(self) -> float | None:
        """The largest finite input magnitude."""
        return None if self.input_range is None else max(abs(self.input_range[0]), abs(self.input_range[1]))

    def __str__(self) -> str:
        if self.state is not None:
            return (
                f"The model's {self.op} '{self.state}' already held {self.value} before the run, so no op "
                "of this run is the cause: an earlier step wrote it (the weights diverged); inspect a "
                "checkpoint from before, and log the steps with mixprec.inspect.ScalerLog to find the step."
            )
        if self.phase == "forward" and not self.inputs_finite:
            return (
                f"Forward: the inputs of {self.op} in {_where(self.module)} already held inf/nan, so the "
                "data fed to the model is not finite; check the inputs and preprocessing, not precision."
            )
        if self.phase == "forward" and self.finite_in_fp32 is False:
            return (
                f"Forward: {self._produced()}, and it does so in float32 too, so this is not a precision "
                "problem; check that op's inputs (values this large, log or sqrt of negatives, 0 / 0)."
            )
        if self.phase == "forward":
            hint = _pin_hint(self.module)
            if self.module != OUTSIDE:
                hint += ", or rescale its inputs or weights"
            return f"Forward: {self._produced()}{self._limit()}; {hint}."
        if self.node is not None and self.node.startswith("ToCopyBackward"):
            return (
                f"Backward: the gradient leaving {self.op} in {_where(self.module)} became {self.value} when "
                f"cast to {_dtype_name(self.dtype)} ({self.node}; |grad| up to {self.input_absmax or 0:.4g} "
                f"before the cast){self._limit()}; lower the loss scale, or pin the modules before it too."
            )
        return (
            f"Backward: {self._produced()}{self._limit()}; lower the loss scale (a dynamic scaler backs off "
            f"by itself; start lower if it recurs), or {_pin_hint(self.module)}."
        )

    def _produced(self) -> str:
        if self.phase == "forward":
            prefix, node, incoming, symbol = "", "", "inputs", "|x|"
        else:
            prefix, incoming, symbol = "the backward of ", "incoming gradients", "|grad|"
            node = f" ({self.node})" if self.node else ""
        magnitude = "" if self.input_absmax is None else f" ({symbol} up to {self.input_absmax:.4g})"
        return (
            f"{prefix}{self.op} in {_where(self.module)}{node} produced {self.value} in "
            f"{_dtype_name(self.dtype)} from finite {incoming}{magnitude}"
        )

    def _limit(self) -> str:
        try:
            fmt = formats.get(self.dtype)
        except ValueError:
            return ""
        if self.value == "inf":
            return f", beyond {fmt.name}'s largest finite value {fmt.max:g}"
        return (
            f", most likely from an intermediate overflow past {fmt.name}'s {fmt.max:g} (inf - inf, 0 * inf)"
        )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _where(module: str) -> str:
    return module if module == OUTSIDE else f"module '{display_name(module)}'"


def _pin_hint(module: str) -> str:
    if module == OUTSIDE:
        return "compute the loss in float32 (call .float() on the model's output first)"
    return f"pin the module to fp32: policy.with_modules({{{module!r}: torch.float32}})"
