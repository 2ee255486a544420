"""Issue 11 faults in the master-weight code: each test failed on the original implementation."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from torch import nn

from mixprec.amp import initialize
from mixprec.optim import CompensatedOptimizer


def net(seed=0, batchnorm=False):
    torch.manual_seed(seed)
    layers = [nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)]
    if batchnorm:
        layers.insert(1, nn.BatchNorm1d(8))
    return nn.Sequential(*layers)


def train(model, opt, steps=3, seed=0, blowup=1.0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        opt.backward(model(torch.randn(6, 4, generator=g)).float().square().mean() * blowup)
        opt.step()


def public_tensors(opt):
    inner = opt.optimizer
    groups = [p for g in opt.param_groups for p in g["params"]]
    state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    return [*groups, *state, *getattr(inner, "compensation", []), *getattr(opt, "master_params", [])]


@pytest.mark.parametrize("update", ["kahan", "stochastic"])
def test_compensated_initialize_leaves_no_tensor_outside_its_storage(update):
    model = net()
    model, opt = initialize(
        model, torch.optim.Adam(model.parameters(), lr=1e-3), "bf16-true", weight_update=update
    )
    for stage in ("fresh", "trained"):
        for t in public_tensors(opt):
            needed = (t.storage_offset() + t.numel()) * t.element_size()
            assert t.untyped_storage().nbytes() >= needed, stage
            assert torch.isfinite(t.float().sum())
        train(model, opt)


@pytest.mark.parametrize(
    ("level", "overrides"),
    [("bf16-true", {"weight_update": "kahan"}), ("bf16-true", {"weight_update": "stochastic"}), ("O2", {})],
)
def test_wrapped_optimizers_survive_deepcopy_pickle_and_torch_save(level, overrides):
    model = net()
    model, opt = initialize(model, torch.optim.Adam(model.parameters(), lr=1e-2), level, **overrides)
    train(model, opt)
    buffer = io.BytesIO()
    torch.save((model, opt), buffer)
    buffer.seek(0)
    copies = [
        copy.deepcopy((model, opt)),
        pickle.loads(pickle.dumps((model, opt))),
        torch.load(buffer, weights_only=False),
    ]
    train(model, opt, seed=1)
    for twin_model, twin_opt in copies:
        assert twin_opt.param_groups[0]["params"][0] is not opt.param_groups[0]["params"][0]
        train(twin_model, twin_opt, seed=1)  # the copy trains on by itself, to the same weights
        assert all(
            torch.equal(a, b) for a, b in zip(model.parameters(), twin_model.parameters(), strict=True)
        )


def snapshot(model, opt):
    return copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})


def same(a, b):
    if torch.is_tensor(a):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def broken(state, part, value):
    bad = copy.deepcopy(state)
    bad[part] = value
    return bad


@pytest.mark.parametrize("level", ["O2", "bf16-true+kahan"])
def test_a_refused_load_state_dict_changes_nothing(level):
    overrides = {"weight_update": "kahan"} if "kahan" in level else {}
    model = net()
    model, opt = initialize(
        model, torch.optim.Adam(model.parameters(), lr=1e-2), level.split("+")[0], **overrides
    )
    train(model, opt)
    donor_model, donor = (
        lambda m: initialize(m, torch.optim.Adam(m.parameters(), lr=1e-2), level.split("+")[0], **overrides)
    )(net(1))
    train(donor_model, donor, seed=2)
    good = donor.state_dict()
    before = snapshot(model, opt)
    # bf16-true + kahan checks inside the update pass, its scaler is disabled and loads nothing
    bad_scaler = [broken(good, "scaler", {"scale": "x"})] if opt.scaler.is_enabled() else []
    bad_states = [
        *bad_scaler,  # the scaler part is refused last in the original
        broken(good, "optimizer", {"state": {}, "param_groups": []}),
        broken(good, "master_params", [torch.zeros(3)]),
        {k: v for k, v in good.items() if k != "scaler"},
        "not a dict",
    ]
    if "kahan" in level:
        inner = copy.deepcopy(good["optimizer"])
        inner["generators"] = {"cpu": torch.zeros(3, dtype=torch.uint8)}
        bad_states.append(broken(good, "optimizer", inner))
    for bad in bad_states:
        with pytest.raises((ValueError, TypeError, RuntimeError, KeyError)):
            opt.load_state_dict(bad)
        assert same(before, snapshot(model, opt))
    opt.load_state_dict(good)
    assert same(opt.state_dict(), good)


@pytest.mark.parametrize(
    ("make_optimizer", "overrides"),
    [
        (lambda m: list(m.parameters()), {}),  # not an optimizer
        (lambda m: _stepped_adam(m), {"weight_update": "kahan"}),  # holds state already
    ],
)
def test_a_refused_initialize_changes_nothing_and_a_retry_works(make_optimizer, overrides):
    model = net(batchnorm=True)
    optimizer = make_optimizer(model)
    weights = copy.deepcopy(model.state_dict())
    with pytest.raises((TypeError, ValueError)):
        initialize(model, optimizer, "bf16-true", **overrides)
    assert "forward" not in model.__dict__
    assert same(weights, model.state_dict()) and all(p.dtype == torch.float32 for p in model.parameters())
    model, opt = initialize(model, torch.optim.Adam(model.parameters(), lr=1e-3), "bf16-true", **overrides)
    train(model, opt)


def _stepped_adam(model):
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, 4)).sum().backward()
    opt.step()
    return opt


def _o2(seed=0):
    model = net(seed)
    return initialize(model, torch.optim.SGD(model.parameters(), lr=0.0), "O2")


@pytest.mark.parametrize(
    "change",
    [
        lambda m, other: m.load_state_dict(other.state_dict()),
        lambda m, other: [p.copy_(q) for p, q in zip(m.parameters(), other.parameters(), strict=True)],
        lambda m, other: [
            setattr(p, "data", q.detach().clone())
            for p, q in zip(m.parameters(), other.parameters(), strict=True)
        ],
    ],
    ids=["load_state_dict", "in-place-under-no_grad", "param.data="],
)
def test_masters_follow_the_model_when_its_weights_change_outside_the_optimizer(change):
    model, opt = _o2()
    train(model, opt)
    other, _ = _o2(seed=5)
    with torch.no_grad():
        change(model, other)
    train(model, opt, steps=1)  # lr=0: the weights stay what was loaded
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters(), strict=True))
    assert all(torch.equal(m, p.float()) for m, p in zip(opt.master_params, model.parameters(), strict=True))


def test_reloading_the_same_weights_keeps_the_fp32_masters_and_sync_masters_catches_data_edits():
    model = net()
    model, opt = initialize(model, torch.optim.Adam(model.parameters(), lr=1e-2), "O2")
    train(model, opt)
    masters = [m.detach().clone() for m in opt.master_params]
    assert any(not torch.equal(m, p.float()) for m, p in zip(masters, model.parameters(), strict=True))
    model.load_state_dict(copy.deepcopy(model.state_dict()))  # a resume that loads the model second
    opt.state_dict()
    assert all(torch.equal(a, b) for a, b in zip(masters, opt.master_params, strict=True))
    model[0].weight.data.fill_(0.5)  # bypasses the version counter
    opt.sync_masters()
    assert torch.all(opt.master_params[0] == 0.5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_o2_never_casts_modules_kept_in_fp32(dtype):
    model = net(batchnorm=True)
    with torch.no_grad():
        model[1].weight.fill_(1.2345678)
        model[1].running_var.fill_(7e4)  # beyond fp16's 65504
    model, _ = initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2", dtype=dtype)
    assert torch.all(model[1].weight == torch.tensor(1.2345678))
    assert torch.all(model[1].running_var == 7e4)
    assert model[0].weight.dtype == dtype


def test_a_cast_that_overflows_is_refused_before_anything_changes():
    model = net(batchnorm=True)
    with torch.no_grad():
        model[1].running_var.fill_(7e4)
    with pytest.raises(ValueError, match=r"'1.running_var' to torch.float16 .* 70000"):
        initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "16-true")
    assert all(t.dtype == torch.float32 for t in model.state_dict().values() if t.is_floating_point())


def test_16_true_adam_keeps_rows_without_gradient_finite():
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4)
    emb, opt = initialize(emb, torch.optim.Adam(emb.parameters(), lr=1e-3), "16-true")
    before = emb.weight.detach().clone()
    opt.zero_grad()
    opt.backward(emb(torch.tensor([1, 3])).float().sum())
    opt.step()
    assert emb.weight.dtype == torch.float16 and torch.isfinite(emb.weight).all()
    untouched = [i for i in range(10) if i not in (1, 3)]
    assert torch.equal(emb.weight[untouched], before[untouched])
    assert not torch.equal(emb.weight[[1, 3]], before[[1, 3]])
    assert all(v.dtype == torch.float32 for s in opt.state.values() for k, v in s.items() if k != "step")


@pytest.mark.parametrize(
    ("level", "overrides"),
    [("bf16-true", {}), ("bf16-true", {"weight_update": "kahan"}), ("bf16-mixed", {})],
)
def test_presets_without_a_loss_scale_skip_nonfinite_steps(level, overrides):
    if level == "bf16-mixed":
        pytest.importorskip("mixprec.autocast")
    model = net()
    model, opt = initialize(model, torch.optim.Adam(model.parameters(), lr=1e-2), level, **overrides)
    train(model, opt)

    def state() -> dict:  # what a skip must leave alone: all but the scaler and the skip counts
        saved = {k: v for k, v in snapshot(model, opt)["opt"].items() if k != "scaler"}
        inner = saved["optimizer"]
        saved["optimizer"] = {k: v for k, v in inner.items() if k != "skipped_steps"}
        return saved

    before = state()
    weights = copy.deepcopy(model.state_dict())
    train(model, opt, steps=1, blowup=float("nan"))
    assert same(before, state())
    assert same(weights, model.state_dict())
    assert opt.last_step_skipped and opt.skipped_steps == 1 and opt.loss_scale == 1.0
    fresh = net()
    model, opt = initialize(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1), level, loss_scale=None)
    assert not opt.scaler.is_enabled()  # loss_scale=None opts out: no check, no skip, as torch


def test_compensated_optimizer_arguments_are_checked_at_the_boundary():
    params = list(net().to(torch.bfloat16).parameters())
    cases = [
        ({"optimizer": params}, TypeError, "torch.optim.Optimizer"),
        ({"method": 3}, ValueError, "unknown compensation method 3"),
        ({"seed": 1.5}, TypeError, "seed must be an int"),
        ({"scratch_numel": 2.0}, TypeError, "scratch_numel must be a positive int"),
        ({"state_dtype": torch.float16}, ValueError, "state_dtype must be None"),
    ]
    for kwargs, error, match in cases:
        optimizer = kwargs.pop("optimizer", None) or torch.optim.SGD(params, lr=0.1)
        with pytest.raises(error, match=match):
            CompensatedOptimizer(optimizer, **kwargs)
