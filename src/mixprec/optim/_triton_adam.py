"""One-pass Adam/AdamW steps of bf16 weights on CUDA: one Triton kernel launch per tensor.

:func:`mixprec.optim.fused_adam.adam_step` hands a unit here when :func:`takes` says so; the kernel
(``_triton_adam_kernels.adam``) reads the weight, its Kahan buffer, the gradient, both moments (torch's
layout: each in bf16 or fp32, ``state_formats.TorchMoments``) and the step counter on the device, and
writes weight, buffer and moments in one pass, where the chunked engine copies every chunk into fp32
workspace buffers and back around ``torch._fused_adamw_``. The fp32 math is torch's CUDA fused Adam/AdamW
kernel's (``aten/src/ATen/native/cuda/fused_adam_utils.cuh``, ``adam_math``, as torch 2.14's sm_90 code
runs it: hyperparameters rounded to fp32, ``powf`` bias corrections, correctly rounded ``/`` and ``sqrt``)::

    t = fp32(w) + fp32(c)        # kahan; else fp32(w)
    g = -g if maximize;  Adam: g = fma(t, wd, g);  AdamW: t = fma(t, -(lr * wd), t)    (wd != 0)
    m = fma(m, b1, fma(g, -b1, g));  v = fma(v, b2, fma(g*g, -b2, g*g))
    t = t - (lr / (1 - b1**step)) * m / (sqrt(v) / sqrt(1 - b2**step) + eps)
    kahan: w = rn(t), c = rn(t - w);  stochastic: w = trunc(t + 16 random bits);  nearest: w = rn(t)

so a step is bit for bit ``torch._fused_adamw_`` (``_fused_adam_``) on an fp32 copy of ``w + c`` on the
same GPU, rounded as the engine rounds. The moments are rounded to their storage dtype as the engine
rounds them. Stochastic rounding's bits come from Philox keyed by one int64 drawn per unit and step from
the optimizer's generator on the device (no host read), counted by element and tensor: unbiased as the
engine's, a different stream.

What :func:`takes`: a unit in torch's moment layout whose params are plain (not fake, not a subclass)
contiguous bf16 CUDA tensors under ``2**31`` elements with contiguous bf16 gradients (and Kahan buffers),
no amsgrad, eager mode (not compiling), Triton importable, and the environment variable
``MIXPREC_FUSED_OPTIM`` not ``0`` (read at each step; ``0`` forces the chunked engine). A CPU tensor takes it
only under Triton's interpreter (``TRITON_INTERPRET=1``), where the tests run it; there ``powf`` is torch's
on the host. Triton is imported when a kernel is first launched.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mixprec.optim.guard import grads_of
from mixprec.optim.state_formats import MOMENTS, TorchMoments

if TYPE_CHECKING:
    from mixprec.optim.fused_adam import AdamUnit

__all__ = ["BLOCK", "ENV_SWITCH", "step_unit", "takes", "triton_available"]

#: The environment variable that forces the chunked engine when set to ``0``.
ENV_SWITCH = "MIXPREC_FUSED_OPTIM"
BLOCK = 1024  # elements per program (optimi's block for large tensors)
_BF16, _F32 = torch.bfloat16, torch.float32
_PLAIN = (torch.Tensor, torch.nn.Parameter)


@functools.cache
def triton_available() -> bool:
    """Whether Triton can be imported (it ships with torch's CUDA builds)."""
    return importlib.util.find_spec("triton") is not None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _fits(t: torch.Tensor | None, device: torch.device) -> bool:
    return (
        t is not None
        and type(t) in _PLAIN
        and t.dtype == _BF16
        and t.device == device
        and t.is_contiguous()
        and t.numel() < 2**31
    )


def takes(unit: AdamUnit) -> bool:
    """Whether ``unit`` steps through the kernel (see the module doc)."""
    if not isinstance(unit.moments, TorchMoments) or os.environ.get(ENV_SWITCH, "1") == "0":
        return False
    if unit.group.get("amsgrad", False) or torch.compiler.is_compiling() or not unit.params:
        return False
    device = unit.params[0].device
    if not (device.type == "cuda" or (device.type == "cpu" and _interpreting())):
        return False
    if any(dtype not in (_BF16, _F32) for dtype in unit.moments.dtypes):
        return False
    grads = [p.grad for p in unit.params]
    kahan = list(unit.kahan) if unit.kahan is not None else []
    if not all(_fits(t, device) for t in [*unit.params, *grads, *kahan]):
        return False
    moments = [s[k] for s in unit.states for k in MOMENTS if k in s]  # a loaded state: laid out as made
    return all(m.is_contiguous() and m.device == device for m in moments) and triton_available()


def step_unit(unit: AdamUnit) -> None:
    """One step of every param of ``unit`` (:func:`takes` it; its states made and counted by the caller)."""
    group, params, moments = unit.group, unit.params, unit.moments
    assert isinstance(moments, TorchMoments)
    device = params[0].device
    kern = _kernels(_interpreting())
    rounding = 1 if unit.kahan is not None else 2 if unit.generator is not None else 0
    seed = params[0]  # an unused pointer unless stochastic
    if rounding == 2:
        assert unit.generator is not None
        seed = torch.empty(1, dtype=torch.int64, device=device).random_(generator=unit.generator)
    (beta1, beta2), wd = group["betas"], group["weight_decay"]
    decay = torch.tensor(wd, dtype=_F32).item() != 0  # torch tests the fp32 value
    consts = {
        "ADAMW": bool(group.get("decoupled_weight_decay", False)),
        "DECAY": decay,
        "MAXIMIZE": bool(group.get("maximize", False)),
        "ROUND": rounding,
        "M_BF16": moments.dtypes[0] == _BF16,
        "V_BF16": moments.dtypes[1] == _BF16,
        "PRECISE": not _interpreting(),
        "BLOCK": BLOCK,
    }
    options = {} if _interpreting() else {"enable_fp_fusion": False}  # only the kernel's explicit fmas
    kahan = [c if c is not None else p for c, p in zip(unit.kahan or params, params, strict=True)]
    with _device_of(params[0]):
        for index, (param, grad, buffer, state) in enumerate(
            zip(params, grads_of(params), kahan, unit.states, strict=True)
        ):
            step = state["step"]
            bias = step if consts["PRECISE"] else _bias_corrections(beta1, beta2, step)
            m, v = (_bits(state[key]) for key in MOMENTS)
            n = param.numel()
            kern.adam[(-(-n // BLOCK),)](
                _bits(param), _bits(buffer), _bits(grad), m, v, step, seed, bias, n, index,
                float(group["lr"]), float(beta1), float(beta2), float(group["eps"]), float(wd),
                **consts, **options,
            )  # fmt: skip


def _bias_corrections(beta1: float, beta2: float, step: torch.Tensor) -> torch.Tensor:
    """``[1 - b1**step, 1 - b2**step]`` in fp32 (torch's ``pow`` on the host): what the interpreter is
    given in place of libdevice's ``powf``."""
    betas = torch.tensor([beta1, beta2], dtype=_F32)
    return 1 - torch.pow(betas, step.to(_F32))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A bf16 tensor as its int16 bits (what the kernel reads and writes), an fp32 one as it is."""
    return t.view(torch.int16) if t.dtype == _BF16 else t


def _device_of(x: torch.Tensor) -> contextlib.AbstractContextManager:
    """The tensor's CUDA device made current: Triton launches on the current device."""
    return torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext()


@functools.cache
def _kernels(interpret: bool) -> Any:
    """The kernels module, loaded on first use, once per interpreter setting (``triton.jit`` reads
    ``TRITON_INTERPRET`` when it decorates, so each setting gets its own module)."""
    path = Path(__file__).with_name("_triton_adam_kernels.py")
    name = "mixprec.optim._triton_adam_kernels" + ("_interpreted" if interpret else "")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    try:
        sys.modules[name] = module
        spec.loader.exec_module(module)
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before
    return module
