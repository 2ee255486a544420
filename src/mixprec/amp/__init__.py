"""Automatic mixed precision by level: apex's O0-O3 and the Lightning/Accelerate presets, as one table.

* ``levels`` -- ``OPT_LEVELS`` and ``PRESETS`` as data, :func:`resolve_level` and
  :func:`~mixprec.initialize`, which casts the model, wraps the optimizer (:mod:`mixprec.optim`) and
  casts inputs and outputs per level;
* ``casting`` -- :func:`cast_model`: the O2/O3 cast, all or nothing, BatchNorm kept fp32 where asked.

:mod:`mixprec.apex` gives these apex's own names.
"""

from mixprec.amp.casting import KEPT_FP32, cast_model
from mixprec.amp.levels import OPT_LEVELS, PRESETS, OptLevel, PrecisionForward, initialize, resolve_level

__all__ = [
    "KEPT_FP32",
    "OPT_LEVELS",
    "PRESETS",
    "OptLevel",
    "PrecisionForward",
    "cast_model",
    "initialize",
    "resolve_level",
]
