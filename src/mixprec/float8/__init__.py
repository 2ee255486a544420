"""`mixprec.float8`: fp8 training by module swap, dynamic or delayed (amax history) scaling.

* :func:`convert_to_float8_training` swaps ``nn.Linear`` for :class:`Float8Linear` (torchao's name and
  ``module_filter_fn(module, fqn) -> bool`` contract);
* :class:`Float8Config` (alias ``Float8LinearConfig``) picks the recipe: ``"dynamic"`` (scale from the
  tensor's own amax, as torchao) or ``"delayed"`` (Transformer Engine: scale from an amax history kept in
  buffers); torchao's per-operand :class:`CastConfig` (``ScalingType.DISABLED`` keeps an operand in high
  precision, ``ScalingGranularity.AXISWISE`` scales per row) and per-GEMM :class:`Float8GemmConfig`;
* :func:`sync_float8_amax_history` agrees the delayed amaxes across data-parallel ranks in one all-reduce;
* ``Float8Config(enable_fsdp_float8_all_gather=True)``: FSDP2 all-gathers the weights in fp8, and
  :func:`precompute_float8_dynamic_scale_for_fsdp` computes all their scales in one all-reduce
  (``mixprec.float8.fsdp``);
* the matmuls run in ``torch._scaled_mm`` (CPU with torch >= 2.13: an exact emulation, slower than bf16;
  Hopper-class GPUs: real fp8 tensor cores).

Example::

    from mixprec.float8 import Float8Config, convert_to_float8_training
    convert_to_float8_training(model, config=Float8Config(scaling="delayed"),
                               module_filter_fn=lambda m, fqn: fqn != "head")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = loss_fn(model(x), y)
    loss.backward()

The per-layer fp8 diagnostics are :func:`mixprec.inspect.fp8_report`.
"""

from mixprec.float8.config import (
    CastConfig,
    Float8Config,
    Float8GemmConfig,
    Float8LinearConfig,
    Float8UsageError,
    LinearMMConfig,
    ScaledMMConfig,
    ScalingGranularity,
    ScalingType,
)
from mixprec.float8.convert import (
    ModuleFilter,
    convert_to_float8_training,
    float8_linears,
    skip_fqns,
    sync_float8_amax_history,
)
from mixprec.float8.fsdp import precompute_float8_dynamic_scale_for_fsdp
from mixprec.float8.linear import Float8Conv1D, Float8Linear
from mixprec.lowbit.gemm import scaled_mm

__all__ = [
    "CastConfig",
    "Float8Config",
    "Float8Conv1D",
    "Float8GemmConfig",
    "Float8Linear",
    "Float8LinearConfig",
    "Float8UsageError",
    "LinearMMConfig",
    "ModuleFilter",
    "ScaledMMConfig",
    "ScalingGranularity",
    "ScalingType",
    "convert_to_float8_training",
    "float8_linears",
    "precompute_float8_dynamic_scale_for_fsdp",
    "scaled_mm",
    "skip_fqns",
    "sync_float8_amax_history",
]
