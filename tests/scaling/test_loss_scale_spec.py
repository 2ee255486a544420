"""Every entry point that takes a loss scale by value reads it through mixprec.scaling.resolve_scaler:
the same specs give the same scaler, the same bad specs the same error, and a refusal changes nothing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mixprec
from mixprec.apex import FP16_Optimizer, amp
from mixprec.optim import MixedPrecisionOptimizer
from mixprec.scaling import GradScaler, resolve_scaler
from mixprec.scaling.spec import ACCEPTED_LOSS_SCALES


def model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def via_resolve(spec):
    return resolve_scaler(spec, "cpu")


def via_optimizer(spec):
    _, opt = model_and_optimizer()
    return MixedPrecisionOptimizer(opt, scaler=spec).scaler


def via_initialize(spec):
    model, opt = model_and_optimizer()
    return mixprec.initialize(model, opt, "O2", loss_scale=spec)[1].scaler


def via_apex_amp(spec):
    model, opt = model_and_optimizer()
    return amp.initialize(model, opt, opt_level="O2", loss_scale=spec, max_loss_scale=None)[1].scaler


def via_apex_fp16_optimizer(spec):
    _, opt = model_and_optimizer()
    return FP16_Optimizer(opt, static_loss_scale=spec).scaler


ENTRY_POINTS = [via_resolve, via_optimizer, via_initialize, via_apex_amp, via_apex_fp16_optimizer]
READY = GradScaler("cpu", init_scale=512.0)
TORCH_READY = torch.amp.GradScaler("cpu", init_scale=256.0)


def summary(scaler) -> tuple:
    rule = getattr(scaler, "rule", None)
    return type(scaler).__name__, scaler.is_enabled(), scaler.get_scale(), type(rule).__name__


@pytest.mark.parametrize("spec", [None, "dynamic", 128.0, 3, 1, 1.0, READY, TORCH_READY], ids=repr)
@pytest.mark.parametrize("entry", ENTRY_POINTS, ids=lambda f: f.__name__)
def test_every_entry_point_builds_the_same_scaler_from_a_spec(entry, spec) -> None:
    if entry is via_apex_amp and spec is None:
        pytest.skip("apex's loss_scale=None means the level's default, not 'no scaling' (apex's meaning)")
    built = entry(spec)
    assert summary(built) == summary(resolve_scaler(spec, "cpu"))
    if spec is READY or spec is TORCH_READY:
        assert built is spec


BAD = ["dynamc", "Dynamic", -1.0, 0, float("inf"), float("nan"), True, [128.0], object()]


@pytest.mark.parametrize("spec", BAD, ids=repr)
def test_every_entry_point_refuses_a_bad_spec_with_the_same_message(spec) -> None:
    messages = set()
    for entry in ENTRY_POINTS:
        with pytest.raises(ValueError, match="unknown loss scale") as info:
            entry(spec)
        messages.add(str(info.value))
    assert messages == {f"loss_scale: unknown loss scale {spec!r}; accepted: {ACCEPTED_LOSS_SCALES}"}


@pytest.mark.parametrize("initialize", [mixprec.initialize, amp.initialize], ids=["mixprec", "apex"])
def test_a_refused_spec_leaves_model_and_optimizer_unchanged(initialize) -> None:
    model, opt = model_and_optimizer()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="accepted: None"):
        initialize(model, opt, opt_level="O2", loss_scale="dynamc")
    assert "forward" not in model.__dict__  # not wrapped
    after = list(model.parameters())
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(before, after, strict=True))
    _, wrapped = initialize(model, opt, opt_level="O2", loss_scale=64.0)  # a corrected retry works
    assert wrapped.loss_scale == 64.0


def test_apex_spellings_translate_into_the_spec() -> None:
    # apex parses its options from text: "128.0" is the number; "dynamic" and numbers pass unchanged.
    assert via_apex_amp("128.0").get_scale() == 128.0
    assert via_apex_fp16_optimizer("128").get_scale() == 128.0
    with pytest.raises(ValueError, match=r"unknown loss scale -1\.0; accepted: None"):
        via_apex_amp("-1")


def test_bounds_apply_to_dynamic_scaling_only_at_every_entry_point() -> None:
    with pytest.raises(ValueError, match="'dynamic' scaling only"):
        resolve_scaler(128.0, "cpu", min_scale=1.0)
    model, opt = model_and_optimizer()
    with pytest.raises(ValueError, match="'dynamic' scaling only"):
        mixprec.initialize(model, opt, "O2", loss_scale=128.0, min_loss_scale=1.0)
    model, opt = model_and_optimizer()
    _, wrapped = mixprec.initialize(model, opt, "O2", loss_scale="dynamic", max_loss_scale=1024.0)
    assert wrapped.loss_scale == 1024.0
