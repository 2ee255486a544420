"""fp32 master weights, compensated pure low-precision updates and the O0-O3 recipes.

``optimizer`` (:class:`MixedPrecisionOptimizer`: masters and loss scaling), ``compensated``
(:class:`CompensatedOptimizer`: Kahan / stochastic rounding without masters), ``updates`` (its foreach Adam,
AdamW and SGD), ``recipes`` (:func:`initialize`, opt levels and presets), ``casting`` (the model cast),
``state`` (state-dict validation), ``wrapper`` (the shared base class and loss-scale specs).
"""

from mixprec.optim.masters import MixedPrecisionOptimizer
from mixprec.optim.wrapper import LOW_PRECISION_DTYPES, OptimizerWrapper, resolve_scaler

__all__ = ["LOW_PRECISION_DTYPES", "MixedPrecisionOptimizer", "OptimizerWrapper", "resolve_scaler"]
