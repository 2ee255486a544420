"""`mixprec.inspect`: where precision is lost.

* :func:`find_nonfinite`: the first module and op (forward or backward) whose result was inf/nan;
* :func:`underflow_report`: the fraction of gradients that would be zero or subnormal at a loss scale,
  per module, and the scale that avoids it;
* :func:`trace_dtypes`: which ops ran in which dtype, per module;
* :func:`fp8_report`: per ``nn.Linear``, what fp8 (e4m3 forward, e5m2 gradients) would lose: amax,
  scale, underflow and saturation, and the layers to keep in bf16 as a ready ``module_filter_fn``;
  :func:`lowbit_report` does the same for any :mod:`mixprec.lowbit` recipe, per GEMM operand and block;
* :class:`ScalerLog`, :func:`nonfinite_params`, :func:`grad_amax`: an opt-in per-step scaler log and the
  parameters behind a skipped step;
* :func:`plot_gradient_histogram`, :func:`plot_scale_history`, :func:`plot_underflow`, :func:`write_report`:
  pictures and a run log's report (bench's files are :func:`mixprec.bench.write_report`'s, behind
  ``mixprec report``).

Nothing here is hooked or active unless one of these runs. The precision planner is :mod:`mixprec.plan`.
"""

from mixprec.inspect.fp8 import Fp8Report, fp8_report, plot_fp8_report
from mixprec.inspect.grads import grad_amax, nonfinite_params
from mixprec.inspect.lowbit import LowbitReport, lowbit_report
from mixprec.inspect.nonfinite import find_nonfinite
from mixprec.inspect.nonfinite_report import NonfiniteReport
from mixprec.inspect.plots import plot_gradient_histogram, plot_scale_history, plot_underflow
from mixprec.inspect.report import load_log, write_report
from mixprec.inspect.scaler_log import ScalerLog
from mixprec.inspect.summaries import GradStats, Log2Histogram
from mixprec.inspect.trace import DtypeTrace, trace_dtypes
from mixprec.inspect.underflow import underflow_report
from mixprec.inspect.underflow_report import UnderflowReport

__all__ = [
    "DtypeTrace",
    "Fp8Report",
    "GradStats",
    "Log2Histogram",
    "LowbitReport",
    "NonfiniteReport",
    "ScalerLog",
    "UnderflowReport",
    "find_nonfinite",
    "fp8_report",
    "grad_amax",
    "load_log",
    "lowbit_report",
    "nonfinite_params",
    "plot_fp8_report",
    "plot_gradient_histogram",
    "plot_scale_history",
    "plot_underflow",
    "trace_dtypes",
    "underflow_report",
    "write_report",
]
