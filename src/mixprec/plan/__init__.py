"""`mixprec.plan`: which linear layer runs in which format, decided by measurement within a budget.

Files in the order the data flows:

* ``mixprec.plan.config``: :class:`PlanConfig`, the planner's settings checked as one value;
* ``mixprec.plan.measure``: one forward/backward with some layers swapped; each (layer, format)
  measured on demand, at most once (:class:`LayerMeasure`, :class:`Divergence`);
* ``mixprec.plan.local``: ``measure="local"``, every (layer, format) estimated from the reference pass;
* ``mixprec.plan.cost``: a format's GEMM cost for a layer, a GPU's roofline or timed here;
* ``mixprec.plan.solve``: the cheapest plan within a loss budget, the most accurate within a cost;
* ``mixprec.plan.memory``: the step's memory per component for any state/activation format, and
  the pair that fits ``max_memory``;
* ``mixprec.plan.result``: :class:`PrecisionPlan`, the value with its JSON, table, plot and ``apply``;
* ``mixprec.plan.planner``: :func:`plan_precision`, the method end to end;
* ``mixprec.plan.schedule``: :class:`Replan` and :class:`ReplanSchedule`, re-planning during training;
* ``mixprec.plan.command``: ``mixprec plan``.

It uses :mod:`mixprec.lowbit` (the formats), :mod:`mixprec.inspect` (the per-operand quantization
statistics) and nothing above them.
"""

from mixprec.plan.config import PlanConfig
from mixprec.plan.cost import TARGETS, CostFn, MeasuredCost, Target, gemm_cost, resolve_cost
from mixprec.plan.measure import Divergence, LayerMeasure, PlanLimits
from mixprec.plan.planner import plan_precision
from mixprec.plan.result import PrecisionPlan
from mixprec.plan.schedule import Replan, ReplanSchedule

__all__ = [
    "TARGETS",
    "CostFn",
    "Divergence",
    "LayerMeasure",
    "MeasuredCost",
    "PlanConfig",
    "PlanLimits",
    "PrecisionPlan",
    "Replan",
    "ReplanSchedule",
    "Target",
    "gemm_cost",
    "plan_precision",
    "resolve_cost",
]
