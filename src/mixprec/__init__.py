"""mixprec: automatic mixed-precision training for PyTorch."""

from mixprec import formats

__version__ = "0.1.0"

__all__ = ["__version__", "formats"]
