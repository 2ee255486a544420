"""mixprec: automatic mixed-precision training for PyTorch.

Public names: :func:`autocast` (an engine of its own that applies an editable :class:`Policy`),
:func:`custom_fwd` / :func:`custom_bwd`, :func:`checkpoint`, and the numeric :mod:`formats`.
"""

from mixprec import formats
from mixprec.autocast import autocast, custom_bwd, custom_fwd, get_autocast_dtype, is_autocast_enabled
from mixprec.checkpoint import checkpoint
from mixprec.policy import Policy

__version__ = "0.1.0"

__all__ = [
    "Policy",
    "__version__",
    "autocast",
    "checkpoint",
    "custom_bwd",
    "custom_fwd",
    "formats",
    "get_autocast_dtype",
    "is_autocast_enabled",
]
