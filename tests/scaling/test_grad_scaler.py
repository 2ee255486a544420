"""GradScaler's torch-compatible API: construction, scale(), the state machine and its errors, fused steps."""

from __future__ import annotations

import collections
import pickle
import warnings

import pytest
import torch

from mixprec.scaling import DynamicScale, GradScaler, GradScalerError, HeadroomScale, StaticScale

from .helpers import assert_untouched, backward, model_and_optimizer, no_host_sync, snapshot

# -- construction -------------------------------------------------------------------------------------


def test_constructor_matches_torch_signature_and_validates():
    scaler = GradScaler(None, 2.0**10, 4.0, 0.25, 7, True)
    assert (scaler.get_scale(), scaler.get_growth_factor(), scaler.get_backoff_factor()) == (
        1024.0,
        4.0,
        0.25,
    )
    assert scaler.get_growth_interval() == 7 and scaler.is_enabled()
    with pytest.raises(ValueError, match="growth_factor must be > 1, got 1.0"):
        GradScaler(growth_factor=1.0)
    with pytest.raises(ValueError, match=r"growth must be one of \['headroom', 'interval'\], got 'headrom'"):
        GradScaler(growth="headrom")
    with pytest.raises(ValueError, match="did you mean 'headroom'"):
        GradScaler(growth="headrom")
    with pytest.raises(ValueError, match=r"pass \['growth_interval'\] to the rule object"):
        GradScaler(rule=StaticScale(8.0), growth_interval=10)
    with pytest.raises(ValueError, match="device must be a torch device"):
        GradScaler("cdua")
    with pytest.raises(ValueError, match="warn_after_skips"):
        GradScaler(warn_after_skips=0)


def test_rule_selection():
    assert isinstance(GradScaler().rule, DynamicScale)
    assert isinstance(GradScaler(growth="headroom").rule, HeadroomScale)
    assert GradScaler(hysteresis=3, min_scale=1.0, max_scale=2.0**20).rule.hysteresis == 3
    with pytest.raises(TypeError, match="this scaler's rule is StaticScale"):
        GradScaler(rule=StaticScale(8.0)).get_growth_factor()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA fallback")
def test_explicit_unavailable_device_disables_with_a_warning_like_torch():
    with pytest.warns(UserWarning, match="cuda is not available. Disabling"):
        scaler = GradScaler("cuda")
    assert not scaler.is_enabled()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert GradScaler("cpu").is_enabled() and GradScaler().is_enabled()


def test_scale_lives_on_the_first_scaled_tensors_device():
    scaler = GradScaler()
    assert scaler.rule.scale is None and scaler.get_scale() == 2.0**16
    scaler.scale(torch.ones(()))
    assert scaler.rule.scale.device == torch.device("cpu") and scaler.rule.scale.dtype == torch.float32


# -- scale() ------------------------------------------------------------------------------------------


def test_scale_maps_nested_outputs_keeping_containers():
    Pair = collections.namedtuple("Pair", "a b")
    scaler = GradScaler(init_scale=4.0)
    half = torch.tensor(0.5)
    outputs = {"loss": torch.tensor(1.0), "parts": [torch.tensor(2.0), (torch.tensor(3.0), Pair(half, half))]}
    scaled = scaler.scale(outputs)
    assert set(scaled) == {"loss", "parts"} and scaled["loss"].item() == 4.0
    assert isinstance(scaled["parts"][1][1], Pair) and scaled["parts"][1][1].b.item() == 2.0
    assert next(iter(scaler.scale(iter([torch.tensor(1.0)])))).item() == 4.0
    theirs = torch.amp.GradScaler("cpu", init_scale=4.0)
    for loss in (torch.tensor(2.0, dtype=torch.bfloat16), torch.ones(2, dtype=torch.bfloat16)):
        assert scaler.scale(loss).dtype == theirs.scale(loss).dtype  # type promotion as in torch
    with pytest.raises(ValueError, match="got str"):
        scaler.scale("loss")
    with pytest.raises(ValueError, match="got int"):
        scaler.scale([torch.tensor(1.0), 3])


# -- the state machine --------------------------------------------------------------------------------


def test_state_machine_errors_match_torch():
    model, optimizer = model_and_optimizer()
    scaler = GradScaler()
    with pytest.raises(AssertionError, match="Attempted step but _scale is None"):
        scaler.step(optimizer)
    with pytest.raises(GradScalerError, match="Attempted unscale_ but _scale is None"):
        scaler.unscale_(optimizer)
    backward(scaler, model)
    with pytest.raises(AssertionError, match="No inf checks were recorded prior to update"):
        scaler.update()
    scaler.unscale_(optimizer)
    with pytest.raises(RuntimeError, match=r"unscale_\(\) has already been called on this optimizer"):
        scaler.unscale_(optimizer)
    scaler.step(optimizer)
    with pytest.raises(RuntimeError, match=r"unscale_\(\) is being called after step\(\)"):
        scaler.unscale_(optimizer)
    with pytest.raises(RuntimeError, match=r"step\(\) has already been called since the last update\(\)"):
        scaler.step(optimizer)
    scaler.update()
    backward(scaler, model)
    scaler.step(optimizer)  # a fresh iteration after update()


def test_step_without_any_gradient_raises():
    _model, optimizer = model_and_optimizer()
    scaler = GradScaler()
    scaler.scale(torch.ones(()))
    with pytest.raises(AssertionError, match="No inf checks were recorded for this optimizer"):
        scaler.step(optimizer)


def test_closures_are_refused_positional_too():
    model, optimizer = model_and_optimizer()
    scaler = GradScaler()
    backward(scaler, model)
    with pytest.raises(RuntimeError, match="Closure use is not currently supported"):
        scaler.step(optimizer, closure=lambda: 0.0)
    with pytest.raises(RuntimeError, match="first positional argument.*closure"):
        scaler.step(optimizer, lambda: 0.0)


def test_disabled_is_a_true_no_op():
    _model, optimizer = model_and_optimizer()
    scaler = GradScaler(enabled=False)
    loss = torch.tensor(3.0)
    assert scaler.scale(loss) is loss
    loss.requires_grad_()
    calls = []
    assert scaler.step(optimizer, closure=lambda: calls.append(1) or 0.0) == 0.0 and calls == [1]
    scaler.unscale_(optimizer)
    scaler.update()
    scaler.load_state_dict({})
    assert scaler.get_scale() == 1.0 and scaler.state_dict() == {} and not scaler.is_enabled()
    assert scaler.skipped_steps == 0 and not scaler.last_step_skipped


def test_unscale_update_and_scale_do_not_sync():
    model, optimizer = model_and_optimizer()
    scaler = GradScaler(growth="headroom", hysteresis=2)
    backward(scaler, model)
    with no_host_sync():
        scaler.scale(torch.ones(()))
        scaler.unscale_(optimizer)
    scaler.step(optimizer)  # the skip decision is the one sync, as in torch
    with no_host_sync():
        scaler.update()


def test_fused_step_does_not_sync_and_restores_the_protocol_attributes():
    model, optimizer = model_and_optimizer(torch.optim.Adam, fused=True)
    optimizer.found_inf = "user value"
    scaler = GradScaler(init_scale=2.0**16)
    backward(scaler, model)
    scaler.step(optimizer)
    scaler.update()
    backward(scaler, model, poison=float("nan"))
    before = snapshot(model, optimizer)
    with no_host_sync():
        assert scaler.step(optimizer) is None
        scaler.update()
    assert optimizer.found_inf == "user value" and not hasattr(optimizer, "grad_scale")
    assert_untouched(before, model, optimizer)
    assert scaler.get_scale() == 2.0**15 and scaler.skipped_steps == 1


def test_update_new_scale_accepts_float_int_and_tensor():
    model, optimizer = model_and_optimizer()
    scaler = GradScaler()
    for new_scale, expected in ((3.5, 3.5), (8, 8.0), (torch.tensor([2.0]), 2.0), (torch.tensor(6.0), 6.0)):
        backward(scaler, model)
        scaler.step(optimizer)
        scaler.update(new_scale)
        assert scaler.get_scale() == expected
    scaler.update(16.0)  # no inf checks needed, as in torch
    for bad, match in ((0.0, "new_scale must be a finite number > 0"), ("2", "got str"), (True, "got bool")):
        with pytest.raises(ValueError, match=match):
            scaler.update(bad)
    with pytest.raises(ValueError, match="1-element tensor"):
        scaler.update(torch.ones(2))
    with pytest.raises(ValueError, match="requires_grad=True"):
        scaler.update(torch.ones((), requires_grad=True))


def test_fp16_gradients_raise_like_torch_unless_allowed():
    model, optimizer = model_and_optimizer()
    model.half()
    scaler = GradScaler()
    scaler.scale(torch.ones(()))
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        scaler.unscale_(optimizer)
    allowed = GradScaler(allow_fp16_grads=True, init_scale=4.0)
    allowed.scale(torch.ones(()))
    allowed.unscale_(optimizer)
    assert model.weight.grad.dtype == torch.float16 and (model.weight.grad == 0.25).all()


def test_the_sync_guard_sees_the_skip_decision():
    model, optimizer = model_and_optimizer()
    scaler = GradScaler()
    backward(scaler, model)
    with pytest.raises(AssertionError, match="host sync"), no_host_sync():
        scaler.step(optimizer)  # proves no_host_sync() would catch a sync in unscale_/update


def test_optimizers_on_torchs_deprecated_grad_scaler_protocol_are_refused():
    class OldFused(torch.optim.SGD):
        _step_supports_amp_scaling = True

        def step(self, closure=None, grad_scaler=None):
            return super().step(closure)

    model = torch.nn.Linear(2, 1)
    optimizer = OldFused(model.parameters(), lr=0.1)
    scaler = GradScaler()
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    with pytest.raises(TypeError, match="takes a grad_scaler argument"):
        scaler.step(optimizer)


# -- checkpoints --------------------------------------------------------------------------------------


def test_state_dict_moves_both_ways_between_torch_and_mixprec():
    ours = GradScaler(init_scale=2.0**10, growth_interval=3, hysteresis=2)
    theirs = torch.amp.GradScaler(
        "cpu", init_scale=7.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=9
    )
    theirs.scale(torch.ones(()))
    ours.load_state_dict(theirs.state_dict())
    state = ours.state_dict()
    assert {k: state[k] for k in theirs.state_dict()} == theirs.state_dict()
    assert state["hysteresis"] == 2  # mixprec settings the torch dict does not carry stay as they were
    back = torch.amp.GradScaler("cpu")
    back.load_state_dict(GradScaler(init_scale=64.0, growth_interval=5).state_dict())
    assert back.get_scale() == 64.0 and back.get_growth_interval() == 5
    with pytest.raises(RuntimeError, match="The source state dict is empty"):
        ours.load_state_dict({})


def test_pickles_between_iterations_only():
    model, optimizer = model_and_optimizer()
    scaler = GradScaler(init_scale=32.0)
    backward(scaler, model)
    scaler.unscale_(optimizer)
    with pytest.raises(GradScalerError, match="may only be pickled at the beginning of an iteration"):
        pickle.dumps(scaler)
    scaler.step(optimizer)
    scaler.update()
    clone = pickle.loads(pickle.dumps(scaler))
    assert clone.get_scale() == 32.0 and clone.state_dict() == scaler.state_dict()
