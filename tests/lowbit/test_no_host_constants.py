"""quantize / dequantize make no tensor from a Python constant per call: on CUDA each such tensor is a
pageable host-to-device copy (and blocks CUDA-graph capture). The e2m1 table is computed on the data's
device, bitwise torchao's f4 decode. A dispatch mode sees every ``torch.tensor(...)`` / ``torch.as_tensor``
of a Python value as ``aten.lift_fresh``, on the CPU too, and every ``.item()`` as ``_local_scalar_dense``."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mixprec.lowbit import FORMATS, quantize
from mixprec.lowbit.quantize import e2m1_values

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    kernels = pytest.importorskip("torchao.prototype.mx_formats.kernels")

HOST_OPS = ("lift_fresh", "lift_fresh_copy", "_local_scalar_dense")


class HostConstants(TorchDispatchMode):
    """Records the ops that bring a host value into a tensor or a tensor value to the host."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in HOST_OPS:
            self.seen.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_the_e2m1_table_is_torchaos_decode_bitwise() -> None:
    codes = torch.arange(16, dtype=torch.uint8)
    theirs = kernels.f4_unpacked_to_f32(codes)
    ours = e2m1_values("cpu")
    assert ours.dtype == torch.float32 and ours.device.type == "cpu"
    assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32))  # -0.0 at code 8 included
    assert torch.signbit(ours[8]) and ours[8] == 0


@pytest.mark.parametrize("name", list(FORMATS))
def test_quantize_and_dequantize_lift_no_python_constant(name: str) -> None:
    x = torch.randn(128, 256, generator=torch.Generator().manual_seed(0))
    with HostConstants() as mode:
        q = quantize(x, name)
        out = q.dequantize(torch.bfloat16)
        if q.fmt.two_level:
            quantize(x, name, tensor_amax=3.0).dequantize()
        quantize(x, name, axis=0, stochastic=True, generator=torch.Generator().manual_seed(1)).values()
    assert mode.seen == [], f"{name}: {mode.seen}"
    assert out.shape == x.shape


def test_a_python_tensor_amax_gives_the_same_scale_as_a_tensor_one() -> None:
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    a = quantize(x, "nvfp4", tensor_amax=3.0)
    b = quantize(x, "nvfp4", tensor_amax=torch.tensor(3.0, dtype=torch.float64))
    assert a.tensor_scale.dtype == torch.float32 and a.tensor_scale.shape == ()
    assert torch.equal(a.tensor_scale, b.tensor_scale) and torch.equal(a.data, b.data)
