"""`mixprec.lowbit`: block-scaled low-bit training, with one scale per block of a tensor.

* formats as data (``mixprec.lowbit.formats``): fp8 tensorwise / rowwise / 1x128 / 128x128, MXFP8,
  MXFP4, NVFP4 (:data:`FORMATS`), and user formats built from an element format, a scale format, a block
  shape and a scale rule;
* :func:`quantize` returns a :class:`Quantized` (data, scales, ``.dequantize(dtype)``), bit for bit
  torchao 0.18's pure-PyTorch references, with nearest or stochastic rounding;
* recipes per GEMM operand (:class:`Recipe`, :data:`RECIPES`): which format quantizes which operand of the
  forward, input-gradient and weight-gradient GEMMs, as Transformer Engine's and torchao's recipes, and
  whether tensorwise operands are scaled once per tensor (:class:`~mixprec.lowbit.history.TensorScaling`,
  dynamic or delayed): the one configuration the engine runs (``mixprec.float8.Float8Config`` builds one);
* :func:`convert_to_lowbit_training` swaps ``nn.Linear`` for :class:`LowbitLinear` (torchao's
  ``module_filter_fn(module, fqn) -> bool`` contract). GEMMs are emulated on a CPU (dequantize, float32
  matmul); on CUDA each GEMM runs on the tensor-core kernel the device has (fp8 tensorwise / rowwise from
  sm89, fp8 blockwise on sm90, MXFP8 / MXFP4 / NVFP4 on sm100; ``mixprec.lowbit.kernels``), else
  emulated;
  :func:`sr_state_dict` / :func:`load_sr_state_dict` save and restore the stochastic-rounding draws;
* :func:`auto_filter` is a ``module_filter_fn`` that keeps out the layers too small to gain from a recipe
  at a run's ``tokens_per_step``, by the planner's roofline (``mixprec.lowbit.cost``).
* :class:`save_activations` keeps the tensors autograd saves for backward in fp8 or mxfp8
  (``mixprec.lowbit.activations``).

Example::

    from mixprec import lowbit
    lowbit.convert_to_lowbit_training(model, "nvfp4", module_filter_fn=lambda m, fqn: fqn != "head")
    q = lowbit.quantize(x, "mxfp8_rceil")    # q.data float8_e4m3fn, q.scale float8_e8m0fnu (M, K // 32)
    err = (q.dequantize() - x).abs().max()
"""

from mixprec.lowbit.activations import save_activations
from mixprec.lowbit.convert import (
    ModuleFilter,
    convert_to_lowbit_training,
    load_sr_state_dict,
    lowbit_linears,
    sr_state_dict,
)
from mixprec.lowbit.cost import auto_filter
from mixprec.lowbit.formats import FORMATS, LowbitFormat, ScaleRounding, get_format
from mixprec.lowbit.gemm import hadamard_16, lowbit_mm
from mixprec.lowbit.history import TensorScaling
from mixprec.lowbit.linear import LowbitConv1D, LowbitLinear
from mixprec.lowbit.quantize import Quantized, quantize, quantize_pair, round_to_element
from mixprec.lowbit.recipes import HP, OPERANDS, RECIPES, Recipe, get_recipe

__all__ = [
    "FORMATS",
    "HP",
    "OPERANDS",
    "RECIPES",
    "LowbitConv1D",
    "LowbitFormat",
    "LowbitLinear",
    "ModuleFilter",
    "Quantized",
    "Recipe",
    "ScaleRounding",
    "TensorScaling",
    "auto_filter",
    "convert_to_lowbit_training",
    "get_format",
    "get_recipe",
    "hadamard_16",
    "load_sr_state_dict",
    "lowbit_linears",
    "lowbit_mm",
    "quantize",
    "quantize_pair",
    "round_to_element",
    "save_activations",
    "sr_state_dict",
]
