"""The planner's one-pass estimates (``plan_precision(..., measure="local")``): every (layer, format)
estimated from the reference pass alone, with no further pass through the model.

The reference pass keeps, for every planning batch, each linear's input ``x``, output ``y`` and output
gradient ``g_y = dL/dy``. Per (layer, format) only that layer runs, in the format (the module
:func:`~mixprec.plan.measure.swapped_in` builds), forward on the kept ``x`` and backward with the
kept ``g_y``; with ``dy = y_q - y`` over batch ``b``:

* loss divergence ``sum_b |dL_b| / sum_b |L_ref_b|`` (the exact mode's definition), with ``dL_b`` the
  first-order Taylor change ``<g_y, dy>`` (Molchanov et al., "Importance Estimation for Neural Network
  Pruning", CVPR 2019). The second-order term ``0.5 dy^T H dy``, with ``H`` the empirical Fisher of the
  rows of ``y`` (``0.5 R sum_r <g_r, dy_r>^2`` for a loss that is the mean over the ``R`` rows), is
  recorded beside it (``loss_first_order``, ``loss_second_order``) but does not steer the plan: its
  rows-are-independent Fisher overstates layers whose rows mix (attention), see the fidelity figures in
  docs/guide/planner.md;
* weight-gradient divergence: the layer's own weight gradient's change (summed over batches) over the
  norm of all linears' reference weight gradients. Left out: how the changed output moves the other
  layers' weight gradients (exact mode measures every linear's change);
* input-gradient divergence: the layer's input gradient's change against its reference, as exact.

A layer called more than once per batch is estimated at its first call (as the exact mode records it).
The estimates only steer the knapsack: the whole plan is still measured exactly and tightened. Because
the weight-gradient estimate leaves the other layers out it undercounts, so when a whole plan measures
over ``grad_budget`` the planner calls :meth:`LocalMeasurer.switch_to_exact` and goes on with exact
per-layer measurements (tightening against the estimates instead can leave a plan below bf16's accuracy).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mixprec.plan.measure import NONFINITE, Divergence, Kept, Measurer, swapped_in


class LocalMeasurer(Measurer):
    """A :class:`~mixprec.plan.measure.Measurer` whose divergences are one-layer estimates on the
    reference pass's kept operands (``ref.kept``, from ``PassRunner.run(..., keep=True)``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._references: dict[str, list[tuple[torch.Tensor, torch.Tensor | None]]] = {}
        self._loss_total = sum(abs(loss) for loss in self.ref.losses)
        self._grad_total = sum(float(g.square().sum()) for g in self.ref.weight_grads)
        self.exact = False  # set by switch_to_exact: one pass per layer and format from then on

    def switch_to_exact(self) -> bool:
        """From now on measure exactly (one pass per layer and format), and re-measure every estimate
        made so far; False if already switched."""
        if self.exact:
            return False
        self.exact = True
        for fqn, info in self.layers.items():
            for fmt, d in list(info.divergence.items()):
                if d.loss is not None and fmt != "fp32":  # ruled out without a pass: stays so
                    del info.divergence[fmt]
                    self.measure(fqn, fmt)
        return True

    def _divergences(self, fqn: str, fmt: str) -> Divergence:
        if self.exact or not self._kept(fqn):  # no output gradient kept (a frozen first layer): a pass
            return super()._divergences(fqn, fmt)
        tiny = torch.finfo(torch.float32).tiny
        linear = self.runner.slots.originals[fqn]
        module = swapped_in(linear, fmt, self.runner.generator)
        first = second = 0.0
        weight_delta = None
        gx_num = gx_den = 0.0
        for kept, (gw_ref, gx_ref) in zip(self._kept(fqn), self._reference(fqn), strict=True):
            y_q, gw, gx = _layer_pass(module, linear.weight, kept)
            if not torch.isfinite(y_q).all():
                return NONFINITE
            t1, t2 = taylor(kept.grad_y, y_q - kept.y)
            first += abs(t1)
            second += abs(t1 + t2)
            change = (gw - gw_ref).float()
            weight_delta = change if weight_delta is None else weight_delta + change
            if gx is not None and gx_ref is not None:
                gx_num += float((gx - gx_ref).float().square().sum())
                gx_den += float(gx_ref.float().square().sum())
        den = max(self._loss_total, tiny)
        num = 0.0 if weight_delta is None else float(weight_delta.square().sum())
        return Divergence(
            loss=first / den,  # first order only: the second-order term is recorded, not used (module doc)
            weight_grad=(num / max(self._grad_total, tiny)) ** 0.5,
            input_grad=(gx_num / max(gx_den, tiny)) ** 0.5 if gx_den > 0 else None,
            loss_first_order=first / den,
            loss_second_order=second / den,
        )

    def _kept(self, fqn: str) -> list[Kept]:
        return [batch[fqn] for batch in self.ref.kept if fqn in batch]

    def _reference(self, fqn: str) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Per batch, the layer's own weight and input gradients at its own precision (computed once)."""
        if fqn not in self._references:
            linear = self.runner.slots.originals[fqn]
            self._references[fqn] = [_layer_pass(linear, linear.weight, kept)[1:] for kept in self._kept(fqn)]
        return self._references[fqn]


def taylor(gy: torch.Tensor, dy: torch.Tensor) -> tuple[float, float]:
    """``(<g_y, dy>, 0.5 R sum_r <g_r, dy_r>^2)``: the first-order loss change and the empirical-Fisher
    second-order term over the ``R`` rows of ``g_y`` and ``dy`` (same shape, last dim the features)."""
    g = gy.detach().reshape(-1, gy.shape[-1]).double()
    d = dy.detach().reshape(-1, dy.shape[-1]).double()
    per_row = (g * d).sum(1)
    return float(per_row.sum()), float(0.5 * per_row.numel() * per_row.square().sum())


def _layer_pass(
    module: nn.Module, weight: torch.Tensor, kept: Kept
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``module`` forward on the kept input and backward with the kept output gradient: (output, weight
    gradient, input gradient or None when the input needs none)."""
    x = kept.x.detach().requires_grad_(kept.x_requires_grad)
    with torch.enable_grad():
        y = module(x)
        targets = [weight] if weight.requires_grad else []  # a frozen weight has no gradient
        targets += [x] if kept.x_requires_grad else []
        grads = list(torch.autograd.grad(y, targets, kept.grad_y, allow_unused=True)) if targets else []
    gw = grads.pop(0) if weight.requires_grad else None
    gw = torch.zeros_like(weight) if gw is None else gw
    return y.detach(), gw, grads[0] if kept.x_requires_grad else None
