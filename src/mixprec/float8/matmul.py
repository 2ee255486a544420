"""Deprecated: the fp8 GEMM's old names. The engine's single GEMM is :mod:`mixprec.lowbit.gemm`
(``Float8LinearFunction`` is ``LowbitLinearFunction`` there), the roles are in :mod:`mixprec.lowbit.history`;
this module goes in the next release."""

import warnings

from mixprec.lowbit.gemm import LowbitLinearFunction as Float8LinearFunction
from mixprec.lowbit.gemm import scaled_mm
from mixprec.lowbit.gemm import scaled_mm_accepts as _scaled_mm_accepts
from mixprec.lowbit.history import GRAD_OUTPUT, INPUT, WEIGHT

__all__ = ["GRAD_OUTPUT", "INPUT", "WEIGHT", "Float8LinearFunction", "_scaled_mm_accepts", "scaled_mm"]

warnings.warn(
    f"{__name__} moved to mixprec.lowbit.gemm and mixprec.lowbit.history; "
    "the old module is deprecated and will be removed in the next release",
    DeprecationWarning,
    stacklevel=2,
)
