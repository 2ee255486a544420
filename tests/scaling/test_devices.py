"""GradScaler on device types other than cpu/cuda, and torch's update op against its tensor-op twin."""

from __future__ import annotations

import itertools
import math
import warnings

import pytest
import torch

import mixprec
from mixprec.scaling import dynamic, unscale

from .helpers import bits_equal

OTHER_DEVICES = ["mps", "xpu", "hpu", "xla", "privateuseone"]


@pytest.mark.parametrize("device", OTHER_DEVICES)
def test_scaler_for_another_device_type_is_enabled_as_torchs(device):
    torch_scaler = torch.amp.GradScaler(device)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns only for a missing cuda; so does mixprec
        ours = mixprec.GradScaler(device)
    assert ours.is_enabled() is torch_scaler.is_enabled() is True
    theirs = torch_scaler.state_dict()
    mine = ours.state_dict()
    assert {key: mine[key] for key in theirs} == theirs


@pytest.mark.parametrize("device", OTHER_DEVICES)
def test_scaler_for_another_device_type_keeps_torchs_bookkeeping(device):
    """The scale lives where the tensors are (here the CPU), as torch's does; steps, skips and the
    checkpoint follow torch's bit for bit."""
    scalers = [torch.amp.GradScaler(device, growth_interval=2), mixprec.GradScaler(device, growth_interval=2)]
    histories = []
    for scaler in scalers:
        param = torch.nn.Parameter(torch.ones(4))
        optimizer = torch.optim.SGD([param], lr=0.1)
        history = []
        for poison in (1.0, math.inf, 1.0, 1.0, 1.0):
            optimizer.zero_grad()
            scaler.scale((param * poison).sum()).backward()
            scaler.step(optimizer)
            scaler.update()
            history.append(
                (scaler.get_scale(), scaler.state_dict()["_growth_tracker"], param.detach().clone())
            )
        histories.append(history)
    for (scale_t, tracker_t, param_t), (scale_m, tracker_m, param_m) in zip(*histories, strict=True):
        assert (scale_t, tracker_t) == (scale_m, tracker_m)
        assert bits_equal(param_t, param_m)
    restored = mixprec.GradScaler(device)
    restored.load_state_dict(scalers[0].state_dict())
    assert restored.get_scale() == scalers[0].get_scale()


def test_missing_cuda_disables_with_a_warning_naming_the_device():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.warns(UserWarning, match="'cuda:1', but cuda is not available"):
        assert not mixprec.GradScaler("cuda:1").is_enabled()


@pytest.mark.parametrize("device", ["cdua", "mps:x", 3.5])
def test_unknown_device_is_refused_naming_it(device):
    with pytest.raises(ValueError, match="device must be a torch device") as error:
        mixprec.GradScaler(device)
    assert repr(device) in str(error.value)


CASES = [
    case
    for case in itertools.product(
        [2.0**16, 3.0, 1e-30, 3.4e38],  # scales (3.4e38 * 2 overflows: no growth)
        [0, 1, 4],  # growth trackers
        [0.0, 1.0],  # found_inf
        [(2.0, 0.5), (1.7, 0.3)],  # growth, backoff (1.7, 0.3 are inexact in float32)
        [1, 2, 5],  # growth intervals
    )
    if case[1] < case[4]  # torch's op never sees a tracker at or past the interval
]


@pytest.mark.parametrize(("scale", "tracker", "found", "factors", "interval"), CASES)
def test_tensor_op_update_equals_torchs_op_bitwise(scale, tracker, found, factors, interval):
    """The fallback for devices without ``_amp_update_scale_`` gives torch's bits."""
    results = []
    for update in (torch._amp_update_scale_, dynamic.update_scale_with_tensor_ops_):
        s = torch.tensor(scale, dtype=torch.float32)
        t = torch.tensor(tracker, dtype=torch.int32)
        update(s, t, torch.tensor(found), *factors, interval)
        results.append((s, t))
    assert bits_equal(results[0][0], results[1][0])
    assert results[0][1].item() == results[1][1].item()


def test_a_device_without_torchs_update_op_falls_back_to_tensor_ops(monkeypatch):
    calls = []

    def missing(*args):
        calls.append(args)
        raise NotImplementedError(
            "Could not run 'aten::_amp_update_scale_' with arguments from the 'X' backend"
        )

    ours, theirs = mixprec.GradScaler(growth_interval=1), torch.amp.GradScaler("cpu", growth_interval=1)
    monkeypatch.setattr(torch, "_amp_update_scale_", missing)
    monkeypatch.setattr(dynamic, "_WITHOUT_UPDATE_OP", set())
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([param], lr=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        ours.scale(param.sum()).backward()
        ours.step(optimizer)
        ours.update()
    assert len(calls) == 1 and dynamic._WITHOUT_UPDATE_OP == {"cpu"}  # tried once, then remembered
    monkeypatch.undo()  # torch's scaler runs the real op
    param.grad = torch.ones(3)
    for _ in range(3):
        theirs.scale(torch.ones(()))
        theirs.unscale_(optimizer)
        theirs.update()
    assert ours.get_scale() == theirs.get_scale() == 2.0**19


def test_a_device_without_torchs_check_op_unscales_with_public_ops(monkeypatch):
    """Where ``_amp_foreach_non_finite_check_and_unscale_`` has no kernel, unscale_ gives torch's values."""

    def missing(*args):
        raise NotImplementedError("Could not run '_amp_foreach_non_finite_check_and_unscale_' here")

    grads = [torch.tensor([3.0, -(2.0**-20), 0.0]), torch.tensor([math.inf, 1.0])]
    results = []
    for patch in (False, True):
        if patch:
            monkeypatch.setattr(unscale, "TORCH_FUSED", missing)
            monkeypatch.setattr(unscale, "_WITHOUT_CHECK_OP", set())
        params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
        for param, grad in zip(params, grads, strict=True):
            param.grad = grad.clone()
        # torch's rule: this unscale_ measures no amax, so it runs torch's check op where there is one
        scaler = mixprec.GradScaler(rule=mixprec.DynamicScale(3.0, underflow_restart=False))
        scaler.scale(torch.ones(()))
        scaler.unscale_(torch.optim.SGD(params, lr=0.1))
        results.append([p.grad for p in params])
    assert unscale._WITHOUT_CHECK_OP == {"cpu"}
    for ours, theirs in zip(*results, strict=True):
        assert bits_equal(ours, theirs)
