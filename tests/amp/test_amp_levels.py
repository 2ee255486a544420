"""initialize(): the O0-O3 table, presets, overrides, model conversion and misuse errors."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

from mixprec.amp import OPT_LEVELS, PRESETS, cast_model, initialize, resolve_level
from mixprec.optim import CompensatedOptimizer, MixedPrecisionOptimizer


def bn_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def prepare(opt_level="O2", **kwargs):
    model = bn_model()
    return initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level, **kwargs)


def test_table_is_data_and_presets_name_levels():
    assert list(OPT_LEVELS) == ["O0", "O1", "O2", "O3"]
    assert {level for level, _, _ in PRESETS.values()} <= set(OPT_LEVELS)
    assert set(PRESETS) == {"32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true"}


def test_o2_casts_the_model_keeps_batchnorm_fp32_and_returns_fp32():
    model, opt = prepare("O2")
    assert model[0].weight.dtype == model[3].weight.dtype == torch.bfloat16  # CPU default
    assert model[1].weight.dtype == model[1].running_mean.dtype == torch.float32
    assert isinstance(opt, MixedPrecisionOptimizer) and len(opt.master_params) == 4
    assert all(p.dtype == torch.float32 for g in opt.param_groups for p in g["params"])
    out = model(torch.randn(6, 4))  # fp32 input is cast on entry
    assert out.dtype == torch.float32
    opt.zero_grad()
    opt.backward(out.square().mean())
    opt.step()
    assert model[1].weight.grad.dtype == torch.float32


def test_overrides_replace_table_cells():
    model, opt = prepare("O2", keep_batchnorm_fp32=False, master_weights=False, loss_scale=64.0)
    assert model[1].weight.dtype == torch.bfloat16
    assert opt.master_params == [] and opt.loss_scale == 64.0
    model, _ = prepare("O2", outputs_fp32=False)
    assert model(torch.randn(2, 4)).dtype == torch.bfloat16


def test_inputs_cast_recursively_and_integers_untouched():
    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(1))

        def forward(self, pair, *, extra):
            return {"x": pair[0], "ids": pair[1], "extra": extra}

    probe = Probe()
    model, _ = initialize(probe, torch.optim.SGD(probe.parameters(), lr=0.1), "O3")
    out = model((torch.randn(2), torch.arange(3)), extra=[torch.randn(2)])
    assert out["x"].dtype == torch.bfloat16 and out["extra"][0].dtype == torch.bfloat16
    assert out["ids"].dtype == torch.int64


def test_o3_is_pure_half_without_masters_at_static_scale_one():
    model, opt = prepare("O3")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert opt.master_params == [] and opt.loss_scale == 1.0
    assert model(torch.randn(2, 4)).dtype == torch.bfloat16


def test_o0_changes_nothing_and_still_has_the_optimizer_api():
    model, opt = prepare("O0")
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert not opt.scaler.is_enabled()
    opt.zero_grad()
    opt.backward(model(torch.randn(4, 4)).square().mean())
    opt.step()
    assert isinstance(opt.state_dict(), dict)


def test_presets():
    assert resolve_level("bf16-mixed", None, "cuda") == (
        dataclasses.replace(OPT_LEVELS["O1"], loss_scale=1.0),  # no scaling, but inf/nan steps skip
        torch.bfloat16,
    )
    level, dtype = resolve_level("16-mixed", None, "cpu")
    assert dtype == torch.float16 and level.loss_scale == "dynamic" and level.autocast
    level, dtype = resolve_level("bf16-true", None, "cpu")
    assert level.cast_model and not level.master_weights and level.loss_scale == 1.0
    assert resolve_level("32-true", None, "cpu")[0] == OPT_LEVELS["O0"]
    model, opt = prepare("bf16-true")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters()) and opt.master_params == []


def test_default_dtype_per_device_and_explicit_dtypes():
    assert resolve_level("O2", None, "cuda")[1] == torch.float16
    assert resolve_level("O2", None, "cpu")[1] == torch.bfloat16
    assert resolve_level("O2", "fp16", "cpu")[1] == torch.float16
    with pytest.raises(ValueError, match="half-precision type, got torch.float32"):
        resolve_level("O2", torch.float32, "cpu")


def test_unknown_level_lists_o0_to_o3():
    with pytest.raises(ValueError, match=r"unknown opt_level 'O4'.*accepted: O0, O1, O2, O3"):
        resolve_level("O4", None, "cpu")
    with pytest.raises(ValueError, match="did you mean 'bf16-mixed'"):
        resolve_level("bf16_mixed", None, "cpu")
    for spelling, name in (("fp16-mixed", "16-mixed"), ("fp16-true", "16-true")):  # Lightning's names only
        with pytest.raises(ValueError, match=rf"'{spelling}' \(did you mean '{name}'\?\); accepted: O0"):
            resolve_level(spelling, None, "cpu")


def test_unknown_override_is_named_with_a_suggestion():
    with pytest.raises(TypeError, match=r"\['keep_batchnorm_fp23'\] \(did you mean 'keep_batchnorm_fp32'"):
        resolve_level("O2", None, "cpu", keep_batchnorm_fp23=True)


def test_contradicting_overrides_are_errors_and_leave_the_model_alone():
    model = bn_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cases = [
        ({"opt_level": "O1", "keep_batchnorm_fp32": True}, "applies to levels that cast the model"),
        ({"opt_level": "O2", "weight_update": "kahan"}, "has none to compensate"),
        ({"opt_level": "bf16-true", "weight_update": "round"}, "accepted: \\['nearest', 'kahan'"),
        ({"opt_level": "O2", "loss_scale": "dynamc"}, "unknown loss scale 'dynamc'"),
        ({"opt_level": "16-true", "weight_update": "stochastic"}, "rounds to bfloat16 only"),
        ({"opt_level": "O2", "loss_scale": 8.0, "max_loss_scale": 16.0}, "'dynamic' scaling only"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            initialize(model, optimizer, **kwargs)
    assert all(p.dtype == torch.float32 for p in model.parameters()) and "forward" not in model.__dict__


def test_dynamic_scale_bounds_reach_the_scaler():
    model, opt = prepare("O2", min_loss_scale=4.0, max_loss_scale=8.0)
    assert opt.loss_scale == 8.0  # the default start, 2**16, clamped into the bounds
    for _ in range(3):
        opt.zero_grad()
        opt.backward(model(torch.randn(4, 4)).sum() * float("inf"))
        opt.step()
    assert opt.loss_scale == 4.0


def test_initializing_twice_is_an_error():
    model, opt = prepare("O2")
    with pytest.raises(RuntimeError, match=r"already prepared by mixprec.initialize \('O2'\)"):
        initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2")
    with pytest.raises(RuntimeError, match="already a MixedPrecisionOptimizer"):
        initialize(bn_model(), opt, "O2")


def test_compensated_weight_updates_compose_under_bf16_true():
    model, opt = prepare("bf16-true", weight_update="stochastic")
    assert isinstance(opt.optimizer, CompensatedOptimizer) and opt.optimizer.method == "stochastic"
    opt.zero_grad()
    opt.backward(model(torch.randn(4, 4)).float().square().mean())
    opt.step()
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


@pytest.mark.parametrize(
    ("dtype", "loss_scale", "scale_after_overflow"),
    [(torch.bfloat16, "dynamic", 2.0**15), (torch.float16, 1.0, 1.0)],  # O3's static 1 takes fp16 grads
)
def test_compensated_weights_under_loss_scaling_skip_overflows(dtype, loss_scale, scale_after_overflow):
    model, opt = prepare("O3", dtype=dtype, weight_update="kahan", loss_scale=loss_scale)
    assert all(p.dtype == dtype for p in model.parameters())
    for blowup in (1.0, float("inf")):
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        opt.backward(model(torch.randn(4, 4)).float().square().mean() * blowup)
        opt.step()
        changed = [not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)]
        assert any(changed) if blowup == 1.0 else not any(changed)
    assert opt.loss_scale == scale_after_overflow


def test_cast_model_keeps_parameter_objects():
    model = bn_model()
    before = list(model.parameters())
    cast_model(model, torch.float16)
    assert all(a is b for a, b in zip(before, model.parameters(), strict=True))


def test_o1_runs_the_forward_under_mixprec_autocast():
    pytest.importorskip("mixprec.autocast", reason="mixprec.autocast is not available yet")
    model, opt = prepare("O1")
    assert all(p.dtype == torch.float32 for p in model.parameters())
    out = model(torch.randn(4, 4))
    assert out.dtype == torch.bfloat16  # Linear runs in the low-precision type under autocast on CPU
    opt.zero_grad()
    opt.backward(out.float().square().mean())
    opt.step()


def test_a_cast_that_would_replace_the_optimizers_params_is_refused():
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        with pytest.raises(RuntimeError, match="overwrite_module_params_on_conversion"):
            prepare("O2")
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(False)


@pytest.mark.parametrize("spelling", ["o2", "02", " o2 "])
def test_a_level_in_another_case_or_with_a_zero_gets_the_exact_hint(spelling):
    # apex refuses anything but the exact "O2" (a dict lookup); mixprec refuses it too, naming the spelling
    model = nn.Sequential(nn.Linear(4, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"did you mean 'O2'\? a level is a capital letter O and a digit"):
        initialize(model, optimizer, opt_level=spelling)
    assert model[0].weight.dtype == torch.float32 and not isinstance(optimizer, MixedPrecisionOptimizer)
    with pytest.raises(ValueError, match=r"'BF16-Mixed' \(did you mean 'bf16-mixed'\?\)"):
        resolve_level("BF16-Mixed", None, "cpu")


def test_a_plain_torch_state_dict_is_refused_saying_how_to_migrate_it():
    torch.manual_seed(0)
    plain_model = nn.Sequential(nn.Linear(4, 4))
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
    plain_model(torch.randn(2, 4)).sum().backward()
    plain.step()
    saved, weights = plain.state_dict(), plain_model.state_dict()

    model = nn.Sequential(nn.Linear(4, 4))
    model.load_state_dict(weights)
    model, optimizer = initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "O2", dtype="bf16")
    before = copy.deepcopy(optimizer.state_dict())
    migrate = r"torch optimizer's own state_dict; to migrate it, load it into the torch optimizer before"
    with pytest.raises(ValueError, match=rf"lacks \['optimizer', 'master_params', 'scaler'\].*{migrate}"):
        optimizer.load_state_dict(saved)
    assert str(optimizer.state_dict()) == str(before)  # refused before anything changed

    # the migration the message gives: load into the torch optimizer, then initialize
    model = nn.Sequential(nn.Linear(4, 4))
    model.load_state_dict(weights)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    inner.load_state_dict(saved)
    model, optimizer = initialize(model, inner, "O2", dtype="bf16")
    moved = optimizer.optimizer.state[optimizer.master_params[0]]
    assert torch.equal(moved["exp_avg"], saved["state"][0]["exp_avg"])
    assert torch.equal(moved["exp_avg_sq"], saved["state"][0]["exp_avg_sq"])


def test_a_compensated_update_takes_a_fresh_adagrad():
    """Adagrad's state made when it is built (``step`` 0) is not a step: ``weight_update="kahan"`` takes it
    (it was refused as "already holds state")."""
    model = bn_model()
    model, opt = initialize(model, torch.optim.Adagrad(model.parameters(), lr=0.1), "bf16-true",
                            weight_update="kahan")  # fmt: skip
    opt.zero_grad()
    opt.backward(model(torch.randn(4, 4).bfloat16()).float().square().mean())
    opt.step()
    assert isinstance(opt.optimizer, CompensatedOptimizer) and opt.optimizer.skipped_steps == 0
