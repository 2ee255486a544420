"""Lightning Fabric: ``MixprecPrecision``, a precision plugin for ``lightning.fabric.Fabric``.

Usage::

    import lightning as L
    from mixprec.integrations.fabric import MixprecPrecision

    policy = mixprec.Policy.preset("16-mixed").with_modules({"head": torch.float32})
    fabric = L.Fabric(accelerator="cpu", plugins=[MixprecPrecision("16-mixed", policy=policy)])
    model, optimizer = fabric.setup(model, optimizer)
    loss = model(x).sum()          # the forward runs under mixprec.autocast
    fabric.backward(loss)          # scaled by the mixprec GradScaler
    optimizer.step()               # unscaled, stepped or skipped, the scale updated

The hooks are those of Fabric's own ``MixedPrecision`` (forward context, input and output conversion,
backward, optimizer step, unscaling for clipping, the scaler's state), so with the default
policy a run equals Fabric's ``precision="bf16-mixed"`` bitwise. The Trainer's plugin is
:class:`mixprec.integrations.lightning.MixprecPrecision`: the Trainer refuses this one, and that one raises
a TypeError naming this one at Fabric's first backward. ``fabric.save`` keeps only the objects it is
given: put the plugin in its state (``{"model": model, "optimizer": optimizer, "precision": plugin}``,
likewise for ``fabric.load``) to resume with the scaler. Needs ``pip install 'mixprec[lightning]'``.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Literal

import torch
from torch import nn

try:
    from lightning.fabric.plugins.precision import Precision
    from lightning.fabric.plugins.precision.amp import _optimizer_handles_unscaling
    from lightning.fabric.plugins.precision.utils import _convert_fp_tensor
    from lightning_utilities.core.apply_func import apply_to_collection
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "mixprec.integrations.fabric needs Lightning (the 'lightning' package): "
        "pip install 'mixprec[lightning]'"
    ) from error

from mixprec import autocast
from mixprec.integrations._common import settings
from mixprec.policy import Policy
from mixprec.scaling import GradScaler

__all__ = ["MixprecPrecision"]

_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


class MixprecPrecision(Precision):
    """Fabric precision plugin running mixprec's engine, policy and scaler.

    Args:
        precision: ``"bf16-mixed"`` or ``"16-mixed"`` (the region's dtype, and the dtype floating inputs are
            converted to, as Fabric's own plugin does; a policy with a compute dtype must agree).
        policy: a :class:`mixprec.Policy` or policy string; default: the device's default policy.
        scaler: a :class:`mixprec.GradScaler`; default: a new one for ``"16-mixed"``, none for
            ``"bf16-mixed"`` (pass one to count skipped steps in bf16 too).
        device: the autocast device type; default: ``"cuda"`` when CUDA is available, else ``"cpu"``.

    Attributes:
        scaler: the GradScaler, or None.
        last_step_skipped: whether the last optimizer step was skipped (the caller's LR scheduler is not
            stepped by Fabric: hold it yourself on a skip, as Fabric's own "16-mixed" leaves it to you).

    Raises:
        ValueError: for another precision string, a policy whose compute dtype contradicts it, or a device
            mixprec.autocast refuses.
        TypeError: for a scaler that is not a mixprec.GradScaler, or a bad policy.
    """

    def __init__(
        self,
        precision: Literal["bf16-mixed", "16-mixed"] = "bf16-mixed",
        *,
        policy: Policy | str | None = None,
        scaler: GradScaler | None = None,
        device: str | torch.device | None = None,
    ) -> None:
        if precision not in _DTYPES:
            raise ValueError(f"precision must be 'bf16-mixed' or '16-mixed', got {precision!r}")
        policy, dtype, scaler = settings(policy, scaler, None, _DTYPES[precision], f"precision={precision!r}")
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        autocast(str(device), dtype=dtype, policy=policy)  # validates device and dtype now
        self.precision = precision  # type: ignore[assignment]
        self.policy, self.dtype, self.scaler = policy, dtype, scaler
        self.device = str(device)
        self.last_step_skipped = False

    def region(self) -> autocast:
        """A new :class:`mixprec.autocast` for this plugin's device, dtype and policy."""
        return autocast(self.device, dtype=self.dtype, policy=self.policy)

    def forward_context(self) -> AbstractContextManager:
        return self.region()

    def convert_input(self, data: Any) -> Any:
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=torch.Tensor, dst_type=self.dtype)

    def convert_output(self, data: Any) -> Any:
        default = torch.get_default_dtype()
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=torch.Tensor, dst_type=default)

    def backward(self, tensor: torch.Tensor, model: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        super().backward(tensor, model, *args, **kwargs)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        """Unscale (unless done for clipping), step or skip, update the scale."""
        if self.scaler is None:
            return super().optimizer_step(optimizer, **kwargs)
        if isinstance(optimizer, torch.optim.LBFGS):
            raise TypeError("mixprec's loss scaling does not work with LBFGS (its closure re-runs backward)")
        step_output = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        self.last_step_skipped = self.scaler.last_step_skipped
        return step_output

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale for ``fabric.clip_gradients``; refused for optimizers that unscale inside their step."""
        if self.scaler is None:
            return
        if _optimizer_handles_unscaling(optimizer):
            raise NotImplementedError(
                f"{type(optimizer).__qualname__} unscales inside its step (a fused optimizer), so its "
                "gradients cannot be clipped before the step"
            )
        self.scaler.unscale_(optimizer)

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state (torch's keys plus mixprec's counters); empty without a scaler."""
        return {} if self.scaler is None else self.scaler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the scaler from :meth:`state_dict`."""
        if self.scaler is not None:
            self.scaler.load_state_dict(state_dict)
