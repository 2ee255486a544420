"""float8 configs with AMD MI300's fnuz dtypes: accepted as torchao accepts them, trained bitwise as torchao
trains them (emulated, same run), and emulated rather than sent to ``torch._scaled_mm`` on a CUDA build
that is not ROCm (cuBLASLt has no fnuz kernels)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import mixprec.float8 as mf
from mixprec.lowbit import gemm

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    ao = pytest.importorskip("torchao.float8")
    from torchao.float8.config import CastConfig as AoCastConfig
    from torchao.float8.config import ScalingGranularity as AoGranularity

E4, E5 = torch.float8_e4m3fnuz, torch.float8_e5m2fnuz


def _casts(cast_cls, granularity_cls, granularity: str) -> dict[str, object]:
    """MI300's torchao defaults: e4m3fnuz input and weight, e5m2fnuz grad_output."""
    g = granularity_cls(granularity)
    return {
        "cast_config_input": cast_cls(scaling_granularity=g, target_dtype=E4),
        "cast_config_weight": cast_cls(scaling_granularity=g, target_dtype=E4),
        "cast_config_grad_output": cast_cls(scaling_granularity=g, target_dtype=E5),
    }


def _run(model: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:
    x = x.clone().requires_grad_()
    out = model(x)
    out.backward(grad)
    return [out.detach(), x.grad, model[0].weight.grad]


@pytest.mark.parametrize("pow2", [False, True], ids=["fp32_scales", "pow2_scales"])
@pytest.mark.parametrize("granularity", ["tensorwise", "axiswise"])
def test_fnuz_casts_train_bitwise_as_torchao(granularity: str, pow2: bool) -> None:
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(64, 48))
    theirs_config = ao.Float8LinearConfig(
        emulate=True, round_scales_to_power_of_2=pow2, **_casts(AoCastConfig, AoGranularity, granularity)
    )
    theirs = ao.convert_to_float8_training(copy.deepcopy(base), config=theirs_config)
    config = mf.Float8Config(
        emulate=True,
        round_scales_to_power_of_2=pow2,
        **_casts(mf.CastConfig, mf.ScalingGranularity, granularity),
    )
    ours = mf.convert_to_float8_training(copy.deepcopy(base), config=config)
    x, grad = torch.randn(2, 16, 64) * 30, torch.randn(2, 16, 48)
    for name, o, m in zip(
        ("out", "grad_x", "grad_w"), _run(theirs, x, grad), _run(ours, x, grad), strict=True
    ):
        assert torch.equal(m, o), name


def test_the_fnuz_config_names_its_fnuz_formats() -> None:
    config = mf.Float8Config(**_casts(mf.CastConfig, mf.ScalingGranularity, "tensorwise"))
    assert config.lowbit_recipe == (
        "fprop=fp8_tensorwise_fnuz,fp8_tensorwise_fnuz dgrad=fp8_tensorwise_e5m2fnuz,fp8_tensorwise_fnuz "
        "wgrad=fp8_tensorwise_e5m2fnuz,fp8_tensorwise_fnuz"
    )
    rowwise = mf.Float8Config(
        round_scales_to_power_of_2=True, **_casts(mf.CastConfig, mf.ScalingGranularity, "axiswise")
    )
    assert rowwise.lowbit_recipe.startswith(
        "fprop=fp8_rowwise_fnuz,fp8_rowwise_fnuz dgrad=fp8_rowwise_e5m2fnuz"
    )
    assert config.cast_configs_str() == "i:dyn_ten_e4m3fnuz,w:dyn_ten_e4m3fnuz,go:dyn_ten_e5m2fnuz"
    assert mf.CastConfig(target_dtype=E5).short_str() == "dyn_ten_e5m2fnuz"


def test_fnuz_and_the_float8_only_features_are_refused_clearly() -> None:
    fnuz = _casts(mf.CastConfig, mf.ScalingGranularity, "tensorwise")
    with pytest.raises(ValueError, match="scaling='delayed' needs 'tensorwise' and every cast dynamic"):
        mf.Float8Config(scaling="delayed", **fnuz)
    with pytest.raises(ValueError, match="enable_fsdp_float8_all_gather=True needs"):
        mf.Float8Config(enable_fsdp_float8_all_gather=True, **fnuz)
    mixed = {**fnuz, "cast_config_weight_for_grad_input": mf.CastConfig(target_dtype=torch.float8_e4m3fn)}
    with pytest.raises(AssertionError, match="weight must be cast to the same dtype in both matmuls"):
        mf.Float8Config(**mixed)


def _fake_cuda_pair(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty(32, 64, device="cuda", dtype=dtype), torch.empty(64, 16, device="cuda", dtype=dtype)


@pytest.mark.parametrize("dtype", [E4, E5])
def test_fnuz_on_cuda_without_rocm_is_emulated_not_sent_to_scaled_mm(dtype, monkeypatch) -> None:
    monkeypatch.setattr(torch.version, "hip", None)
    with FakeTensorMode():
        a, b = _fake_cuda_pair(dtype)
        e4a, e4b = _fake_cuda_pair(torch.float8_e4m3fn)
        assert not gemm.scaled_mm_accepts(a, b)
        assert not gemm.scaled_mm_accepts(e4a, b) and not gemm.scaled_mm_accepts(a, e4b)
        assert gemm.scaled_mm_accepts(e4a, e4b)  # the OCP dtypes still take cuBLASLt
        out = gemm.scaled_mm(
            a, torch.ones((), device="cuda"), b, torch.ones((), device="cuda"), torch.bfloat16
        )
        assert out.shape == (32, 16) and out.device.type == "cuda" and out.dtype == torch.bfloat16
    monkeypatch.setattr(torch.version, "hip", "6.2")
    with FakeTensorMode():
        a, b = _fake_cuda_pair(E4)
        assert gemm.scaled_mm_accepts(a, b)  # ROCm: hipBLASLt has the fnuz GEMM


def test_fnuz_on_the_cpu_is_emulated_and_matches_the_reference() -> None:
    # oneDNN's CPU _scaled_mm takes fnuz on some CPUs and refuses it on others: never sent there
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(32, 64, generator=g) * 10).to(E4)
    b = (torch.randn(64, 16, generator=g) * 10).to(E4)
    assert not gemm.scaled_mm_accepts(a, b)
    assert not gemm.scaled_mm_accepts(a.to(torch.float32).to(torch.float8_e4m3fn), b)
    assert gemm.scaled_mm_accepts(
        a.to(torch.float32).to(torch.float8_e4m3fn), b.to(torch.float32).to(torch.float8_e4m3fn)
    )
    scale_a, scale_b = torch.tensor(2.0), torch.tensor(0.5)
    fast = gemm.scaled_mm(a, scale_a, b, scale_b, torch.float32)
    emulated = gemm.scaled_mm(a, scale_a, b, scale_b, torch.float32, emulate=True)
    reference = (a.double() / 2.0) @ (b.double() / 0.5)
    torch.testing.assert_close(fast.double(), reference, rtol=1e-6, atol=1e-4)
    assert torch.equal(fast, emulated)
