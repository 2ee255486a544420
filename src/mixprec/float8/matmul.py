"""The fp8 GEMM's old names: the engine's single GEMM is :mod:`mixprec.lowbit.gemm`."""

from mixprec.lowbit.gemm import LowbitLinearFunction as Float8LinearFunction
from mixprec.lowbit.gemm import scaled_mm
from mixprec.lowbit.gemm import scaled_mm_accepts as _scaled_mm_accepts
from mixprec.lowbit.history import GRAD_OUTPUT, INPUT, WEIGHT

__all__ = ["GRAD_OUTPUT", "INPUT", "WEIGHT", "Float8LinearFunction", "_scaled_mm_accepts", "scaled_mm"]
