"""apex's amp and FP16_Optimizer idioms, run as apex code writes them, on tiny fp16 models."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import mixprec
from mixprec.apex import FP16_Optimizer, amp

FP16 = torch.float16


def net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def batch(step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(12, 8, generator=g), torch.randint(0, 3, (12,), generator=g)


def loss_of(model: nn.Module, step: int = 0, scale: float = 1.0) -> torch.Tensor:
    x, y = batch(step)
    return nn.functional.cross_entropy(model(x).float(), y) * scale


def amp_o2(**kwargs):
    model = net()
    return amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", **kwargs)


def test_scale_loss_leaves_unscaled_fp32_gradients_on_the_masters() -> None:
    model, opt = amp_o2()
    loss = loss_of(model)
    with amp.scale_loss(loss, opt) as scaled_loss:
        assert torch.equal(scaled_loss, loss.float() * 2.0**16)
        scaled_loss.backward()
    masters = list(amp.master_params(opt))
    expected = opt.master_params + [p for p in model.parameters() if p.dtype == torch.float32]
    assert sorted(map(id, masters)) == sorted(map(id, expected))
    for master, param in zip(opt.master_params, opt.model_params, strict=True):
        assert param.dtype == FP16 and master.grad.dtype == torch.float32
        assert torch.equal(master.grad, param.grad.float() / 2.0**16)  # the scale is a power of two


def test_clipping_the_master_gradients_clips_them_and_changes_the_step() -> None:
    runs = {}
    for max_norm in (None, 0.05):
        model, opt = amp_o2()
        with amp.scale_loss(loss_of(model), opt) as scaled_loss:
            scaled_loss.backward()
        if max_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(amp.master_params(opt), max_norm)
            assert norm > 10 * max_norm  # the unscaled norm, not 0 and not the scaled one
            after = torch.linalg.vector_norm(torch.stack([m.grad.norm() for m in amp.master_params(opt)]))
            assert after == pytest.approx(max_norm, rel=1e-4)
        opt.step()
        runs[max_norm] = [p.detach().clone() for p in model.parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(runs[None], runs[0.05], strict=True))


def test_amp_o2_trains_bitwise_like_mixprec_initialize() -> None:
    out = []
    for api in ("apex", "native"):
        model = net()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if api == "apex":
            model, opt = amp.initialize(model, opt, opt_level="O2", loss_scale="dynamic")
        else:
            model, opt = mixprec.initialize(model, opt, "O2", dtype=FP16, max_loss_scale=2.0**24)
        for step in range(6):
            opt.zero_grad()
            if api == "apex":
                with amp.scale_loss(loss_of(model, step), opt) as scaled_loss:
                    scaled_loss.backward()
                torch.nn.utils.clip_grad_norm_(amp.master_params(opt), 0.5)
            else:
                opt.backward(loss_of(model, step))
                opt.clip_master_grads(0.5)
            opt.step()
        out.append(list(model.state_dict().values()) + opt.master_params)
    assert all(torch.equal(a, b) for a, b in zip(*out, strict=True))


def test_o1_master_params_are_the_model_params_with_unscaled_gradients() -> None:
    model = nn.Linear(4, 2)
    reference = copy.deepcopy(model)
    model, opt = amp.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1", loss_scale=128
    )
    x = torch.randn(3, 4)
    with amp.scale_loss(model(x).float().mean(), opt) as scaled_loss:
        scaled_loss.backward()
    with torch.autocast("cpu", dtype=FP16):
        out = reference(x)
    (out.float().mean() * 128.0).backward()
    for param, ref in zip(amp.master_params(opt), reference.parameters(), strict=True):
        assert param.dtype == torch.float32 and torch.equal(param.grad, ref.grad * (1 / 128.0))


def test_delay_unscale_accumulates_and_a_second_unscale_is_refused() -> None:
    model, opt = amp_o2()
    with amp.scale_loss(loss_of(model, 0), opt, delay_unscale=True) as scaled_loss:
        scaled_loss.backward()
    assert all(m.grad is None for m in opt.master_params)
    with amp.scale_loss(loss_of(model, 1), opt) as scaled_loss:
        scaled_loss.backward()
    for master, param in zip(opt.master_params, opt.model_params, strict=True):
        assert torch.equal(master.grad, param.grad.float() / 2.0**16)  # both batches' gradients
    with pytest.raises(RuntimeError, match="delay_unscale=True"):
        with amp.scale_loss(loss_of(model, 2), opt):
            pass


def test_amp_state_dict_is_apex_format_and_loads_validated() -> None:
    model, opt = amp_o2()
    with amp.scale_loss(loss_of(model) * float("inf"), opt) as scaled_loss:
        scaled_loss.backward()
    opt.step()  # skipped: the scale backs off
    state = amp.state_dict()
    assert state == {"loss_scaler0": {"loss_scale": 2.0**15, "unskipped": 0}}
    _, opt2 = amp_o2()
    for bad in (
        {},
        {"loss_scaler0": {"loss_scale": -1.0, "unskipped": 0}},
        {"loss_scaler1": state["loss_scaler0"]},
    ):
        with pytest.raises(ValueError):
            amp.load_state_dict(bad)
        assert opt2.loss_scale == 2.0**16  # unchanged
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 7}})
    assert amp.state_dict() == {"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 7}}


def test_amp_initialize_keeps_apex_shapes_and_options() -> None:
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert amp.initialize(model, opt, enabled=False) == (model, opt)
    assert amp.initialize(model, opt, enabled="False") == (model, opt)  # apex's flags take the strings
    with pytest.raises(TypeError, match=r"got 'O2': amp.initialize's third argument is apex's enabled"):
        amp.initialize(model, opt, "O2")  # apex's signature: this was enabled="O2", run at the default O1
    assert model[1].weight.dtype == torch.float32
    models, opts = amp.initialize(
        [model], [opt], opt_level="O2", keep_batchnorm_fp32="False", loss_scale="128.0"
    )
    assert models[0] is model and isinstance(opts[0], mixprec.MixedPrecisionOptimizer)
    assert model[1].weight.dtype == FP16 and opts[0].loss_scale == 128.0
    with pytest.raises(ValueError, match="apex's levels"):
        amp.initialize(net(), torch.optim.SGD(net().parameters(), lr=0.1), opt_level="bf16-true")
    for bad in (torch.int8, torch.float32):  # named as apex's argument, not initialize's dtype=
        model = net()
        with pytest.raises(ValueError, match=rf"^cast_model_type must be a half-precision type, got {bad}"):
            amp.initialize(model, torch.optim.SGD(model.parameters()), opt_level="O2", cast_model_type=bad)
        assert model[0].weight.dtype == torch.float32  # refused before anything changed
    opt = torch.optim.SGD(model.parameters())
    _, opt = amp.initialize(model, opt, opt_level="O2", cast_model_type="bf16")  # mixprec's dtype names too
    assert opt.master_params and model[0].weight.dtype == torch.bfloat16


def test_a_disabled_amp_runs_the_same_loop_in_fp32_as_apex() -> None:
    """``amp.initialize(..., enabled=args.fp16)`` with the same ``scale_loss`` loop either way: disabled,
    apex yields the loss itself and keeps no loss scaler (not the previous run's)."""
    amp_o2()  # an earlier enabled run in this process
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert amp.initialize(model, opt, opt_level="O2", enabled=False) == (model, opt)
    reference = copy.deepcopy(model)
    reference_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    loss = loss_of(model)
    with amp.scale_loss(loss, opt) as scaled_loss:
        assert scaled_loss is loss
        scaled_loss.backward()
    torch.nn.utils.clip_grad_norm_(amp.master_params(opt), 1.0)
    opt.step()
    loss_of(reference).backward()
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
    reference_opt.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters(), strict=True))
    assert amp.state_dict() == {}
    amp.load_state_dict(amp.state_dict())  # a checkpoint of the disabled run loads back
    amp_o2()  # enabled again: scale_loss scales
    assert set(amp.state_dict()) == {"loss_scaler0"}


@pytest.mark.parametrize(
    ("call", "names"),
    [
        (lambda m, o: amp.initialize(m, o, num_losses=2), "one mixprec.GradScaler per loss"),
        (lambda m, o: amp.initialize([m, net(1)], o), "once per pair"),
        (lambda m, o: amp.initialize(m, opt_level="O2"), "without an optimizer"),
        (lambda m, o: amp.initialize(m, o, opt_level="O2", patch_torch_functions=True), "opt_level='O1'"),
        (lambda m, o: amp.initialize(m, o, cast_model_outputs=FP16), "in your loss function"),
        (lambda m, o: amp.register_half_function(torch, "bmm"), "with_ops"),
        (lambda m, o: amp.disable_casts(), "torch.autocast"),
        (lambda m, o: FP16_Optimizer(o).step(lambda: 0.0), "optimizer.backward"),
    ],
)
def test_what_apex_did_and_mixprec_does_not_names_the_replacement(call, names: str) -> None:
    model = net()
    with pytest.raises(NotImplementedError, match=names):
        call(model, torch.optim.SGD(model.parameters(), lr=0.1))


def fp16_optimizer(**kwargs) -> tuple[nn.Module, FP16_Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)).half()
    return model, FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), **kwargs)


def half_loss(model: nn.Module, step: int = 0) -> torch.Tensor:
    x, y = batch(step)
    return nn.functional.cross_entropy(model(x.half()).float(), y)


def test_fp16_optimizer_scales_clips_and_skips_as_apex() -> None:
    model, opt = fp16_optimizer(static_loss_scale=128.0)
    assert opt.loss_scale == 128.0 and not opt.dynamic_loss_scale
    opt.backward(half_loss(model))
    for master, param in zip(opt.master_params, opt.model_params, strict=True):
        assert torch.equal(master.grad, param.grad.float() / 128.0)
    norm = opt.clip_master_grads(0.01)
    assert norm > 0.01
    opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    opt.backward(half_loss(model) * float("inf"))
    assert opt.clip_master_grads(1.0) == -1  # apex's overflow answer
    opt.step()
    assert opt.last_step_skipped
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_fp16_optimizer_overflow_flag_holds_the_lr_schedule_as_apex_era_loops_read_it() -> None:
    """Megatron-era loops: ``if not optimizer.overflow: lr_scheduler.step()`` after ``step()`` (apex sets the
    flag in ``backward`` already). A start of 2**20 overflows this model's fp16 gradients at steps 0 and 3."""
    model, opt = fp16_optimizer(dynamic_loss_scale=True, dynamic_loss_args={"init_scale": 2.0**20})
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    flags = []
    for step in range(8):
        opt.zero_grad()
        opt.backward(half_loss(model, step) * (float("inf") if step == 5 else 1.0))
        before_step = opt.overflow  # apex's check ran in backward (update_master_grads)
        opt.step()
        assert opt.overflow == before_step == opt.last_step_skipped
        flags.append(opt.overflow)
        if not opt.overflow:
            scheduler.step()
    assert flags == [True, False, False, True, True, True, False, False]
    assert scheduler.last_epoch == flags.count(False)
    assert opt.param_groups[0]["lr"] == 0.1 * 0.5 ** flags.count(False)
    opt.zero_grad()
    opt.backward(half_loss(model), update_master_grads=False)
    assert opt.overflow is False  # the last step's, until the master gradients are updated


def test_fp16_optimizer_dynamic_args_and_the_loss_scale_setter() -> None:
    model, opt = fp16_optimizer(
        dynamic_loss_scale=True, dynamic_loss_args={"init_scale": 2.0**10, "scale_window": 2}
    )
    assert opt.loss_scale == 2.0**10
    for step in range(2):
        opt.zero_grad()
        opt.backward(half_loss(model, step))
        opt.step()
    assert opt.loss_scale == 2.0**11  # grew after scale_window clean steps
    opt.loss_scale = 64.0
    assert opt.loss_scale == 64.0
    with pytest.raises(TypeError, match="scale_window"):
        fp16_optimizer(dynamic_loss_scale=True, dynamic_loss_args={"window": 2})
    # a bad value is named with its key, never coerced (int(2.5) was a window of 2, int(True) one of 1)
    for args, message in (
        ({"scale_window": 2.5}, r"dynamic_loss_args\['scale_window'\] must be an int >= 1, got 2\.5"),
        ({"scale_window": True}, r"dynamic_loss_args\['scale_window'\] must be an int >= 1, got True"),
        ({"scale_factor": "2"}, r"dynamic_loss_args\['scale_factor'\] must be a finite number > 1, got '2'"),
        ({"scale_factor": 1.0}, r"dynamic_loss_args\['scale_factor'\] must be a finite number > 1, got 1\.0"),
        ({"init_scale": "big"}, r"init_scale must be a finite number > 0, got 'big'"),
    ):
        with pytest.raises(ValueError, match=message):
            fp16_optimizer(dynamic_loss_scale=True, dynamic_loss_args=args)
    _, opt = fp16_optimizer(dynamic_loss_scale=True, dynamic_loss_args={"init_scale": 2**16})  # an int
    assert opt.loss_scale == 2.0**16
    assert fp16_optimizer(dynamic_loss_scale=True)[1].loss_scale == 2.0**32  # apex's default start
    # amp's spelling as the static scale is a dynamic scale, and the flag says so
    assert fp16_optimizer(static_loss_scale="dynamic")[1].dynamic_loss_scale
    assert not fp16_optimizer(static_loss_scale="128")[1].dynamic_loss_scale


def test_param_group_edits_reach_the_masters_and_state_round_trips() -> None:
    model, opt = fp16_optimizer(dynamic_loss_scale=True)
    for group in opt.param_groups:
        group["lr"] = 0.0  # warm-up from zero: nothing may move
    opt.backward(half_loss(model))
    start = [m.detach().clone() for m in opt.master_params]
    opt.step()
    opt.zero_grad()
    opt.backward(half_loss(model))
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(start, opt.master_params, strict=True))
    for group in opt.param_groups:
        group["lr"] = 0.05
    for step in range(3):
        opt.zero_grad()
        opt.backward(half_loss(model, step))
        opt.step()
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    model2, opt2 = fp16_optimizer(dynamic_loss_scale=True)
    model2.load_state_dict(saved_model)
    opt2.load_state_dict(saved_opt)
    for m, o in ((model, opt), (model2, opt2)):
        o.zero_grad()
        o.backward(half_loss(m, 9))
        o.clip_master_grads(0.1)
        o.step()
    assert opt2.loss_scale == opt.loss_scale and opt2.param_groups[0]["lr"] == 0.05
    assert all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), model2.state_dict().values(), strict=True)
    )


def test_several_losses_accumulate_with_update_master_grads_false_and_the_naive_form_is_refused() -> None:
    model, opt = fp16_optimizer(static_loss_scale=128.0)
    opt.backward(half_loss(model, 0), update_master_grads=False)
    opt.backward(half_loss(model, 1))
    for master, param in zip(opt.master_params, opt.model_params, strict=True):
        assert torch.equal(master.grad, param.grad.float() / 128.0)  # both losses
    with pytest.raises(RuntimeError, match="update_master_grads=False"):
        opt.backward(half_loss(model, 2))
