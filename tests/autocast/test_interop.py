"""Code written for torch.autocast under a mixprec region, and the engine defects of the interop issue.

torch.autocast is the oracle: each case runs the same code under both and compares bitwise.
"""

from __future__ import annotations

import threading
import warnings
from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec import Policy

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def _regions(dtype: torch.dtype = BF16) -> list:
    return [torch.autocast("cpu", dtype=dtype), mixprec.autocast("cpu", dtype=dtype)]


def test_torch_sees_the_region() -> None:
    with mixprec.autocast("cpu", dtype=FP16):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == FP16
    assert not torch.is_autocast_enabled("cpu")


def test_enabled_false_island_keeps_fp32() -> None:
    lin, x = nn.Linear(8, 8), torch.randn(4, 8)
    with mixprec.autocast("cpu"):
        with torch.autocast("cpu", enabled=False):
            assert lin(x).dtype == FP32
        assert lin(x).dtype == BF16
    edited = Policy.for_device("cpu").with_ops(lower=["gelu"])  # a deviation obeys the island too
    with mixprec.autocast("cpu", policy=edited):
        assert F.gelu(x).dtype == BF16
        with torch.autocast("cpu", enabled=False):
            assert F.gelu(x).dtype == FP32


class _Fp32Matmul(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, w)
        return a @ w

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, w = ctx.saved_tensors
        return grad @ w.t(), a.t() @ grad


def test_torch_custom_fwd_cast_inputs_is_honoured() -> None:
    outs = []
    for region in _regions():
        torch.manual_seed(0)
        lin, w = nn.Linear(8, 8), torch.randn(8, 8, requires_grad=True)
        with region:
            y = _Fp32Matmul.apply(lin(torch.randn(4, 8)), w)  # a bf16 input meets an fp32 weight
        y.sum().backward()
        outs.append((y, w.grad, lin.weight.grad))
    assert outs[0][0].dtype == FP32
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)


def test_out_argument_is_written_and_returned() -> None:
    a, b = torch.randn(3, 3), torch.randn(3, 3)
    for policy in (None, Policy.for_device("cpu").with_ops(fp32=["mm"])):
        c = torch.empty(3, 3)
        with mixprec.autocast("cpu", policy=policy):
            r = torch.mm(a, b, out=c)
        assert r is c and torch.equal(c, a @ b)  # torch runs out= calls without autocasting them


def test_disabled_region_accepts_any_dtype() -> None:
    lin, x = nn.Linear(4, 4).double(), torch.randn(2, 4, dtype=torch.float64)
    for use_amp in (False,):
        with mixprec.autocast("cpu", dtype=torch.float64, enabled=use_amp):
            assert lin(x).dtype == torch.float64
    with pytest.raises(ValueError, match="float64"):
        mixprec.autocast("cpu", dtype=torch.float64)  # enabled: refused, not silently disabled


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA warning")
def test_cuda_region_without_cuda_warns_like_torch() -> None:
    with pytest.warns(UserWarning, match="CUDA is not available"):
        region = mixprec.autocast("cuda")
    with region:
        assert not torch.is_autocast_enabled("cuda") and not mixprec.is_autocast_enabled("cuda")


def test_fp32_pin_runs_unlisted_ops_in_fp32() -> None:
    """layer_norm is on no CPU list: pinned to fp32, the module's bf16 input is cast up on entry."""
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    policy = Policy.for_device("cpu").with_modules({nn.LayerNorm: FP32})
    with mixprec.autocast("cpu", policy=policy):
        h = model[0](torch.randn(2, 8))
        assert h.dtype == BF16
        assert model(torch.randn(2, 8)).dtype == FP32


def test_fp32_pin_casts_keyword_inputs() -> None:
    class Takes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, *, h: torch.Tensor) -> torch.Tensor:
            return self.lin(h)

    outer = nn.ModuleDict({"inner": Takes()})
    policy = Policy.for_device("cpu").with_modules({"inner": FP32})
    x = torch.randn(2, 8).bfloat16()
    with mixprec.autocast("cpu", policy=policy):
        for _ in range(2):  # the first call arms the pin, the second uses it
            assert outer["inner"](h=x).dtype == BF16  # called directly it is the root "": not pinned
    root = nn.Sequential()
    root.add_module("inner", Takes())

    def call(m: nn.Module) -> torch.Tensor:
        return m.inner(h=x)

    root.forward = lambda: call(root)  # type: ignore[method-assign]
    with mixprec.autocast("cpu", policy=policy):
        assert root().dtype == FP32


class _Recorder(torch.autograd.Function):
    seen: ClassVar[dict[str, torch.dtype]] = {}

    @staticmethod
    @mixprec.custom_fwd
    def forward(ctx, a: torch.Tensor) -> torch.Tensor:
        _Recorder.seen["fwd"] = (a @ a.t()).dtype
        return a.clone()

    @staticmethod
    @mixprec.custom_bwd
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        _Recorder.seen["bwd"] = (grad @ grad.t()).dtype
        return grad


def test_custom_function_in_fp32_pinned_module_runs_backward_in_fp32() -> None:
    class Block(nn.Module):
        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return _Recorder.apply(h)

    model = nn.Sequential(nn.Linear(8, 8), Block())
    policy = Policy.for_device("cpu").with_modules({Block: FP32})
    with mixprec.autocast("cpu", policy=policy):
        out = model(torch.randn(4, 8))
    out.float().sum().backward()
    assert _Recorder.seen == {"fwd": FP32, "bwd": FP32}


def test_pins_are_per_thread() -> None:
    """A thread leaving its region never removes the hooks another thread's pinned module relies on."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)))
    policy = Policy.for_device("cpu").with_modules({"1": FP32})
    inside, leave, seen = threading.Event(), threading.Event(), {}

    def pinned() -> None:
        with mixprec.autocast("cpu", policy=policy):
            inside.set()
            leave.wait(10)
            seen["pinned"] = model(torch.randn(2, 8)).dtype

    def other() -> None:
        inside.wait(10)
        with mixprec.autocast("cpu", policy=policy):
            model(torch.randn(2, 8))
        seen["other"] = model[1](torch.randn(2, 8)).dtype  # outside any region: no pin leaks here
        leave.set()

    threads = [threading.Thread(target=pinned), threading.Thread(target=other)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert seen == {"pinned": FP32, "other": FP32}
    with mixprec.autocast("cpu"):
        assert model[1](torch.randn(2, 8)).dtype == BF16  # the default policy pins nothing


@pytest.mark.parametrize("cell", [nn.GRUCell, nn.LSTMCell, nn.GRU])
def test_recurrent_modules_run_in_bf16_as_torch(cell: type) -> None:
    outs = []
    for region in _regions():
        torch.manual_seed(0)
        m = cell(8, 8)
        x = torch.randn(3, 8)
        with region:
            y = m(x)
        y = y[0] if isinstance(y, tuple) else y
        y.float().sum().backward()
        outs.append((y, *[p.grad for p in m.parameters()]))
    for a, b in zip(*outs, strict=True):  # their matmuls run in bf16 inside (ATen-level autocast)
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_eval_fast_path_matches_torch() -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, batch_first=True).eval()
    x = torch.randn(2, 5, 16)
    outs = []
    with torch.no_grad():
        for region in _regions():
            with region:
                outs.append(layer(x))
    assert outs[0].dtype == outs[1].dtype and outs[1].is_contiguous()
    assert torch.equal(outs[0], outs[1])


def test_plain_torch_autocast_is_unchanged_after_mixprec_ran() -> None:
    lin, x = nn.Linear(8, 8), torch.randn(4, 8)
    with torch.autocast("cpu", dtype=BF16):
        before = lin(x)
    policy = Policy.for_device("cpu").with_ops(fp32=["linear"]).with_modules({nn.Linear: FP32})
    with mixprec.autocast("cpu", policy=policy):
        assert lin(x).dtype == FP32
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.autocast("cpu", dtype=BF16):
            after = lin(x)
    assert after.dtype == BF16 and torch.equal(before, after)


def test_compile_traces_a_default_region_in_one_graph() -> None:
    torch._dynamo.reset()
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 4, 32, batch_first=True, dropout=0.0), 2)

    def step(x: torch.Tensor) -> torch.Tensor:
        with mixprec.autocast("cpu"):
            return enc(x)

    x = torch.randn(2, 5, 16)
    explained = torch._dynamo.explain(step)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    compiled = torch.compile(step)(x)
    assert compiled.dtype == step(x).dtype
    torch.testing.assert_close(compiled.float(), step(x).float(), rtol=0.05, atol=0.05)  # bf16 fusion


_REFUSE = """
import torch, mixprec
from torch import nn
lin = nn.Linear(8, 8)
policy = mixprec.Policy.for_device("cpu").with_ops(fp32=["linear"])
def step(x):
    with mixprec.autocast("cpu", policy=policy):
        return lin(x)
try:
    torch.compile(step)(torch.randn(2, 8))
except Exception as exc:
    print("refused:", "enter the region outside the compiled function" in str(exc))
compiled = torch.compile(lin)  # the supported shape: the region outside, the model compiled
with mixprec.autocast("cpu", policy=policy):
    print("outside:", compiled(torch.randn(2, 8)).dtype)
"""


def test_compile_refuses_a_policy_region_it_cannot_trace() -> None:
    """In a fresh process: dynamo's caches from other tests change how it reports a refused trace."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _REFUSE], capture_output=True, text=True, timeout=300)
    assert "refused: True" in out.stdout, out.stdout + out.stderr[-2000:]
    assert "outside: torch.float32" in out.stdout
