"""MixedPrecisionOptimizer: fp32 masters, loss scaling, skipping, clipping, groups, state."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

from mixprec.optim import MixedPrecisionOptimizer, resolve_scaler
from mixprec.scaling import GradScaler


def half_model(dtype=torch.float16, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)).to(dtype)


def train_step(opt, model, x, inject=None):
    opt.zero_grad()
    opt.backward(model(x.to(next(model.parameters()).dtype)).float().square().mean())
    if inject is not None:
        inject(model)
    opt.step()


def snapshot(opt, model):
    return copy.deepcopy(
        {"model": model.state_dict(), "opt": opt.optimizer.state_dict(), "masters": opt.master_params}
    )


def assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


def test_small_updates_stall_in_fp16_but_masters_move_as_fp32():
    grad = torch.tensor(1e-4, dtype=torch.float16)  # every step moves the weight by -1e-4

    def run(dtype, **kwargs):
        weight = nn.Parameter(torch.ones(8, dtype=dtype))
        opt = MixedPrecisionOptimizer(torch.optim.SGD([weight], lr=1.0), **kwargs)
        for _ in range(100):
            opt.zero_grad()
            opt.backward((weight.float() * grad.float()).sum())  # fp32 loss, as O2 returns
            opt.step()
        return weight, opt

    fp32, _ = run(torch.float32, scaler=None)
    pure_fp16, _ = run(torch.float16, scaler=None, master_weights=False)
    mixed, opt = run(torch.float16, scaler="dynamic")
    assert torch.all(pure_fp16 == 1.0)  # 1 - 1e-4 rounds back to 1 in fp16, every time
    assert fp32[0].item() == pytest.approx(0.99, abs=1e-5)
    assert torch.equal(opt.master_params[0], fp32.detach())  # scale 2**16 is a power of two: exact
    assert torch.equal(mixed, fp32.detach().half())


def test_masters_are_fp32_copies_in_param_groups_and_fp32_params_are_their_own():
    model = half_model(torch.bfloat16)
    model[2].float()
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), scaler=None)
    params = opt.param_groups[0]["params"]
    assert [p.dtype for p in params] == [torch.float32] * 4
    assert params[2] is model[2].weight and params[3] is model[2].bias
    assert len(opt.master_params) == 2 and opt.model_params == [model[0].weight, model[0].bias]
    assert torch.equal(opt.master_params[0], model[0].weight.float())
    assert opt.param_groups is opt.optimizer.param_groups


POSITIONS = [(i, j) for i, p in enumerate(half_model().parameters()) for j in range(p.numel())]


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_nonfinite_grad_at_any_position_changes_nothing_and_backs_off(bad):
    x = torch.randn(5, 4)
    for index, position in POSITIONS:
        model = half_model()
        scaler = GradScaler("cpu", init_scale=256.0)
        opt = MixedPrecisionOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2), scaler=scaler)
        train_step(opt, model, x)  # creates Adam state
        before = snapshot(opt, model)

        def inject(m, index=index, position=position):
            list(m.parameters())[index].grad.view(-1)[position] = bad

        train_step(opt, model, x, inject)
        assert_same(before, snapshot(opt, model))
        assert opt.loss_scale == 128.0


def test_overflowing_loss_skips_the_step_under_the_default_scaler():
    model, x = half_model(), torch.randn(5, 4)
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    train_step(opt, model, x)
    before, scale = snapshot(opt, model), opt.loss_scale
    opt.zero_grad()
    opt.backward(model(x.half()).float().sum() * float("inf"))
    opt.step()
    assert_same(before, snapshot(opt, model))
    assert opt.loss_scale == scale / 2
    assert opt.last_step_skipped and opt.skipped_steps == 1
    train_step(opt, model, x)
    assert not opt.last_step_skipped and opt.skipped_steps == 1


def test_matches_torch_amp_on_fp32_params_bit_for_bit():
    """With nothing to master (O1), the wrapper with mixprec's scaler is exactly torch.amp's loop."""
    x = torch.randn(6, 4)
    ours, theirs = half_model(torch.float32), half_model(torch.float32)
    opt = MixedPrecisionOptimizer(
        torch.optim.Adam(ours.parameters(), lr=1e-2), scaler=GradScaler("cpu", growth_interval=2)
    )
    ref_opt = torch.optim.Adam(theirs.parameters(), lr=1e-2)
    ref_scaler = torch.amp.GradScaler("cpu", growth_interval=2)
    for step in range(6):
        blowup = float("inf") if step == 3 else 1.0
        opt.zero_grad()
        opt.backward(ours(x).square().mean() * blowup)
        opt.step()
        ref_opt.zero_grad()
        ref_scaler.scale(theirs(x).square().mean() * blowup).backward()
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        assert opt.loss_scale == ref_scaler.get_scale()
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(a, b)


def test_clip_master_grads_returns_the_unscaled_norm_and_clips_the_masters():
    model, x = half_model(), torch.randn(5, 4)
    opt = MixedPrecisionOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0), scaler=GradScaler("cpu", init_scale=256.0)
    )
    opt.zero_grad()
    opt.backward(model(x.half()).float().square().sum())
    grads = [p.grad.float() / opt.loss_scale for p in model.parameters()]
    expected = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
    masters_before = [m.detach().clone() for m in opt.param_groups[0]["params"]]
    assert expected > 0.05
    norm = opt.clip_master_grads(0.05)
    assert isinstance(norm, torch.Tensor)
    assert norm.item() == pytest.approx(expected.item(), rel=1e-3)
    opt.step()
    moved = torch.linalg.vector_norm(
        torch.stack(
            [(b - a).norm() for a, b in zip(opt.param_groups[0]["params"], masters_before, strict=True)]
        )
    )
    assert moved.item() == pytest.approx(0.05, rel=1e-3)  # lr 1: the step is the clipped gradient


def test_lr_scheduler_and_no_decay_groups_work_on_the_wrapper():
    model = half_model(torch.bfloat16)
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    inner = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.5}, {"params": no_decay, "weight_decay": 0.0}]
    )
    opt = MixedPrecisionOptimizer(inner, scaler=None)
    schedule = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=100)
    biases = [p.detach().clone() for p in no_decay]
    weights = [p.detach().clone() for p in decay]
    lrs = []
    for _ in range(3):
        opt.zero_grad()
        for p in model.parameters():
            p.grad = torch.zeros_like(p)  # only weight decay moves anything
        opt.step()
        schedule.step()
        lrs.append(inner.param_groups[0]["lr"])
    assert lrs == sorted(lrs) and lrs[0] > 0.1 / 25  # warming up, on the inner optimizer's groups
    assert all(torch.equal(a, b) for a, b in zip(biases, no_decay, strict=True))
    assert all((a.abs() > b.abs()).any() for a, b in zip(weights, decay, strict=True))


def test_state_dict_round_trips_field_by_field():
    x = torch.randn(5, 4)
    model = half_model()
    opt = MixedPrecisionOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2), scaler=GradScaler("cpu"))
    for _ in range(3):
        train_step(opt, model, x)
    saved = io.BytesIO()
    torch.save(opt.state_dict(), saved)
    saved.seek(0)

    fresh_model = half_model(seed=1)
    fresh = MixedPrecisionOptimizer(
        torch.optim.Adam(fresh_model.parameters(), lr=1e-2), scaler=GradScaler("cpu")
    )
    fresh.load_state_dict(torch.load(saved))
    assert_same(opt.state_dict(), fresh.state_dict())
    assert_same(model.state_dict(), fresh_model.state_dict())  # the model follows the masters
    assert fresh.loss_scale == opt.loss_scale


def test_existing_state_moves_to_the_masters_as_fp32():
    model, x = half_model(torch.bfloat16), torch.randn(5, 4)
    inner = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(x.bfloat16()).float().sum().backward()
    inner.step()
    opt = MixedPrecisionOptimizer(inner, scaler=None)
    assert set(inner.state) == set(opt.master_params)
    assert all(s["exp_avg"].dtype == torch.float32 for s in inner.state.values())


def test_add_param_group_creates_masters():
    model = half_model()
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model[0].parameters(), lr=0.1), scaler=None)
    opt.add_param_group({"params": model[2].parameters(), "lr": 0.01})
    assert len(opt.master_params) == 4
    assert [p.dtype for p in opt.param_groups[1]["params"]] == [torch.float32] * 2
    assert opt.param_groups[1]["lr"] == 0.01


def test_zero_grad_clears_model_and_master_grads():
    model, x = half_model(), torch.randn(5, 4)
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), scaler=None)
    train_step(opt, model, x)
    opt.backward(model(x.half()).float().sum())
    opt.zero_grad(set_to_none=False)
    assert all(torch.all(p.grad == 0) for p in model.parameters())
    assert all(m.grad is None for m in opt.master_params)  # fp32 gradients exist inside step() only
    opt.zero_grad()
    assert all(p.grad is None for p in [*model.parameters(), *opt.master_params])


def test_default_scaler_is_mixprecs_dynamic_one():
    opt = MixedPrecisionOptimizer(torch.optim.SGD(half_model().parameters(), lr=0.1))
    assert isinstance(opt.scaler, GradScaler) and opt.loss_scale == 2.0**16
    assert resolve_scaler(None, "cpu").is_enabled() is False
    assert resolve_scaler("dynamic", "cpu", max_scale=1024.0).get_scale() == 1024.0
    assert resolve_scaler("dynamic", "cpu", min_scale=2.0**20).get_scale() == 2.0**20


def test_any_gradscaler_like_object_is_accepted():
    model, x = half_model(), torch.randn(5, 4)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), scaler=scaler)
    assert opt.scaler is scaler
    train_step(opt, model, x)
    assert opt.loss_scale == 256.0


def test_static_scale_skips_nonfinite_steps_but_never_changes():
    model, x = half_model(torch.bfloat16), torch.randn(5, 4)
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), scaler=8.0)
    for step in range(4):
        train_step(opt, model, x, (lambda m: m[0].bias.grad.fill_(float("nan"))) if step == 1 else None)
        assert opt.loss_scale == 8.0
    assert torch.isfinite(model[0].bias).all()


def test_the_wrapper_deep_copies():
    model, x = half_model(), torch.randn(5, 4)
    opt = MixedPrecisionOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2), scaler=None)
    train_step(opt, model, x)
    clone = copy.deepcopy(opt)
    assert_same(clone.state_dict(), opt.state_dict())


@pytest.mark.parametrize(
    ("spec", "match"),
    [("dynamc", "accepted: None .*'dynamic'"), (-1.0, "unknown loss scale -1.0"), (float("inf"), "unknown")],
)
def test_bad_scaler_specs_are_named(spec, match):
    with pytest.raises(ValueError, match=match):
        resolve_scaler(spec, "cpu")


def test_bounds_only_apply_to_dynamic_scaling():
    with pytest.raises(ValueError, match="'dynamic' scaling only"):
        resolve_scaler(128.0, "cpu", min_scale=1.0)
    resolve_scaler("dynamic", "cpu", min_scale=1.0, max_scale=2.0**20)


def test_misuse_errors():
    model = half_model()
    with pytest.raises(TypeError, match="expected a torch.optim.Optimizer, got list"):
        MixedPrecisionOptimizer(list(model.parameters()))
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), scaler=None)
    with pytest.raises(TypeError, match="already a MixedPrecisionOptimizer"):
        MixedPrecisionOptimizer(opt)
    with pytest.raises(ValueError, match="closure"):
        opt.step(lambda: 0.0)
    with pytest.raises(ValueError, match=r"lacks \['master_params', 'scaler'\]"):
        opt.load_state_dict({"optimizer": {}})
    other = MixedPrecisionOptimizer(torch.optim.SGD(half_model()[0].parameters(), lr=0.1), scaler=None)
    with pytest.raises(ValueError, match="do not match"):
        opt.load_state_dict(other.state_dict())


@pytest.mark.parametrize(
    "config",
    ["dynamic-fp16", "static-bf16", "scale-1-bf16", "torch-scaler", "no-masters-bf16", "16-mixed", "O2"],
)
@pytest.mark.parametrize("call", ["step", "unscale_grads", "clip_master_grads"])
def test_a_plain_loss_backward_says_to_call_optimizer_backward(config, call):
    """A new user's loop: loss.backward() instead of optimizer.backward(loss). The scaler had scaled
    nothing yet, and the step failed with the scaler's "Attempted unscale_ but _scale is None" (about
    scaler.scale, which the user never calls). It names optimizer.backward(loss) now, the optimizer is
    left as it was, and the documented loop runs after it."""
    import mixprec

    x = torch.randn(5, 4)
    if config in ("16-mixed", "O2"):
        model = half_model(torch.float32)
        model, opt = mixprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
    else:
        model = half_model(torch.bfloat16 if "bf16" in config else torch.float16)
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = {
            "dynamic-fp16": "dynamic",
            "static-bf16": 8.0,
            "scale-1-bf16": 1.0,
            "no-masters-bf16": "dynamic",
        }
        if config == "torch-scaler":
            opt = MixedPrecisionOptimizer(inner, scaler=torch.amp.GradScaler("cpu", init_scale=256.0))
        else:
            opt = MixedPrecisionOptimizer(
                inner, scaler=scaler[config], master_weights=config != "no-masters-bf16"
            )
    assert isinstance(opt, MixedPrecisionOptimizer)
    dtype = next(model.parameters()).dtype
    model(x.to(dtype)).float().square().mean().backward()  # not opt.backward(loss)
    before = snapshot(opt, model)
    args = (1.0,) if call == "clip_master_grads" else ()
    with pytest.raises(
        RuntimeError, match=rf"{call}\(\).*loss\.backward\(\).*call optimizer\.backward\(loss\)"
    ):
        getattr(opt, call)(*args)
    assert_same(snapshot(opt, model), before)
    assert all(master.grad is None for master in opt.master_params) and not opt.grads_unscaled
    train_step(opt, model, x)  # zero_grad, optimizer.backward(loss), step
    assert not opt.last_step_skipped


def test_a_plain_loss_backward_is_fine_without_a_scaler():
    model, x = half_model(torch.bfloat16), torch.randn(5, 4)
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), scaler=None)
    model(x.to(torch.bfloat16)).float().square().mean().backward()
    opt.step()  # a disabled scaler scales nothing: loss.backward() is what optimizer.backward(loss) does
    assert opt.master_params[0].grad is None and not opt.last_step_skipped
