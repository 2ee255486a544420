"""Low-bit modes for ``mixprec bench``: the model's ``nn.Linear`` layers converted to a lowbit recipe.

One mode per named recipe of :mod:`mixprec.lowbit` (``lowbit-fp8-rowwise``, ``lowbit-mxfp8``,
``lowbit-nvfp4``, ...). The rest of the model runs under ``mixprec.autocast(bf16)``. For the 4-bit
recipes the first and the last ``nn.Linear`` stay in bf16, as NVIDIA's NVFP4 recipe keeps them. On a CPU
every quantized GEMM is emulated (quantize, dequantize, float32 matmul), so the steps are slower than bf16
by design and the summary says so; the held-out metric against bf16 is the figure that counts there.
Not in any default set (ask with ``--modes lowbit-mxfp8,...``).
"""

from __future__ import annotations

import torch
from torch import nn

from mixprec.bench.modes import AutocastMode, ModeSpec, register

FOUR_BIT = ("mxfp4", "nvfp4")


class LowbitMode(AutocastMode):
    """bf16 autocast with ``nn.Linear`` layers converted by ``mixprec.lowbit.convert_to_lowbit_training``."""

    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        from mixprec.lowbit import convert_to_lowbit_training

        recipe = self.spec.options["recipe"]
        linears = [fqn for fqn, m in model.named_modules() if type(m) is nn.Linear]
        keep = {linears[0], linears[-1]} if recipe in FOUR_BIT and linears else set()
        # The swap keeps the parameter objects, so the optimizer built on the model still steps them.
        convert_to_lowbit_training(model, recipe, module_filter_fn=lambda m, fqn: fqn not in keep)
        super().prepare(model, optimizer)


def _lowbit(recipe: str, summary: str) -> ModeSpec:
    return ModeSpec(
        "lowbit-" + recipe.replace("_", "-"),
        torch.bfloat16,
        summary + " (GEMMs emulated on a CPU)",
        LowbitMode,
        ("autocast", "torch"),
        requires=("autocast",),
        options={"recipe": recipe},
    )


register(
    _lowbit("fp8_rowwise", "fp8 e4m3 per-row power-of-two scales in all three GEMMs (torchao rowwise)"),
    _lowbit("fp8_rowwise_gw_hp", "fp8 rowwise forward and input-gradient, bf16 weight-gradient GEMM"),
    _lowbit("fp8_blockwise", "fp8 1x128 activation/gradient blocks, 128x128 weight tiles (DeepSeek-V3)"),
    _lowbit("mxfp8", "MXFP8: e4m3 values, one e8m0 scale per 32 rounded up (Transformer Engine's rule)"),
    _lowbit("mxfp8_floor", "MXFP8 with the OCP floor scale rule (torchao's MX default)"),
    _lowbit("mxfp4", "MXFP4: e2m1 values, one e8m0 scale per 32; first and last Linear in bf16"),
    _lowbit("nvfp4", "NVFP4: e2m1, e4m3 scale per 16 + fp32 per tensor, 16x16 weights, SR, RHT; ends bf16"),
)
