"""Which CUDA shapes mixprec.float8 sends to ``torch._scaled_mm``: exactly those torch's own check takes.

Runs on a CPU build: ``device="cuda"`` FakeTensors under ``FakeTensorMode`` run torch's meta kernel for
``_scaled_mm``, whose size rule is CUDA's (K and N multiples of 16; M, the rows, free). That kernel is
the oracle, called in the same run for every shape.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from mixprec.lowbit import gemm

E4M3 = torch.float8_e4m3fn


def _pair(m: int, k: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    a = torch.empty(m, k, device="cuda", dtype=E4M3)
    b = torch.empty(n, k, device="cuda", dtype=E4M3).t()  # (K, N) column-major, as cuBLASLt takes it
    return a, b


def _torch_accepts(a: torch.Tensor, b: torch.Tensor) -> bool:
    one = torch.ones((), device="cuda")
    try:
        torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize(("m", "k", "n"), list(itertools.product((100, 20, 16, 256), (64, 40), (48, 24))))
def test_cuda_shapes_sent_to_scaled_mm_are_the_ones_torch_takes(m, k, n, monkeypatch) -> None:
    monkeypatch.setattr(torch.version, "hip", None)
    with FakeTensorMode():
        a, b = _pair(m, k, n)
        assert gemm.scaled_mm_accepts(a, b) == _torch_accepts(a, b), (m, k, n)


def test_100_rows_reach_scaled_mm_on_cuda(monkeypatch) -> None:
    """M = 100 (no multiple of 16) is a row count cuBLASLt takes: fprop and dgrad are not emulated."""
    monkeypatch.setattr(torch.version, "hip", None)
    calls = []
    real = torch._scaled_mm

    def spy(a, b, **kwargs):
        calls.append((tuple(a.shape), tuple(b.shape)))
        return real(a, b, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    with FakeTensorMode():
        one = torch.ones((), device="cuda")
        a, b = _pair(100, 64, 48)
        out = gemm.scaled_mm(a, one, b, one, torch.bfloat16)
        assert out.shape == (100, 48) and out.dtype == torch.bfloat16 and out.device.type == "cuda"
        # wgrad's reduction dim is the 100 rows: torch refuses it, mixprec emulates it (in tests/fake_cuda)
        grad_out = torch.empty(100, 48, device="cuda", dtype=torch.float8_e5m2)
        assert not gemm.scaled_mm_accepts(grad_out.t(), a)
    assert calls == [((100, 64), (64, 48))]
