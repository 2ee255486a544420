"""Optimizer wrappers that train low-precision weights: fp32 masters, compensated updates, low-bit states.

Two wrappers share one base, one load-state check and one guard, and each may keep Adam's moments low-bit:

* ``wrapper`` -- :class:`OptimizerWrapper` (the base both share, with what they differ in as methods),
  ``check_state_format`` (the one check of ``state_format=``), :func:`resolve_scaler` (loss-scale spec);
* ``state`` -- the checks that let ``load_state_dict`` validate everything before changing anything;
* ``guard`` -- ``HugeGradientGuard``: skips a step whose gradient square would overflow the state;
* ``masters`` -- :class:`~mixprec.MixedPrecisionOptimizer`: fp32 master weights behind a half model;
* ``compensated`` -- :class:`~mixprec.CompensatedOptimizer`: no masters, Kahan or stochastic rounding
  (``METHODS``);
* ``updates`` -- its foreach Adam, AdamW and SGD steps on the low-precision weights;
* ``fused_adam`` -- the one Adam/AdamW step engine (torch's fused kernel on cache-sized fp32 chunk copies)
  of both its bf16 moments and the low-bit states, the state format read as data;
* ``rounding`` -- the workspace, chunks, Kahan fold, widening/write-back and stochastic-rounding bits those
  updates share;
* ``state_formats`` -- how Adam's moments are stored: torch's layout, or bf16 / int8 / fp8 block codecs
  (``STATE_FORMATS``), each as the data the engine reads;
* ``sharding`` -- FSDP2 shards: each rank steps its own; :func:`full_state_dict` /
  :func:`load_full_state_dict` save on N ranks and load on M.

``state``, ``masters`` and ``compensated`` build on ``wrapper``, which builds on the steps (``updates``,
``fused_adam``), which build on ``state_formats``, ``guard``, ``rounding`` and ``sharding``;
no module imports one that builds on it, not even inside a function.

The O0-O3 levels and presets that build these wrappers live in :mod:`mixprec.amp`.
"""

from mixprec.optim.compensated import METHODS, CompensatedOptimizer
from mixprec.optim.masters import MixedPrecisionOptimizer
from mixprec.optim.sharding import full_state_dict, load_full_state_dict
from mixprec.optim.state_formats import STATE_FORMATS
from mixprec.optim.wrapper import LOW_PRECISION_DTYPES, OptimizerWrapper, resolve_scaler

__all__ = [
    "LOW_PRECISION_DTYPES",
    "METHODS",
    "STATE_FORMATS",
    "CompensatedOptimizer",
    "MixedPrecisionOptimizer",
    "OptimizerWrapper",
    "full_state_dict",
    "load_full_state_dict",
    "resolve_scaler",
]
