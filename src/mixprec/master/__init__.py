"""fp32 master weights, compensated pure low-precision updates and the O0-O3 recipes.

``optimizer`` (:class:`~mixprec.MixedPrecisionOptimizer`: masters and loss scaling), ``compensated``
(:class:`~mixprec.CompensatedOptimizer`: Kahan / stochastic rounding without masters), ``updates`` (its
foreach Adam, AdamW and SGD), ``recipes`` (:func:`~mixprec.initialize`, opt levels and presets),
``casting`` (the model cast), ``state`` (state-dict validation), ``sharding``
(FSDP2 shards; the whole state saved on N ranks, loaded on M), ``wrapper`` (the shared base class and
loss-scale specs).
"""

from mixprec.master.optimizer import MixedPrecisionOptimizer
from mixprec.master.sharding import full_state_dict, load_full_state_dict
from mixprec.master.wrapper import LOW_PRECISION_DTYPES, OptimizerWrapper, resolve_scaler

__all__ = [
    "LOW_PRECISION_DTYPES",
    "MixedPrecisionOptimizer",
    "OptimizerWrapper",
    "full_state_dict",
    "load_full_state_dict",
    "resolve_scaler",
]
