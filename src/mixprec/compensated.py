"""Compatibility path: :mod:`mixprec.master.compensated` holds :class:`CompensatedOptimizer`."""

from mixprec.master.compensated import METHODS, CompensatedOptimizer

__all__ = ["METHODS", "CompensatedOptimizer"]
