"""Delayed-scaling state: history in state_dict, bitwise round trip, resumed run identical to unbroken."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from torch import nn

from mixprec.float8 import Float8Config, Float8Linear, convert_to_float8_training

DELAYED = Float8Config(scaling="delayed", amax_history_len=4)


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    return convert_to_float8_training(model, config=DELAYED)


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 16, generator=g) * (1 + step % 3), torch.randn(8, 8, generator=g)
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_history_is_in_state_dict_and_round_trips_bitwise() -> None:
    model = _model()
    _train(model, torch.optim.AdamW(model.parameters(), lr=1e-2), range(3))
    state = model.state_dict()
    assert {k for k in state if "amax" in k} == {"0.amax_history", "2.amax_history"}
    assert state["0.amax_history"].shape == (3, 4) and (state["0.amax_history"][:, :3] > 0).all()
    assert not any("fp8_stats" in k for k in state)  # diagnostics only
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    fresh = _model(seed=1)
    fresh.load_state_dict(torch.load(buffer))
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, state[key]), key


def test_resumed_run_is_bitwise_identical() -> None:
    unbroken = _model()
    opt = torch.optim.AdamW(unbroken.parameters(), lr=1e-2)
    expected = _train(unbroken, opt, range(6))

    first = _model()
    opt1 = torch.optim.AdamW(first.parameters(), lr=1e-2)
    losses = _train(first, opt1, range(3))
    checkpoint = {"model": copy.deepcopy(first.state_dict()), "optim": copy.deepcopy(opt1.state_dict())}
    resumed = _model(seed=5)
    opt2 = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    resumed.load_state_dict(checkpoint["model"])
    opt2.load_state_dict(checkpoint["optim"])
    losses += _train(resumed, opt2, range(3, 6))
    assert losses == expected
    for (key, a), b in zip(unbroken.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), key


def test_losing_the_history_changes_the_run() -> None:
    # The converse: without the history a resumed run is not the same, so the test above is not vacuous.
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    expected = _train(model, opt, range(6))
    other = _model()
    opt_other = torch.optim.AdamW(other.parameters(), lr=1e-2)
    _train(other, opt_other, range(3))
    for module in other.modules():
        if isinstance(module, Float8Linear):
            module.amax_history.zero_()
    assert _train(other, opt_other, range(3, 6)) != expected[3:]


def test_bad_history_shape_is_refused_and_leaves_the_module_as_it_was() -> None:
    model = _model()
    _train(model, torch.optim.SGD(model.parameters(), lr=0.1), range(2))
    before = copy.deepcopy(model.state_dict())
    state = copy.deepcopy(before)
    state["0.amax_history"] = torch.zeros(3, 7)
    with pytest.raises(RuntimeError, match="amax_history"):
        model.load_state_dict(state)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_deepcopy_and_pickle_keep_config_and_history() -> None:
    model = _model()
    _train(model, torch.optim.SGD(model.parameters(), lr=0.1), range(2))
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert clone[0].config == DELAYED
        assert torch.equal(clone[0].amax_history, model[0].amax_history)
        assert clone[0].amax_history.data_ptr() != model[0].amax_history.data_ptr()


def test_checkpoints_move_between_plain_dynamic_and_delayed() -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4))
    delayed = _model()
    delayed_state = delayed.state_dict()
    small = convert_to_float8_training(copy.deepcopy(plain), config=DELAYED)
    small.load_state_dict(plain.state_dict())  # no history in a bf16 checkpoint: starts empty
    assert torch.equal(small[0].amax_history, torch.zeros(3, 4))
    dynamic = convert_to_float8_training(_model_plain())
    dynamic.load_state_dict(delayed_state)  # a dynamic module has no use for the history
    assert torch.equal(dynamic[0].weight, delayed[0].weight)


def _model_plain() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))


def test_a_history_of_another_length_is_named_with_each_dtype_spelled_once() -> None:
    model = _model()
    state = copy.deepcopy(model.state_dict())
    state["0.amax_history"] = torch.zeros(3, 7, dtype=torch.float64)
    with pytest.raises(RuntimeError) as caught:
        model.load_state_dict(state)
    message = str(caught.value)
    ours = tuple(model[0].amax_history.shape)
    assert (
        f"0.amax_history is float64 (3, 7), this module's is float32 {ours} (amax_history_len=4)" in message
    )
    assert "torch.float32" not in message
