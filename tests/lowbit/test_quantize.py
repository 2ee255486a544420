"""`mixprec.lowbit.quantize` against torchao 0.18's pure-PyTorch references, computed in the same run.

Bitwise: stored values, scales and dequantized tensors, for fp32 and bf16 inputs, on tensors spanning 16
decades with zero blocks, exact powers of two and ties. Stochastic rounding: unbiased over many draws,
reproducible from its generator.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from mixprec import lowbit
from mixprec.lowbit import LowbitFormat, ScaleRounding, quantize

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

DTYPES = [torch.float32, torch.bfloat16]
MX_CASES = [  # mixprec format, torchao element dtype, torchao scale rule
    ("mxfp8_floor", torch.float8_e4m3fn, ScaleCalculationMode.FLOOR),
    ("mxfp8_e5m2", torch.float8_e5m2, ScaleCalculationMode.FLOOR),
    ("mxfp4", torch.float4_e2m1fn_x2, ScaleCalculationMode.FLOOR),
    ("mxfp8_rceil", torch.float8_e4m3fn, ScaleCalculationMode.RCEIL),
]


def _hard(dtype: torch.dtype, shape=(64, 256), seed: int = 0) -> torch.Tensor:
    """Values over 16 decades, a zero block, exact powers of two and e2m1 ties."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.logspace(-8, 8, shape[-1])
    x[3, 0:32] = 0.0
    x[4, 32:64] = torch.tensor([2.0**k for k in range(-16, 16)])
    x[5, 64:80] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.5] * 2) * 2.0**-3
    x[6, 96:128] *= -1
    return x.to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("name", "elem", "mode"), MX_CASES)
def test_mx_formats_match_torchao_to_mx_bitwise(name, elem, mode, dtype) -> None:
    x = _hard(dtype)
    ref = mx.MXTensor.to_mx(x, elem, 32, scaling_mode=mode)
    ours = quantize(x, name)
    assert torch.equal(_bits(ours.scale), _bits(ref.scale))
    assert torch.equal(_bits(ours.data), _bits(ref.qdata))
    assert torch.equal(ours.dequantize(torch.float32), ref.dequantize(torch.float32))


@pytest.mark.parametrize("rule", [ScaleRounding.CEIL, ScaleRounding.EVEN])
@pytest.mark.parametrize("element", ["e4m3", "e2m1"])
def test_user_formats_with_other_scale_rules_match_torchao(rule, element) -> None:
    fmt = LowbitFormat("mine", element, "e8m0", (1, 32), rule)
    elem = torch.float8_e4m3fn if element == "e4m3" else torch.float4_e2m1fn_x2
    x = _hard(torch.float32, seed=1)
    scale, data = mx.to_mx(x, elem, 32, ScaleCalculationMode(rule.value))
    ours = quantize(x, fmt)
    assert torch.equal(_bits(ours.scale), _bits(scale)) and torch.equal(_bits(ours.data), _bits(data))


def test_mx_on_a_3d_tensor_matches_torchao() -> None:
    x = _hard(torch.float32, shape=(16, 256)).reshape(4, 16, 64)
    ref = mx.MXTensor.to_mx(x, torch.float8_e4m3fn, 32)
    ours = quantize(x, "mxfp8_floor")
    assert torch.equal(_bits(ours.data), _bits(ref.qdata).reshape(64, 64))  # (M, K) with M = 4 * 16
    assert torch.equal(ours.dequantize(), ref.dequantize(torch.float32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("two_level", [False, True], ids=["block_scale_only", "with_tensor_scale"])
def test_nvfp4_matches_torchao_to_nvfp4_bitwise(two_level, dtype) -> None:
    x = _hard(dtype)
    if two_level:
        ref = NVFP4Tensor.to_nvfp4(x, per_tensor_scale=per_tensor_amax_to_scale(x.abs().max()))
        ours = quantize(x, "nvfp4")
        assert torch.equal(ours.tensor_scale, ref.per_tensor_scale)
    else:
        ref = NVFP4Tensor.to_nvfp4(x)
        ours = quantize(x, "nvfp4_single")
        assert ours.tensor_scale is None
    assert torch.equal(_bits(ours.scale), _bits(ref.scale))
    assert torch.equal(ours.data, _bits(ref.qdata))
    assert torch.equal(ours.dequantize(torch.float32), ref.dequantize(torch.float32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("axis", [-1, 0])
@pytest.mark.parametrize(("name", "pow2"), [("fp8_rowwise", True), ("fp8_rowwise_fp32", False)])
def test_fp8_rowwise_matches_torchao_axiswise_cast(name, pow2, axis, dtype) -> None:
    x = _hard(dtype)
    scale = tensor_to_scale(x, torch.float8_e4m3fn, scaling_granularity=ScalingGranularity.AXISWISE,
                            axiswise_dim=axis, round_scales_to_power_of_2=pow2)  # fmt: skip
    data = to_fp8_saturated(x.to(torch.float32) * scale, torch.float8_e4m3fn)
    ours = quantize(x, name, axis=axis)
    moved = data if axis == -1 else data.t()
    assert torch.equal(_bits(ours.data), _bits(moved))
    assert torch.equal(ours.scale.reshape(-1), scale.reshape(-1))
    assert torch.equal(ours.dequantize(), data.to(torch.float32) / scale)


def test_fp8_tensorwise_matches_torchao() -> None:
    x = _hard(torch.bfloat16)
    for name, dtype in (("fp8_tensorwise", torch.float8_e4m3fn), ("fp8_tensorwise_e5m2", torch.float8_e5m2)):
        scale = tensor_to_scale(x, dtype)
        ours = quantize(x, name)
        assert torch.equal(ours.scale.reshape(()), scale)
        assert torch.equal(_bits(ours.data), _bits(to_fp8_saturated(x.float() * scale, dtype)))


def test_fp8_blockwise_scales_are_powers_of_two_per_block() -> None:
    x = _hard(torch.float32, shape=(256, 256))
    for name, blocks in (("fp8_blockwise", (256, 2)), ("fp8_blockwise_2d", (2, 2))):
        q = quantize(x, name)
        assert q.scale.shape == blocks
        assert torch.equal(torch.exp2(torch.log2(q.scale).round()), q.scale)
        tile = x[:128, :128] if name == "fp8_blockwise_2d" else x[0:1, :128]
        expected = torch.exp2(torch.floor(torch.log2((448.0 / tile.abs().max().double()).float())))
        assert q.scale[0, 0] == expected


def test_non_multiple_shapes_are_refused_or_padded() -> None:
    x = torch.randn(5, 40)
    with pytest.raises(
        ValueError, match=r"mxfp8_floor needs the 5x40 matrix .* multiple of its 1x32 block.*pad=True"
    ):
        quantize(x, "mxfp8_floor")
    q = quantize(x, "mxfp8_floor", pad=True)
    assert q.data.shape == (5, 64) and q.dequantize().shape == (5, 40)
    padded = torch.nn.functional.pad(x, (0, 24))
    assert torch.equal(q.dequantize(), quantize(padded, "mxfp8_floor").dequantize()[:, :40])
    q2 = quantize(torch.randn(3, 40), "fp8_blockwise_2d", pad=True)
    assert q2.data.shape == (128, 128) and q2.dequantize().shape == (3, 40)


def test_a_calibrated_tensor_amax_matches_torchao_per_tensor_scale() -> None:
    x = _hard(torch.float32)
    amax = torch.tensor(3.0e7)  # a calibrated amax beyond this tensor's own
    ref = NVFP4Tensor.to_nvfp4(x, per_tensor_scale=per_tensor_amax_to_scale(amax))
    ours = quantize(x, "nvfp4", tensor_amax=amax)
    assert torch.equal(_bits(ours.scale), _bits(ref.scale)) and torch.equal(ours.data, _bits(ref.qdata))


def test_quantize_keeps_shape_dtype_and_axis() -> None:
    x = torch.randn(2, 64, 3, dtype=torch.bfloat16)
    q = quantize(x, "nvfp4", axis=1)
    assert q.shape == x.shape and q.dtype == torch.bfloat16 and q.axis == 1
    back = q.dequantize(torch.bfloat16)
    assert back.shape == x.shape and back.dtype == torch.bfloat16
    assert torch.equal(
        back, quantize(x.movedim(1, -1).contiguous(), "nvfp4").dequantize(torch.bfloat16).movedim(-1, 1)
    )


def test_bad_arguments_raise_clear_errors() -> None:
    x = torch.randn(4, 32)
    with pytest.raises(ValueError, match="unknown low-bit format 'mxfp9'.*mxfp8"):
        quantize(x, "mxfp9")
    with pytest.raises(TypeError, match="floating torch.Tensor.*torch.int64"):
        quantize(torch.ones(4, 32, dtype=torch.long), "mxfp8_floor")
    with pytest.raises(ValueError, match=r"axis must be an int in \[-2, 1\]"):
        quantize(x, "mxfp8_floor", axis=2)
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        quantize(x, "mxfp8_floor", stochastic=True, generator=0)
    with pytest.raises(TypeError, match="stochastic must be a bool"):
        quantize(x, "mxfp8_floor", stochastic=1)
    with pytest.raises(ValueError, match="tensor_amax is for two-level formats"):
        quantize(x, "mxfp8_floor", tensor_amax=1.0)
    with pytest.raises(ValueError, match="tensor_amax must be one finite number > 0"):
        quantize(x, "nvfp4", tensor_amax=float("nan"))
    with pytest.raises(ValueError, match="does not take rule"):
        LowbitFormat("bad", "e4m3", "fp32", (1, 32), ScaleRounding.FLOOR)
    with pytest.raises(ValueError, match="block must be"):
        LowbitFormat("bad", "e4m3", "fp32", (2, -1))


@pytest.mark.parametrize("name", ["mxfp4", "nvfp4", "mxfp8_floor", "mxfp8_rceil", "fp8_rowwise"])
def test_stochastic_rounding_is_unbiased(name) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 64, generator=g)
    draws = torch.stack([quantize(x, name, stochastic=True, generator=g).dequantize() for _ in range(1000)])
    nearest = quantize(x, name)
    # Under SR a block whose largest value the nearest scale would saturate takes the next coarser scale
    # (the same for every draw), so SR is unbiased on every element, each block's largest included.
    sr = quantize(x, name, stochastic=True, generator=g)
    elem, descale = sr.fmt.elem, sr.block_descale()
    descale = descale.repeat_interleave(x.shape[1] // descale.shape[1], dim=1)
    v = (x / descale).abs()
    exp = torch.clamp(torch.floor(torch.log2(v)), min=1 - elem.bias) - elem.mantissa_bits
    ulp = torch.exp2(exp)
    p = v / ulp - torch.floor(v / ulp)
    step = ulp * descale
    expected_se = step * torch.sqrt(p * (1 - p) / len(draws))
    bias = (draws.mean(0) - x).abs()
    bound = 5 * expected_se + step / len(draws) + 1e-7  # the last terms: a value one draw in 1000 moves
    assert (bias <= bound).all()
    assert (nearest.dequantize() - x).abs().mean() > 3 * bias.mean()  # nearest is biased
    assert draws.unique(dim=0).shape[0] > 1  # it is really random


def test_stochastic_rounding_is_reproducible_from_its_generator() -> None:
    x = torch.randn(8, 32)
    a = quantize(x, "nvfp4", stochastic=True, generator=torch.Generator().manual_seed(3))
    b = quantize(x, "nvfp4", stochastic=True, generator=torch.Generator().manual_seed(3))
    c = quantize(x, "nvfp4", stochastic=True, generator=torch.Generator().manual_seed(4))
    assert torch.equal(a.data, b.data) and not torch.equal(a.data, c.data)


def test_round_to_element_nearest_is_torch_fp8_cast() -> None:
    v = torch.linspace(-448, 448, 20001)
    for elem, dtype in ((lowbit.formats.E4M3, torch.float8_e4m3fn), (lowbit.formats.E5M2, torch.float8_e5m2)):
        w = v.clamp(-elem.max, elem.max)
        assert torch.equal(lowbit.round_to_element(w, elem), w.to(dtype).to(torch.float32))
