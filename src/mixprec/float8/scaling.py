"""The fp8 scaling math's old home: it is the engine's, in :mod:`mixprec.lowbit.history`."""

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
