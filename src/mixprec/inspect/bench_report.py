"""Deprecated: the bench's report functions moved to :mod:`mixprec.bench.plots` (``plot_bench_records``,
``plot_bench_log``) and :mod:`mixprec.bench.report` (``bench_summary``), which own the bench's records.

The names stay importable from here for one release, with a DeprecationWarning; bench is imported only when
one is asked for, so inspect does not import bench.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

__all__: list[str] = []  # the moved names resolve through __getattr__, with the warning

_MOVED = {
    "bench_summary": "mixprec.bench.report",
    "plot_bench_log": "mixprec.bench.plots",
    "plot_bench_records": "mixprec.bench.plots",
}


def __getattr__(name: str) -> Any:
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        f"mixprec.inspect.bench_report.{name} moved to {_MOVED[name]}.{name}; import it from there "
        "(this alias goes in the next release)",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(_MOVED[name]), name)
