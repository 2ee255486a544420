"""fp8 modes for ``mixprec bench``: the model's ``nn.Linear`` layers swapped for ``Float8Linear``.

The rest of the model runs under ``mixprec.autocast(bf16)``, as a user of fp8 training would run it.
On a CPU ``torch._scaled_mm`` emulates fp8, so these steps are slower than bf16 there: the figure that
counts on a CPU is the held-out loss against bf16; on a Hopper GPU the speed is real. Not in the CPU
defaults for that reason (ask for them with ``--modes fp8-dynamic,fp8-delayed``).
"""

from __future__ import annotations

import torch
from torch import nn

from mixprec.bench.modes import AutocastMode, ModeSpec, register


class Float8Mode(AutocastMode):
    """bf16 autocast with every ``nn.Linear`` converted by ``mixprec.float8.convert_to_float8_training``."""

    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        from mixprec.float8 import Float8Config, convert_to_float8_training

        config = Float8Config(scaling=self.spec.options["scaling"])
        # The swap keeps the parameter objects, so the optimizer built on the model still steps them.
        convert_to_float8_training(model, config=config)
        super().prepare(model, optimizer)


def _fp8(name: str, scaling: str, summary: str) -> ModeSpec:
    return ModeSpec(
        name,
        torch.bfloat16,
        summary,
        Float8Mode,
        ("autocast", "torch"),
        requires=("autocast",),
        options={"scaling": scaling},
    )


register(
    _fp8("fp8-dynamic", "dynamic", "fp8 Linear layers, scale from each tensor's amax (torchao's recipe)"),
    _fp8("fp8-delayed", "delayed", "fp8 Linear layers, scale from an amax history (Transformer Engine's)"),
)
