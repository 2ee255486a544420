"""One-pass Adam/AdamW steps of bf16 (and fp32) weights on CUDA: one Triton kernel launch per tensor.

:func:`mixprec.optim.fused_adam.adam_step` hands a unit here when :func:`takes` says so; the kernel
(``_triton_adam_kernels.adam``) reads the weight, its Kahan buffer, the gradient, both moments (torch's
layout: each in bf16 or fp32, ``state_formats.TorchMoments``; a ``"bf16"`` state format is that layout in
bf16) and the step counter on the device, and writes weight, buffer and moments in one pass, where the
chunked engine copies every chunk into fp32 workspace buffers and back around ``torch._fused_adamw_``.
The fp32 math is torch's CUDA fused Adam/AdamW kernel's (``aten/src/ATen/native/cuda/fused_adam_utils.cuh``,
``adam_math``, as torch 2.14's sm_90 code runs it: hyperparameters rounded to fp32, ``powf`` bias
corrections, correctly rounded ``/`` and ``sqrt``)::

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

Block-coded moments (``state_format="int8"`` / ``"fp8"``, ``state_formats.CodedMoments``) go to
``_triton_adam_kernels.adam_coded``, one launch per tensor (per run of its block grid where a resharded
state restarts it at ``block_origins``): a program owns ``ROWS`` whole blocks of ``state_formats.BLOCK``
values and does what the chunked engine's decode, kernel and encode do, in their order::

    m = table[code] * scale            # int8: the dynamic map; fp8: e4m3's values; fp8's v: (.)**2
    (the step above)
    fp8's v: sqrt_rn(v);  s = max(absmax(block), 1e-12)    # int8: s;  fp8: s / 448
    code = bucketize(x / s, midpoints, right=True)         # int8: 8 probes; fp8: torch's e4m3 cast

with the scale of fp8 as each device's torch computes ``amax / 448.0``: a CUDA tensor divided by a
Python number is multiplied by the fp32 reciprocal (ATen's ``div_true_kernel_cuda``), a CPU one divided.
The e4m3 cast is integer arithmetic (c10's rounding, saturating as torch 2.14's cast), so the
interpreter, whose own fp8 cast is wrong at binade edges, runs the same code. The codes and scales are
then bit for bit the engine's on the same device, the weights and Kahan buffers too, where the engine's
fp32 ``sqrt`` is correctly rounded (CUDA's; torch's CPU one is not: the tests give the engine a correctly
rounded one); ``benchmarks/optimizer_speed.py`` counts the differences on a GPU.

What :func:`takes`: a unit in torch's moment layout or a state format whose params are plain (not fake, not a
subclass) contiguous CUDA tensors under ``2**31`` elements, each bf16 with a contiguous bf16 gradient (and
Kahan buffer where the unit has them) or fp32 with an fp32 gradient (and none: stepped and stored in fp32 as
the engine steps an fp32 param in place, e.g. ``MixedPrecisionOptimizer``'s master weights with a
``state_format``), the moments (codes and scales) laid out as the format makes them, contiguous on that
device, no amsgrad, eager mode (not compiling), Triton importable, and the environment variable
``MIXPREC_FUSED_OPTIM`` not ``0`` (read at each step; ``0`` forces the chunked engine). A CPU tensor takes it
only under Triton's interpreter (``TRITON_INTERPRET=1``), where the tests run it; there ``powf`` is torch's on
the host. Triton is imported when a kernel is first launched (``mixprec._triton.kernels``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mixprec._triton import device_of, interpreting, kernels, triton_available
from mixprec.optim import state_formats
from mixprec.optim.guard import grads_of
from mixprec.optim.state_formats import MOMENTS, ORIGINS, CodedMoments, TorchMoments, code_tables, scale_key

if TYPE_CHECKING:
    from mixprec.optim.fused_adam import AdamUnit

__all__ = ["BLOCK", "ENV_SWITCH", "ROWS", "step_unit", "takes", "triton_available"]

#: The environment variable that forces the chunked engine when set to ``0``.
ENV_SWITCH = "MIXPREC_FUSED_OPTIM"
BLOCK = 1024  # elements per program (optimi's block for large tensors)
#: Device types whose torch divides a tensor by a Python number as a multiply by its fp32 reciprocal
#: (ATen's ``div_true_kernel_cuda``); elsewhere it divides. The fp8 state's scale follows it.
RECIPROCAL_DIVISION = ("cuda",)
ROWS = 4  # coded moments: scale blocks per program (1024 values, as BLOCK)
_BF16, _F32 = torch.bfloat16, torch.float32
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_TINY = 1e-12  # state_formats' smallest block absmax
_E4M3_MAX = 448.0


def _fits(t: torch.Tensor | None, device: torch.device, dtype: torch.dtype = _BF16) -> bool:
    return (
        t is not None
        and type(t) in _PLAIN
        and t.dtype == dtype
        and t.device == device
        and t.is_contiguous()
        and t.numel() < 2**31
    )


def takes(unit: AdamUnit) -> bool:
    """Whether ``unit`` steps through a kernel (see the module doc)."""
    moments = unit.moments
    if os.environ.get(ENV_SWITCH, "1") == "0" or not unit.params:
        return False
    if unit.group.get("amsgrad", False) or torch.compiler.is_compiling():
        return False
    device = unit.params[0].device
    if not (device.type == "cuda" or (device.type == "cpu" and interpreting())):
        return False
    kahan = list(unit.kahan) if unit.kahan is not None else [None] * len(unit.params)
    for param, buffer in zip(unit.params, kahan, strict=True):
        dtype = param.dtype  # bf16 (a Kahan buffer where the unit has them) or fp32 (none), grad alike
        if dtype not in (_BF16, _F32) or not (
            _fits(param, device, dtype) and _fits(param.grad, device, dtype)
        ):
            return False
        if not (_fits(buffer, device) if dtype == _BF16 and unit.kahan is not None else buffer is None):
            return False
    if isinstance(moments, TorchMoments):
        if any(dtype not in (_BF16, _F32) for dtype in moments.dtypes):
            return False
        stored = [s[k] for s in unit.states for k in MOMENTS if k in s]  # a loaded state: laid out as made
        return all(m.is_contiguous() and m.device == device for m in stored) and triton_available()
    return _coded_fit(unit, moments, device) and triton_available()


def _coded_fit(unit: AdamUnit, moments: CodedMoments, device: torch.device) -> bool:
    """Codes and scales laid out as the format makes them on the state's grid
    (``state_formats.expected_layout``), contiguous on ``device``, where the state has them (a fresh
    state is made to fit)."""
    for param, state in zip(unit.params, unit.states, strict=True):
        origins = state.get(ORIGINS)
        layout = state_formats.expected_layout(
            moments.fmt, param, None if origins is None else origins.tolist()
        )
        for key, (shape, dtype) in layout.items():
            if key in state and not (_fits(state[key], device, dtype) and tuple(state[key].shape) == shape):
                return False
    return True


def step_unit(unit: AdamUnit, tables: dict[Any, Any] | None = None) -> None:
    """One step of every param of ``unit`` (:func:`takes` it; its states made and counted by the caller).
    ``tables``: where the coded formats' code tables are cached per device (a workspace's; None: made for
    this call)."""
    group, params, moments = unit.group, unit.params, unit.moments
    device = params[0].device
    kern = _kernels(interpreting())
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
        "PRECISE": not interpreting(),
    }
    options = {} if interpreting() else {"enable_fp_fusion": False}  # only the kernel's explicit fmas
    hyper = (float(group["lr"]), float(beta1), float(beta2), float(group["eps"]), float(wd))
    kahan = [c if c is not None else p for c, p in zip(unit.kahan or params, params, strict=True)]
    coded = isinstance(moments, CodedMoments) and moments.fmt != "bf16"
    if coded:
        assert isinstance(moments, CodedMoments)
        fp8 = moments.fmt == "fp8"
        tables = {} if tables is None else tables
        maps = [code_tables(moments.fmt, second, device, tables) for second in (False, True)]
        reciprocal = fp8 and device.type in RECIPROCAL_DIVISION  # as torch's ``tensor / 448.0`` there
        q = (torch.tensor(1.0, dtype=_F32) / _E4M3_MAX).item() if reciprocal else _E4M3_MAX
        consts |= {"FP8": fp8, "RECIPROCAL": reciprocal, "ROWS": ROWS, "BLOCK": state_formats.BLOCK}
    else:  # torch's layout; bf16 codes are that layout in bf16
        dtypes = moments.dtypes if isinstance(moments, TorchMoments) else (_BF16, _BF16)
        consts |= {"M_BF16": dtypes[0] == _BF16, "V_BF16": dtypes[1] == _BF16, "BLOCK": BLOCK}
    with device_of(params[0]):
        for index, (param, grad, buffer, state) in enumerate(
            zip(params, grads_of(params), kahan, unit.states, strict=True)
        ):
            step = state["step"]
            bias = step if consts["PRECISE"] else _bias_corrections(beta1, beta2, step)
            n = param.numel()
            if n == 0:
                continue
            # an fp32 weight is stored as stepped: one rounding variant compiled for it, not three
            w_f32 = param.dtype == _F32
            tensor_consts = consts | {"W_F32": w_f32, "ROUND": 0 if w_f32 else rounding}
            if not coded:
                m, v = (_bits(state[key]) for key in MOMENTS)
                kern.adam[(-(-n // BLOCK),)](
                    _bits(param), _bits(buffer), _bits(grad), m, v, step, seed, bias, n, index, *hyper,
                    **tensor_consts, **options,
                )  # fmt: skip
                continue
            codes = [state[key].view(-1).view(torch.uint8) for key in MOMENTS]
            scales = [state[scale_key(key)] for key in MOMENTS]
            flat = [_bits(t).view(-1) for t in (param, buffer, grad)]
            for start, stop, block in moments.runs(n, state):  # a resharded grid restarts at its origins
                blocks = -(-(stop - start) // state_formats.BLOCK)
                w, c, g = (t[start:stop] for t in flat)
                (m, v), (ms, vs) = (x[start:stop] for x in codes), (x[block : block + blocks] for x in scales)
                kern.adam_coded[(-(-blocks // ROWS),)](
                    w, c, g, m, ms, v, vs, *maps[0], *maps[1], step, seed, bias, stop - start, start, index,
                    *hyper, _TINY, q, **tensor_consts, **options,
                )  # fmt: skip
    # The kernels write through pointers, which autograd does not see: mark the weights modified in place
    # as torch's own in-place ops do, so a graph that saved one fails its version check in backward.
    torch.autograd.graph.increment_version(params)


def _bias_corrections(beta1: float, beta2: float, step: torch.Tensor) -> torch.Tensor:
    """``[1 - b1**step, 1 - b2**step]`` in fp32 (torch's ``pow`` on the host): what the interpreter is
    given in place of libdevice's ``powf``."""
    betas = torch.tensor([beta1, beta2], dtype=_F32)
    return 1 - torch.pow(betas, step.to(_F32))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A bf16 tensor as its int16 bits (what the kernel reads and writes), an fp32 one as it is."""
    return t.view(torch.int16) if t.dtype == _BF16 else t


def _kernels(interpret: bool) -> Any:
    """The kernels module (``_triton_adam_kernels.py``), loaded once per interpreter setting."""
    path = Path(__file__).with_name("_triton_adam_kernels.py")
    return kernels(path, "mixprec.optim._triton_adam_kernels", interpret)
