"""Compatibility path: :mod:`mixprec.master.recipes` holds :func:`initialize`, the opt levels and presets."""

from mixprec.master.casting import cast_model
from mixprec.master.recipes import (
    OPT_LEVELS,
    OVERRIDES,
    PRESETS,
    OptLevel,
    PrecisionForward,
    initialize,
    resolve_level,
)

__all__ = [
    "OPT_LEVELS",
    "OVERRIDES",
    "PRESETS",
    "OptLevel",
    "PrecisionForward",
    "cast_model",
    "initialize",
    "resolve_level",
]
