"""torchao's per-operand cast configs, per-GEMM configs and ``pad_inner_dim`` on mixprec.float8, each against
torchao.float8's emulated Float8Linear in the same run (bitwise), and the configs torchao refuses refused."""

from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import torch
from torch import nn

from mixprec import float8 as mf

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    tc = pytest.importorskip("torchao.float8.config")
    from torchao.float8.float8_linear import Float8Linear as AoLinear

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
AXS, DIS = "axiswise", "disabled"


def _casts(cast, **fields: dict) -> dict:
    """Config kwargs, each ``cast_config_<name>`` built by ``cast`` (mixprec's or torchao's CastConfig)."""
    out = {}
    for name, spec in fields.items():
        kind = tc.ScalingType if cast is tc.CastConfig else mf.ScalingType
        gran = tc.ScalingGranularity if cast is tc.CastConfig else mf.ScalingGranularity
        out[f"cast_config_{name}"] = cast(
            scaling_type=kind.DISABLED if spec.get("type") == DIS else kind.DYNAMIC,
            scaling_granularity=gran.AXISWISE if spec.get("gran") == AXS else gran.TENSORWISE,
            target_dtype=spec.get("dtype"),
        )
    return out


CASES = {
    "rowwise_e4m3": {n: {"gran": AXS, "dtype": E4M3} for n in ("input", "weight", "grad_output")},
    "rowwise_go_e5m2": {"input": {"gran": AXS}, "weight": {"gran": AXS}, "grad_output": {"gran": AXS}},
    "all_disabled": {n: {"type": DIS} for n in ("input", "weight", "grad_output")},
    "wgrad_hp": {"input_for_grad_weight": {"type": DIS}, "grad_output_for_grad_weight": {"type": DIS}},
    "tensorwise_x_rowwise_w": {"weight": {"gran": AXS}, "grad_output": {"gran": AXS}},
    "dgrad_w_tensorwise": {n: {"gran": AXS} for n in ("input", "weight")} | {"weight_for_grad_input": {}},
}


def _run(module: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:
    x = x.clone().requires_grad_()
    out = module(x)
    out.backward(grad)
    return [out.detach(), x.grad, module.weight.grad]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("pow2", [False, True], ids=["fp32_scales", "pow2_scales"])
@pytest.mark.parametrize("case", list(CASES))
def test_per_operand_casts_equal_torchao_bitwise(case, pow2, dtype) -> None:
    torch.manual_seed(0)
    base = nn.Linear(64, 48, dtype=dtype)
    x, grad = torch.randn(2, 16, 64, dtype=dtype), torch.randn(2, 16, 48, dtype=dtype)
    theirs_config = tc.Float8LinearConfig(
        emulate=True, round_scales_to_power_of_2=pow2, **_casts(tc.CastConfig, **CASES[case])
    )
    theirs = _run(AoLinear.from_float(copy.deepcopy(base), theirs_config), x, grad)
    for cast in (mf.CastConfig, tc.CastConfig):  # mixprec's objects and torchao's own, read by field
        config = mf.Float8Config(emulate=True, round_scales_to_power_of_2=pow2, **_casts(cast, **CASES[case]))
        assert config.lowbit_recipe is not None
        ours = _run(mf.Float8Linear.from_float(copy.deepcopy(base), config), x, grad)
        for name, o, t in zip(("out", "grad_x", "grad_w"), ours, theirs, strict=True):
            assert torch.equal(o, t), (case, cast.__module__, name)


def test_disabled_operands_stay_in_high_precision() -> None:
    torch.manual_seed(0)
    base = nn.Linear(32, 16)
    x = torch.randn(8, 32)
    config = mf.Float8Config(**_casts(mf.CastConfig, **CASES["all_disabled"]))
    out = mf.Float8Linear.from_float(copy.deepcopy(base), config)(x)
    assert torch.equal(out, torch.mm(x, base.weight.t()) + base.bias)  # no fp8 rounding anywhere


def test_recipes_resolve_to_torchaos_casts_and_repr() -> None:
    for name in ("tensorwise", "rowwise", "rowwise_with_gw_hp"):
        ours, theirs = mf.Float8Config.from_recipe_name(name), tc.Float8LinearConfig.from_recipe_name(name)
        for field in (f.name for f in dataclasses.fields(theirs) if f.name.startswith("cast_config")):
            mine, ao = getattr(ours, field), getattr(theirs, field)
            assert (mine.scaling_type.value, mine.scaling_granularity.value, mine.target_dtype) == (
                ao.scaling_type.value,
                ao.scaling_granularity.value,
                ao.target_dtype,
            ), (name, field)
        ao_repr = repr(AoLinear.from_float(nn.Linear(4, 4), theirs))
        ao_casts = ao_repr.split("cast_configs=")[1].split('"')[0]
        assert f"cast_configs={ao_casts}," in repr(mf.Float8Linear.from_float(nn.Linear(4, 4), ours))
    assert mf.Float8LinearConfig is mf.Float8Config


def test_gemm_configs_are_recorded_as_torchao_records_them() -> None:
    for emulate in (False, True):
        for kwargs in ({}, {"pad_inner_dim": True, "gemm_config_grad_weight": mf.Float8GemmConfig(True)}):
            ours = mf.Float8Linear(8, 8, config=mf.Float8Config(emulate=emulate, **kwargs))
            ao_kwargs = {
                k: tc.Float8GemmConfig(v.use_fast_accum) if k.startswith("gemm") else v
                for k, v in kwargs.items()
            }
            theirs = AoLinear(8, 8, config=tc.Float8LinearConfig(emulate=emulate, **ao_kwargs))
            assert tuple(map(tuple, ours.linear_mm_config)) == tuple(map(tuple, theirs.linear_mm_config))


def _three(
    config: mf.Float8Config, base: nn.Linear, x: torch.Tensor, grad: torch.Tensor
) -> list[torch.Tensor]:
    return _run(mf.Float8Linear.from_float(copy.deepcopy(base), config), x, grad)


@pytest.mark.parametrize("emulate", [True, False], ids=["emulated", "scaled_mm"])
def test_use_fast_accum_has_no_effect_on_a_cpu(emulate) -> None:
    torch.manual_seed(0)
    base, x, grad = nn.Linear(64, 48), torch.randn(32, 64), torch.randn(32, 48)
    runs = []
    for fast in (False, True):
        gemms = {
            f"gemm_config_{g}": mf.Float8GemmConfig(fast) for g in ("output", "grad_input", "grad_weight")
        }
        runs.append(_three(mf.Float8Config(emulate=emulate, **gemms), base, x, grad))
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


@pytest.mark.parametrize("emulate", [True, False], ids=["emulated", "scaled_mm"])
def test_pad_inner_dim_pads_k_and_changes_nothing(emulate, monkeypatch) -> None:
    torch.manual_seed(0)
    base, x, grad = nn.Linear(41, 24), torch.randn(16, 41), torch.randn(16, 24)  # K = 41, M = 16, N = 24
    plain = _three(mf.Float8Config(emulate=emulate), base, x, grad)
    inner = []
    real_mm = torch.mm if emulate else torch._scaled_mm
    monkeypatch.setattr(
        torch,
        "mm" if emulate else "_scaled_mm",
        lambda a, b, **k: inner.append(a.shape[1]) or real_mm(a, b, **k),
    )
    padded = _three(mf.Float8Config(emulate=emulate, pad_inner_dim=True), base, x, grad)
    monkeypatch.undo()
    assert inner == [48, 32, 16]  # each GEMM's reduction dim (K, N, M) padded to a multiple of 16
    assert all(torch.equal(a, b) for a, b in zip(plain, padded, strict=True))
    if emulate:
        theirs = _run(AoLinear.from_float(copy.deepcopy(base), tc.Float8LinearConfig(emulate=True)), x, grad)
        assert all(torch.equal(a, b) for a, b in zip(padded, theirs, strict=True))


def test_configs_torchao_refuses_are_refused_with_assertion_and_value_errors() -> None:
    dis, dyn = mf.CastConfig(scaling_type="disabled"), mf.CastConfig()
    cases = [
        ({"cast_config_input": dis, "cast_config_weight": dyn}, "incompatible operand precision for output"),
        ({"cast_config_grad_output_for_grad_weight": dis}, "incompatible operand precision for grad_weight"),
        ({"cast_config_weight_for_grad_input": mf.CastConfig(target_dtype=E5M2)}, "weight must be cast to"),
    ]
    for kwargs, message in cases:
        for error in (AssertionError, ValueError):
            with pytest.raises(error, match=message):
                mf.Float8Config(**kwargs)
    with pytest.raises(AssertionError, match="only dynamic scaling type is supported for axiswise"):
        mf.CastConfig(
            scaling_type=mf.ScalingType.DISABLED, scaling_granularity=mf.ScalingGranularity.AXISWISE
        )
    with pytest.raises(AssertionError, match="recipe_name must be one of"):
        mf.Float8Config.from_recipe_name("columnwise")


@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        ("e4m3", torch.float8_e4m3fn),
        ("float8_e5m2", torch.float8_e5m2),
        ("torch.float8_e4m3fnuz", torch.float8_e4m3fnuz),
        (" E5M2FNUZ ", torch.float8_e5m2fnuz),
    ],
)
def test_target_dtype_takes_a_name_as_its_dtype(name: str, dtype: torch.dtype) -> None:
    by_name, by_dtype = mf.CastConfig(target_dtype=name), mf.CastConfig(target_dtype=dtype)
    assert by_name.target_dtype is dtype
    assert by_name == by_dtype and hash(by_name) == hash(by_dtype)  # one config, however it was spelled


@pytest.mark.parametrize("bad", ["bf16", "e4m3x", "fp8"])
def test_target_dtype_name_that_is_not_an_fp8_dtype_refused(bad: str) -> None:
    with pytest.raises(ValueError, match=rf"or a name of one \('e4m3', 'e5m2', .*got '{bad}'"):
        mf.CastConfig(target_dtype=bad)


def test_bad_values_name_the_field_and_what_it_accepts() -> None:
    with pytest.raises(
        ValueError,
        match=r"scaling_type must be one of ScalingType.DYNAMIC, ScalingType.DISABLED; got 'static'",
    ):
        mf.CastConfig(scaling_type="static")
    with pytest.raises(
        ValueError,
        match="target_dtype must be None or one of torch.float8_e4m3fn, torch.float8_e5m2, "
        "torch.float8_e4m3fnuz, torch.float8_e5m2fnuz; got torch.float16",
    ):
        mf.CastConfig(target_dtype=torch.float16)
    with pytest.raises(TypeError, match="cast_config_input must be a mixprec.float8.CastConfig, got str"):
        mf.Float8Config(cast_config_input="dynamic")
    with pytest.raises(TypeError, match="use_fast_accum must be a bool, got 1"):
        mf.Float8GemmConfig(1)
    with pytest.raises(TypeError, match="gemm_config_output must be a mixprec.float8.Float8GemmConfig"):
        mf.Float8Config(gemm_config_output=True)
    with pytest.raises(TypeError, match="pad_inner_dim must be a bool"):
        mf.Float8Config(pad_inner_dim="yes")
    with pytest.raises(
        ValueError, match="scaling='delayed' needs 'tensorwise' and every cast dynamic tensorwise"
    ):
        mf.Float8Config(scaling="delayed", cast_config_weight=mf.CastConfig(scaling_granularity="axiswise"))
    with pytest.raises(ValueError, match="margin=2 applies to the tensorwise casts only"):
        mf.Float8Config.from_recipe_name("rowwise", margin=2)


def test_a_torchao_cast_config_is_read_not_changed() -> None:
    theirs = tc.CastConfig(scaling_granularity=tc.ScalingGranularity.AXISWISE)
    config = mf.Float8Config(cast_config_input=theirs, cast_config_weight=theirs)
    assert theirs.target_dtype is None  # torchao's own config would have written e4m3 into it
    assert config.cast_config_input == mf.CastConfig(scaling_granularity="axiswise", target_dtype=E4M3)
    assert config.cast_config_input_for_grad_weight == config.cast_config_input  # second use from the first
    assert hash(config) == hash(mf.Float8Config(cast_config_input=theirs, cast_config_weight=theirs))
    assert (
        config.short_str() == "casts"
        and mf.Float8Config.from_recipe_name("rowwise").short_str() == "rowwise,pow2"
    )


def test_a_per_operand_config_compiles_in_one_graph_and_matches_eager() -> None:
    torch.manual_seed(0)
    config = mf.Float8Config(emulate=True, **_casts(mf.CastConfig, **CASES["dgrad_w_tensorwise"]))
    base, x, grad = nn.Linear(32, 16), torch.randn(8, 32), torch.randn(8, 16)
    eager = mf.Float8Linear.from_float(copy.deepcopy(base), config)
    compiled = torch.compile(
        mf.Float8Linear.from_float(copy.deepcopy(base), config), backend="aot_eager", fullgraph=True
    )
    for name, a, b in zip(
        ("out", "grad_x", "grad_w"), _run(eager, x, grad), _run(compiled, x, grad), strict=True
    ):
        assert torch.equal(a, b), name
