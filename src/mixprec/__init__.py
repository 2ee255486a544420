"""mixprec: automatic mixed-precision training for PyTorch.

Public names: :class:`autocast` (an engine of its own that applies an editable :class:`Policy`),
:func:`custom_fwd` / :func:`custom_bwd`, :func:`checkpoint`, :class:`GradScaler` and its scale rules,
:class:`MixedPrecisionOptimizer` (fp32 master weights), :func:`initialize` (apex-style opt levels and
Lightning-style presets), :class:`CompensatedOptimizer` (pure-bf16 training with Kahan summation or
stochastic rounding), the numeric :mod:`~mixprec.formats`, and low-bit training (:mod:`~mixprec.float8`
per tensor, :mod:`~mixprec.lowbit` block-scaled: fp8 rowwise/blockwise, MXFP8, MXFP4, NVFP4).
Diagnostics live in :mod:`mixprec.inspect`.
"""

from mixprec import distributed, float8, formats, lowbit
from mixprec.amp import OPT_LEVELS, PRESETS, initialize
from mixprec.autocast import autocast, get_autocast_dtype, is_autocast_enabled
from mixprec.autocast.checkpoint import autocast_context_fn, checkpoint
from mixprec.autocast.custom_function import custom_bwd, custom_fwd
from mixprec.optim import CompensatedOptimizer, MixedPrecisionOptimizer
from mixprec.policy import Policy
from mixprec.scaling import DynamicScale, GradScaler, HeadroomScale, NoScale, StaticScale

__version__ = "0.1.0"

__all__ = [
    "OPT_LEVELS",
    "PRESETS",
    "CompensatedOptimizer",
    "DynamicScale",
    "GradScaler",
    "HeadroomScale",
    "MixedPrecisionOptimizer",
    "NoScale",
    "Policy",
    "StaticScale",
    "__version__",
    "autocast",
    "autocast_context_fn",
    "checkpoint",
    "custom_bwd",
    "custom_fwd",
    "distributed",
    "float8",
    "formats",
    "get_autocast_dtype",
    "initialize",
    "is_autocast_enabled",
    "lowbit",
]
