"""Deprecated: the fp8 scaling math's old home. It is the engine's, in :mod:`mixprec.lowbit.history`; this
module goes in the next release."""

import warnings

from mixprec.lowbit.history import (
    AMAX_GROWTH_LIMIT,
    EPS,
    amax_of,
    amax_to_scale,
    delayed_scale,
    push_amax,
    to_float8,
)

__all__ = ["AMAX_GROWTH_LIMIT", "EPS", "amax_of", "amax_to_scale", "delayed_scale", "push_amax", "to_float8"]

warnings.warn(
    f"{__name__} moved to mixprec.lowbit.history; "
    "the old module is deprecated and will be removed in the next release",
    DeprecationWarning,
    stacklevel=2,
)
