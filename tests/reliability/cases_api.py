"""Battery cases for formats, Policy, distributed, autocast and mixprec.inspect."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Any

import torch

import mixprec
import mixprec.inspect as mi
from mixprec import formats

from .battery import BAD_INPUT, Case
from .cases_scaler_state import check_roundtrip


def _c(case_id: str, call: Any, names: tuple[str, ...], owner: str, **kw: Any) -> Case:
    return Case(case_id, lambda _: call(), names=names, owner=owner, **kw)


def format_cases() -> list[Case]:
    fp16 = formats.FP16
    calls = [
        ("formats.get(3)", lambda: formats.get(3), ("spec",)),
        ("formats.get(None)", lambda: formats.get(None), ("spec",)),
        ("formats.get('fp17')", lambda: formats.get("fp17"), ("fp17",)),
        ("formats.get('')", lambda: formats.get(""), ("format",)),
        ("formats.get(torch.int32)", lambda: formats.get(torch.int32), ("int32",)),
        ("max_safe_scale(nan)", lambda: formats.max_safe_scale(math.nan), ("amax",)),
        ("max_safe_scale(inf)", lambda: formats.max_safe_scale(math.inf), ("amax",)),
        ("max_safe_scale(-1)", lambda: formats.max_safe_scale(-1.0), ("amax",)),
        ("max_safe_scale('x')", lambda: formats.max_safe_scale("x"), ("amax",)),
        ("max_safe_scale(None)", lambda: formats.max_safe_scale(None), ("amax",)),
        ("max_safe_scale(fmt='fp17')", lambda: formats.max_safe_scale(1.0, "fp17"), ("fp17",)),
        ("max_safe_scale(margin=0.5)", lambda: formats.max_safe_scale(1.0, margin=0.5), ("margin",)),
        ("max_safe_scale(margin=nan)", lambda: formats.max_safe_scale(1.0, margin=math.nan), ("margin",)),
        ("max_safe_scale(margin=inf)", lambda: formats.max_safe_scale(1.0, margin=math.inf), ("margin",)),
        ("max_safe_scale(margin='x')", lambda: formats.max_safe_scale(1.0, margin="x"), ("margin",)),
        ("Format(exponent_bits=0)", lambda: formats.Format("x", 0, 3), ("exponent_bits",)),
        ("Format(exponent_bits=-1)", lambda: formats.Format("x", -1, 3), ("exponent_bits",)),
        ("Format(exponent_bits=5.5)", lambda: formats.Format("x", 5.5, 3), ("exponent_bits",)),
        ("Format(mantissa_bits=-2)", lambda: formats.Format("x", 5, -2), ("mantissa_bits",)),
        ("Format(max_override=-1)", lambda: formats.Format("x", 5, 2, max_override=-1.0), ("max_override",)),
        ("Format(name=3)", lambda: formats.Format(3, 5, 2), ("name",)),
        (
            "Format(torch_dtype_name=3)",
            lambda: formats.Format("x", 5, 2, torch_dtype_name=3),
            ("torch_dtype_name",),
        ),
        ("FP16.overflows('x')", lambda: fp16.overflows("x"), ("value",)),
        ("FP16.overflows(None)", lambda: fp16.overflows(None), ("value",)),
        ("FP16.overflows(1, scale=nan)", lambda: fp16.overflows(1.0, scale=math.nan), ("scale",)),
        ("FP16.overflows(1, scale=-1)", lambda: fp16.overflows(1.0, scale=-1.0), ("scale",)),
        ("FP16.underflows('x')", lambda: fp16.underflows("x"), ("value",)),
        ("FP16.underflows(1, scale=nan)", lambda: fp16.underflows(1.0, scale=math.nan), ("scale",)),
        ("FP16.underflows(1, scale='2')", lambda: fp16.underflows(1.0, scale="2"), ("scale",)),
        ("FP16.is_subnormal([1])", lambda: fp16.is_subnormal([1.0]), ("value",)),
        ("FP16.is_subnormal(1, scale=-1)", lambda: fp16.is_subnormal(1.0, scale=-1.0), ("scale",)),
    ]
    return [_c(i, f, n, "formats") for i, f, n in calls]


def policy_cases() -> list[Case]:
    P = mixprec.Policy
    calls = [
        ("Policy(compute_dtype='fp17')", lambda: P(compute_dtype="fp17"), ("compute_dtype",)),
        ("Policy(compute_dtype=torch.int32)", lambda: P(compute_dtype=torch.int32), ("compute_dtype",)),
        ("Policy(param_dtype=3)", lambda: P(param_dtype=3), ("param_dtype",)),
        ("Policy(output_dtype=None)", lambda: P(output_dtype=None), ("output_dtype",)),
        ("Policy(device_type='gpu')", lambda: P(device_type="gpu"), ("device_type",)),
        ("Policy(device_type=3)", lambda: P(device_type=3), ("device_type",)),
        ("Policy(op_overrides='x')", lambda: P(op_overrides="x"), ("op_overrides",)),
        (
            "Policy(op_overrides=((matmul, bogus),))",
            lambda: P(op_overrides=(("matmul", "bogus"),)),
            ("bogus",),
        ),
        (
            "Policy(op_overrides=((notanop, fp32),))",
            lambda: P(op_overrides=(("notanop", "fp32"),)),
            ("notanop",),
        ),
        ("Policy(module_overrides='x')", lambda: P(module_overrides="x"), ("module_overrides",)),
        ("Policy(module_overrides=((lin, 3),))", lambda: P(module_overrides=(("lin", 3),)), ("lin",)),
        ("Policy.parse(3)", lambda: P.parse(3), ("str",)),
        ("Policy.parse('bogus')", lambda: P.parse("bogus"), ("bogus",)),
        ("Policy.parse('compute=fp17')", lambda: P.parse("compute=fp17"), ("fp17",)),
        ("Policy.parse('lower+=notanop')", lambda: P.parse("lower+=notanop"), ("notanop",)),
        ("Policy.parse('x=1')", lambda: P.parse("x=1"), ("x",)),
        ("Policy.parse('compute=bf16', device_type='gpu')", lambda: P.parse("compute=bf16", "gpu"), ("gpu",)),
        ("Policy.preset(3)", lambda: P.preset(3), ("name",)),
        ("Policy.preset('bogus')", lambda: P.preset("bogus"), ("bogus",)),
        ("Policy.for_device('gpu')", lambda: P.for_device("gpu"), ("gpu",)),
        ("Policy.for_device(3)", lambda: P.for_device(3), ("device_type",)),
        ("Policy.for_device('cpu', torch.int32)", lambda: P.for_device("cpu", torch.int32), ("dtype",)),
        ("Policy.with_ops(lower=['notanop'])", lambda: P().with_ops(lower=["notanop"]), ("notanop",)),
        ("Policy.with_ops(lower=[3])", lambda: P().with_ops(lower=[3]), ("op",)),
        ("Policy.with_ops(lower=3)", lambda: P().with_ops(lower=3), ("lower",)),
        (
            "Policy.with_ops(matmul twice)",
            lambda: P().with_ops(lower=["matmul"], fp32=["matmul"]),
            ("matmul",),
        ),
        ("Policy.with_modules('x')", lambda: P().with_modules("x"), ("mapping",)),
        ("Policy.with_modules({lin: 3})", lambda: P().with_modules({"lin": 3}), ("lin",)),
        ("Policy.with_modules({3: float32})", lambda: P().with_modules({3: torch.float32}), ("3",)),
        ("Policy.with_dtypes(compute='fp17')", lambda: P().with_dtypes(compute="fp17"), ("compute",)),
        ("Policy.with_dtypes(params=3)", lambda: P().with_dtypes(params=3), ("param",)),
        ("Policy.category('notanop')", lambda: P().category("notanop"), ("notanop",)),
        ("Policy.resolve('gpu')", lambda: P().resolve("gpu"), ("gpu",)),
        ("Policy.ops('gpu')", lambda: P().ops("gpu"), ("gpu",)),
    ]
    cases = [_c(i, f, n, "policy") for i, f, n in calls]
    cases.append(
        Case(
            "deepcopy/pickle Policy",
            lambda p: check_roundtrip(p, str),
            setup=lambda: mixprec.Policy.parse("compute=bf16,fp32+=gelu"),
            roundtrip=True,
            owner="policy",
        )
    )
    return cases


def distributed_cases() -> list[Case]:
    d = mixprec.distributed
    calls = [
        ("compression_hook('fp32')", lambda: d.compression_hook("fp32"), ("format",)),
        ("compression_hook(None)", lambda: d.compression_hook(None), ("format",)),
        ("compression_hook(['fp16'])", lambda: d.compression_hook(["fp16"]), ("format",)),
        ("replicas_identical(3)", lambda: d.replicas_identical(3), ("tensors",)),
        ("replicas_identical('x')", lambda: d.replicas_identical("x"), ("tensors",)),
        (
            "replicas_identical([tensor, 'x'])",
            lambda: d.replicas_identical([torch.ones(2), "x"]),
            ("tensors",),
        ),
    ]
    return [_c(i, f, n, "distributed") for i, f, n in calls]


def autocast_cases() -> list[Case]:
    ac = mixprec.autocast
    calls = [
        ("autocast('gpu')", lambda: ac("gpu"), ("gpu",)),
        ("autocast(3)", lambda: ac(3), ("device_type",)),
        ("autocast(dtype='fp17')", lambda: ac("cpu", dtype="fp17"), ("dtype",)),
        ("autocast(dtype=torch.int32)", lambda: ac("cpu", dtype=torch.int32), ("dtype",)),
        ("autocast(enabled='yes')", lambda: ac("cpu", enabled="yes"), ("enabled",)),
        ("autocast(cache_enabled='x')", lambda: ac("cpu", cache_enabled="x"), ("cache_enabled",)),
        ("autocast(policy='bogus')", lambda: ac("cpu", policy="bogus"), ("bogus",)),
        ("autocast(policy=3)", lambda: ac("cpu", policy=3), ("policy",)),
        ("custom_fwd(device_type='gpu')", lambda: mixprec.custom_fwd(device_type="gpu"), ("gpu",)),
        ("custom_fwd(cast_inputs='fp17')", lambda: mixprec.custom_fwd(cast_inputs="fp17"), ("cast_inputs",)),
        ("custom_bwd(device_type=3)", lambda: mixprec.custom_bwd(device_type=3), ("device_type",)),
        ("checkpoint(3)", lambda: mixprec.checkpoint(3), ("function",)),
        ("get_autocast_dtype('gpu')", lambda: mixprec.get_autocast_dtype("gpu"), ("gpu",)),
        ("get_autocast_dtype(3)", lambda: mixprec.get_autocast_dtype(3), ("device_type",)),
        ("is_autocast_enabled('gpu')", lambda: mixprec.is_autocast_enabled("gpu"), ("gpu",)),
    ]
    return [_c(i, f, n, "engine") for i, f, n in calls]


def _model() -> dict[str, Any]:
    torch.manual_seed(0)
    return {
        "model": torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1)),
        "x": torch.randn(2, 4),
    }


def _loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).sum()


def inspect_cases() -> list[Case]:
    def on_model(
        case_id: str, call: Any, names: tuple[str, ...], owner: str, raises: Any = BAD_INPUT
    ) -> Case:
        return Case(
            case_id, call, names=names, setup=_model, target=lambda c: c["model"], owner=owner, raises=raises
        )

    fn, ur = mi.find_nonfinite, mi.underflow_report
    nonfinite = [
        ("find_nonfinite('m', x)", lambda c: fn("m", c["x"]), ("model",)),
        ("find_nonfinite(loss_fn=3)", lambda c: fn(c["model"], c["x"], loss_fn=3), ("loss_fn",)),
        ("find_nonfinite(dtype='fp17')", lambda c: fn(c["model"], c["x"], dtype="fp17"), ("dtype",)),
        (
            "find_nonfinite(dtype=torch.int32)",
            lambda c: fn(c["model"], c["x"], dtype=torch.int32),
            ("dtype",),
        ),
        ("find_nonfinite(device_type='gpu')", lambda c: fn(c["model"], c["x"], device_type="gpu"), ("gpu",)),
        ("find_nonfinite(policy='bogus')", lambda c: fn(c["model"], c["x"], policy="bogus"), ("bogus",)),
        ("find_nonfinite(policy=3)", lambda c: fn(c["model"], c["x"], policy=3), ("policy",)),
        (
            "find_nonfinite(loss_fn -> float)",
            lambda c: fn(c["model"], c["x"], loss_fn=lambda m, x: 1.0),
            ("loss_fn",),
        ),
        ("grad_amax(3)", lambda c: mi.grad_amax(3), ("source",)),
        (
            "grad_amax(model, model='x')",
            lambda c: mi.grad_amax(torch.optim.SGD(c["model"].parameters()), model="x"),
            ("model",),
        ),
        ("nonfinite_params(3)", lambda c: mi.nonfinite_params(3), ("source",)),
        ("nonfinite_params(['x'])", lambda c: mi.nonfinite_params(["x"]), ("source",)),
    ]
    others = [
        ("underflow_report(loss_fn=None)", lambda c: ur(c["model"], c["x"], loss_fn=None), ("loss_fn",)),
        (
            "underflow_report(dtype='fp17')",
            lambda c: ur(c["model"], c["x"], loss_fn=_loss, dtype="fp17"),
            ("fp17",),
        ),
        (
            "underflow_report(scale=nan)",
            lambda c: ur(c["model"], c["x"], loss_fn=_loss, scale=math.nan),
            ("scale",),
        ),
        ("underflow_report(scale=0)", lambda c: ur(c["model"], c["x"], loss_fn=_loss, scale=0.0), ("scale",)),
        (
            "underflow_report(scale='2')",
            lambda c: ur(c["model"], c["x"], loss_fn=_loss, scale="2"),
            ("scale",),
        ),
        (
            "underflow_report(target=nan)",
            lambda c: ur(c["model"], c["x"], loss_fn=_loss, target=math.nan),
            ("target",),
        ),
        (
            "underflow_report(target=2)",
            lambda c: ur(c["model"], c["x"], loss_fn=_loss, target=2.0),
            ("target",),
        ),
        (
            "underflow_report(margin=0.5)",
            lambda c: ur(c["model"], c["x"], loss_fn=_loss, margin=0.5),
            ("margin",),
        ),
        ("trace_dtypes('x')", lambda c: mi.trace_dtypes("x"), ("model",)),
        ("ScalerLog('x')", lambda c: mi.ScalerLog("x"), ("scaler",)),
        (
            "ScalerLog(histogram_every=-1)",
            lambda c: mi.ScalerLog(mixprec.GradScaler(), histogram_every=-1),
            ("histogram_every",),
        ),
        (
            "ScalerLog(optimizer='x')",
            lambda c: mi.ScalerLog(mixprec.GradScaler(), optimizer="x"),
            ("optimizer",),
        ),
        ("load_log(3)", lambda c: mi.load_log(3), ("path",)),
        (
            "load_log(missing file)",
            lambda c: mi.load_log("/nonexistent/log.jsonl"),
            ("nonexistent",),
            (OSError,),
        ),
        ("plot_scale_history('x')", lambda c: mi.plot_scale_history("x", _tmp("a.png")), ("records",)),
        ("plot_scale_history([{}])", lambda c: mi.plot_scale_history([{}], _tmp("b.png")), ("scale",)),
        ("plot_underflow('x')", lambda c: mi.plot_underflow("x", _tmp("c.png")), ("reports",)),
        ("plot_gradient_histogram(3)", lambda c: mi.plot_gradient_histogram(3, _tmp("d.png")), ("source",)),
        (
            "plot_gradient_histogram(formats_shown=['fp17'])",
            lambda c: mi.plot_gradient_histogram(mi.Log2Histogram(), _tmp("e.png"), formats_shown=["fp17"]),
            ("fp17",),
        ),
    ]
    cases = [on_model(i, f, n, "inspect") for i, f, n in nonfinite]
    return cases + [on_model(r[0], r[1], r[2], "inspect-other", *r[3:]) for r in others]


def _tmp(name: str) -> Path:
    return Path(tempfile.mkdtemp(prefix="mixprec-battery-")) / name


def cases() -> list[Case]:
    """Every formats/policy/distributed/autocast/inspect case."""
    return format_cases() + policy_cases() + distributed_cases() + autocast_cases() + inspect_cases()
