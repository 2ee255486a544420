"""The default rule on the paths without a sync: fused optimizers measure amax only every
``underflow_check_interval``-th update (torch's check op otherwise), an explicit unscale_ measures before the
user edits gradients, the skip counters fold in batches, and the fast gradient grouping."""

from __future__ import annotations

import copy
import math
import pickle
import random

import pytest
import torch

from mixprec.scaling import DynamicScale, GradScaler, fused, unscale
from mixprec.scaling.grads import _collect_each, collect_grads
from mixprec.scaling.skip import SkipMonitor

from .helpers import bits_equal, no_host_sync


def fused_setup(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in ((3, 2), (2,), (1,))]
    return params, torch.optim.AdamW(params, lr=0.01, fused=True)


def set_grads(params, scale: float, poison=None, zero: bool = False) -> None:
    generator = torch.Generator().manual_seed(7)
    for index, param in enumerate(params):
        param.grad = (
            torch.zeros_like(param) if zero else torch.randn(param.shape, generator=generator) * scale
        )
        if poison is not None and poison[0] == index:
            param.grad.view(-1)[poison[1]] = poison[2]


def counting(monkeypatch):
    """Count torch's check-op calls and the public-op kernel's calls (the amax-measuring one on a CPU)."""
    calls = {"torch_op": 0, "amax_kernel": 0}
    torch_op, amax_kernel = unscale.TORCH_FUSED, unscale.KERNELS["cpu"]

    def op(*args):
        calls["torch_op"] += 1
        return torch_op(*args)

    def kernel(*args):
        calls["amax_kernel"] += 1
        return amax_kernel(*args)

    monkeypatch.setattr(unscale, "TORCH_FUSED", op)
    monkeypatch.setitem(unscale.KERNELS, "cpu", kernel)
    return calls


def test_fused_steps_measure_amax_every_kth_update_and_run_torchs_op_otherwise(monkeypatch):
    params, optimizer = fused_setup()
    scaler = GradScaler(rule=DynamicScale(underflow_check_interval=4))
    calls = counting(monkeypatch)
    measured = []
    with no_host_sync():
        for _ in range(9):
            before = dict(calls)
            scaler.scale(torch.ones(()))
            set_grads(params, 2.0**16)
            scaler.step(optimizer)
            scaler.update()
            measured.append(calls["amax_kernel"] > before["amax_kernel"])
            assert calls["torch_op"] - before["torch_op"] == (0 if measured[-1] else 1)
    assert measured == [True, False, False, False, True, False, False, False, True]


@pytest.mark.parametrize("interval", [1, 3, 16])
@pytest.mark.parametrize("path", ["fused", "fused+unscale_", "sgd+unscale_", "sgd"])
def test_a_stalled_scale_restarts_at_the_first_due_update_and_follows_torch_until_then(interval, path):
    """All-zero gradients at a scale below 1: restart to init_scale within ``interval`` updates (at the
    first update the host counter marks due); until then the scale is torch's, bit for bit. A non-fused
    step that checks the gradients itself measures amax in its sync and restarts at once."""
    offset = 5  # clean iterations first, so the counter is mid-interval when the stall begins
    sides = {"ours": GradScaler(rule=DynamicScale(growth_interval=3, underflow_check_interval=interval))}
    sides["torch"] = torch.amp.GradScaler("cpu", growth_interval=3)
    history = {}
    for name, scaler in sides.items():
        params, optimizer = fused_setup()
        if path.startswith("sgd"):
            optimizer = torch.optim.SGD(params, lr=0.01)
        scales = []
        for iteration in range(offset + interval + 2):
            if iteration == offset:
                scaler.update(2.0**-20)  # as after a long run of overflows
            scaler.scale(torch.ones(()))
            set_grads(params, 1.0, zero=iteration >= offset)
            if path.endswith("unscale_"):
                scaler.unscale_(optimizer)
            scaler.step(optimizer)
            scaler.update()
            scales.append(scaler.get_scale())
        history[name] = scales[offset:]
    restart = 1 if path == "sgd" else (interval - offset % interval) % interval + 1
    assert 1 <= restart <= interval
    ours, theirs = history["ours"], history["torch"]
    assert ours[: restart - 1] == theirs[: restart - 1]
    assert ours[restart - 1] == 2.0**16 and theirs[restart - 1] < 1


def test_gradients_zeroed_after_unscale_are_not_read_as_underflow():
    """Clipping an inf norm zeroes every gradient after unscale_; torch steps on and grows, and so does the
    default rule, on amax-measuring updates too: amax was measured in the unscale_ pass, before the clip
    (hypothesis found this in test_differential)."""
    scales = {}
    for name, scaler in {
        "ours": GradScaler(rule=DynamicScale(growth_interval=1, underflow_check_interval=2)),
        "torch": torch.amp.GradScaler("cpu", growth_interval=1),
    }.items():
        params = [torch.nn.Parameter(torch.ones(3))]
        optimizer = torch.optim.SGD(params, lr=0.1)
        seen = []
        for _ in range(4):
            scaler.scale(torch.ones(()))
            scaler.update(0.9)
            params[0].grad = torch.tensor([3.0e38, 1.0, -2.0])
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(params, 1.0)  # the norm overflows: every gradient becomes 0
            assert torch.count_nonzero(params[0].grad) == 0
            scaler.step(optimizer)
            scaler.update()
            seen.append(scaler.get_scale())
        scales[name] = seen
    assert scales["ours"] == scales["torch"] == [pytest.approx(1.8)] * 4


@pytest.mark.parametrize("where", range(9))
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_fused_found_inf_and_skips_equal_torchs_bitwise(where, value):
    """A non-finite gradient anywhere, on an amax-measuring and a plain update: same skips, scale,
    parameters and AdamW state as torch.amp.GradScaler."""
    runs = {}
    for name, scaler in {
        "ours": GradScaler(rule=DynamicScale(growth_interval=2, underflow_check_interval=2)),
        "torch": torch.amp.GradScaler("cpu", growth_interval=2),
    }.items():
        params, optimizer = fused_setup()
        index, position = (0, where) if where < 6 else (1, where - 6) if where < 8 else (2, 0)
        for iteration in range(4):
            scaler.scale(torch.ones(()))
            set_grads(params, 2.0**10, poison=(index, position, value) if iteration % 2 == 0 else None)
            scaler.step(optimizer)
            scaler.update()
        runs[name] = (scaler.get_scale(), params, optimizer)
    (ours_scale, ours_params, ours_opt), (torch_scale, torch_params, torch_opt) = runs["ours"], runs["torch"]
    assert ours_scale == torch_scale
    assert all(bits_equal(a, b) for a, b in zip(ours_params, torch_params, strict=True))
    for a, b in zip(ours_opt.state.values(), torch_opt.state.values(), strict=True):
        assert all(bits_equal(a[key], b[key]) for key in ("exp_avg", "exp_avg_sq", "step"))


def test_skip_counters_fold_in_batches_as_counted_one_by_one():
    """Over several fold batches, with reads, copies and checkpoints at random points, the counters equal a
    plain count of the iterations (skipped_steps, the run of skips, last_step_skipped)."""
    rng = random.Random(0)
    params, optimizer = fused_setup()
    scaler = GradScaler(rule=DynamicScale(growth_interval=10**6, min_scale=1.0), warn_after_skips=None)
    skipped, run = 0, 0
    for iteration in range(3 * SkipMonitor.FOLD_EVERY + 7):
        poison = rng.random() < 0.4 or 40 <= iteration < 75  # a run of skips across a batch boundary
        scaler.scale(torch.ones(()))
        set_grads(params, 1.0, poison=(0, 0, math.inf) if poison else None)
        scaler.step(optimizer)
        scaler.update()
        skipped, run = skipped + poison, run + 1 if poison else 0
        if rng.random() < 0.2:
            assert (scaler.skipped_steps, scaler.last_step_skipped) == (skipped, run > 0)
        if rng.random() < 0.1:
            scaler = copy.deepcopy(scaler) if rng.random() < 0.5 else pickle.loads(pickle.dumps(scaler))
        if rng.random() < 0.1:
            saved, scaler = scaler.state_dict(), GradScaler(rule=DynamicScale(growth_interval=10**6))
            scaler.load_state_dict(saved)
        assert len(scaler.monitor._pending) < SkipMonitor.FOLD_EVERY
    state = scaler.state_dict()
    assert (state["skipped_steps"], state["_skip_run"], scaler.last_step_skipped) == (skipped, run, run > 0)


def test_underflow_check_interval_is_checked_and_its_phase_round_trips():
    for bad in (0, -1, 2.5, "16", True):
        with pytest.raises(ValueError, match="underflow_check_interval"):
            DynamicScale(underflow_check_interval=bad)
    scaler = GradScaler(rule=DynamicScale(underflow_check_interval=5))
    params, optimizer = fused_setup()
    for _ in range(7):
        scaler.scale(torch.ones(()))
        set_grads(params, 1.0)
        scaler.step(optimizer)
        scaler.update()
    saved = scaler.state_dict()
    assert (saved["underflow_check_interval"], saved["_underflow_check_tracker"]) == (5, 2)
    resumed = GradScaler()
    resumed.load_state_dict(saved)
    assert resumed.rule.underflow_check_interval == 5 and resumed.state_dict() == saved
    due = []
    for rule in (scaler.rule, resumed.rule):
        found = torch.zeros(())
        rule.ensure_state(torch.device("cpu"))
        due.append([(rule.amax_due, rule.update(found))[0] for _ in range(6)])
    assert due[0] == due[1] == [False, False, False, True, False, False]
    for key, value in (("_underflow_check_tracker", 5), ("_underflow_check_tracker", -1)):
        before = resumed.state_dict()
        with pytest.raises(ValueError, match=key):
            resumed.load_state_dict({**saved, key: value})
        assert resumed.state_dict() == before  # refused before anything changed
    torch_state = torch.amp.GradScaler("cpu").state_dict()
    resumed.load_state_dict(torch_state)  # torch's dict lacks both: the interval stays, the phase restarts
    assert resumed.rule.underflow_check_interval == 5 and resumed.rule.amax_due


def test_collect_grads_groups_plain_gradients_as_the_per_gradient_loop():
    dtypes = (torch.float32, torch.bfloat16, torch.float32, torch.float16, torch.float32)
    params = [torch.nn.Parameter(torch.zeros(index + 1, dtype=dtype)) for index, dtype in enumerate(dtypes)]
    for index, param in enumerate(params):
        if index != 4:  # one parameter without a gradient
            param.grad = torch.full_like(param, float(index + 1))
    fast = collect_grads(iter(params), allow_fp16=True)
    loop = _collect_each(params, allow_fp16=True)
    assert {d: set(g) for d, g in fast.items()} == {d: set(g) for d, g in loop.items()}
    for device, per_dtype in loop.items():
        for dtype, grads in per_dtype.items():
            assert [id(g) for g in fast[device][dtype]] == [
                id(g) for g in grads
            ]  # the same tensors, in order
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        collect_grads(params, allow_fp16=False)
    assert collect_grads([torch.nn.Parameter(torch.zeros(2))], allow_fp16=False) == {}
    complex_param = torch.nn.Parameter(torch.zeros(2, dtype=torch.complex64))
    complex_param.grad = torch.ones(2, dtype=torch.complex64)
    groups = collect_grads([params[0], complex_param], allow_fp16=False)
    assert [g.shape for g in groups[torch.device("cpu")][torch.float32]] == [(1,), (2, 2)]  # real view


@pytest.mark.parametrize("how", ["float", "tensor", "load", "min_scale"])
def test_a_scale_put_below_the_floor_stays_until_a_back_off(how):
    """The default update clamps to the floor in one op only while the scale is known to be at or above it;
    every way of putting it below keeps the documented rule (the floor applies on back-off only)."""
    rule = DynamicScale(4.0, min_scale=2.0 if how != "min_scale" else None)
    rule.ensure_state(torch.device("cpu"))
    if how == "float":
        rule.set_scale(1.0)
    elif how == "tensor":
        rule.set_scale(torch.tensor(1.0))
    elif how == "load":
        rule.load_state_dict({**rule.state_dict(), "scale": 1.0})
    else:
        rule.set_scale(1.0)
        rule.min_scale = 2.0
    rule.update(torch.zeros(()))
    assert rule.get_scale() == 1.0
    rule.update(torch.ones(()))
    assert rule.get_scale() == 2.0
    rule.set_scale(8.0)  # known above the floor again: the one-op clamp
    for _ in range(4):
        rule.update(torch.ones(()))
    assert rule.get_scale() == 2.0


def test_the_grad_scaler_protocol_check_is_cached_and_takes_any_callable():
    class Step:  # unhashable (__eq__ without __hash__): asked every time, never cached
        def __eq__(self, other: object) -> bool:
            return self is other

        def __call__(self, grad_scaler=None):  # the signature inspect sees
            return None

    class Fused:
        _step_supports_amp_scaling = True

    optimizer = Fused()
    optimizer.step = Step()
    for _ in range(2):
        with pytest.raises(TypeError, match="grad_scaler argument"):
            fused.supports_fused_scaling(optimizer)
    optimizer.step = lambda closure=None: None
    assert fused.supports_fused_scaling(optimizer) and fused.supports_fused_scaling(optimizer)
    assert fused._TAKES_GRAD_SCALER.get(optimizer.step) is False
