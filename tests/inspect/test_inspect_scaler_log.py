"""ScalerLog (with torch's and mixprec's GradScaler), nonfinite_params and grad_amax."""

import json
import math

import pytest
import torch
from torch import nn

from mixprec.autocast import autocast
from mixprec.inspect import ScalerLog, demo, grad_amax, nonfinite_params


def _scalers():
    scalers = {"torch": lambda: torch.amp.GradScaler("cpu", init_scale=2.0**24, growth_interval=4)}
    try:
        from mixprec.scaling import GradScaler
    except ImportError:  # the scaler is being written alongside; torch's covers the log meanwhile
        return scalers
    scalers["mixprec"] = lambda: GradScaler("cpu", init_scale=2.0**24, growth_interval=4)
    return scalers


def _train(log, scaler, model, optimizer, steps=12):
    generator = torch.Generator().manual_seed(0)
    for step in range(steps):
        x = torch.randn(8, demo.WIDTH, generator=generator)
        with autocast("cpu", dtype=torch.float16):
            loss = (model(x).float() - 1).square().mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        log.record(step, loss=loss)
        optimizer.zero_grad()


@pytest.mark.parametrize("kind", list(_scalers()))
def test_log_records_scale_skips_amax_and_culprits(kind, tmp_path):
    model = demo.healthy_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = _scalers()[kind]()
    path = tmp_path / "run.jsonl"
    with ScalerLog(scaler, path, optimizer=optimizer, model=model, histogram_every=5) as log:
        _train(log, scaler, model, optimizer)
    *lines, trailer = [json.loads(line) for line in path.read_text().splitlines()]
    assert trailer == {"end_of_log": {"records": 12}}  # written by close(): the log is complete
    assert lines == log.records and [r["step"] for r in lines] == list(range(12))
    assert {"step", "scale", "skipped", "grad_amax", "loss"} <= set(lines[0])
    # 2^24 overflows fp16 gradients: the first steps are skipped and the scale halves each time.
    assert lines[0]["skipped"] and lines[0]["scale"] == 2.0**23
    assert lines[0]["grad_amax"] is None and lines[0]["nonfinite_param_count"] > 0
    assert "head.bias" in lines[0]["nonfinite_params"]
    kept = [r for r in lines if not r["skipped"]]
    assert kept and all(0 < r["grad_amax"] < 10 and "nonfinite_params" not in r for r in kept)
    assert log.skipped_steps == [r["step"] for r in lines if r["skipped"]]
    assert [("grad_log2_hist" in r) for r in lines] == [i % 5 == 0 for i in range(12)]
    assert all(math.isfinite(r["loss"]) for r in lines)


def test_disabled_log_touches_nothing(tmp_path):
    class CountingScaler:
        calls = 0

        def get_scale(self):
            CountingScaler.calls += 1
            return 1.0

    log = ScalerLog(CountingScaler(), tmp_path / "off.jsonl", model=demo.healthy_model(), enabled=False)
    assert log.record(0, loss=1.0) is None
    assert CountingScaler.calls == 0 and log.records == [] and not (tmp_path / "off.jsonl").exists()


def test_skip_flag_of_the_scaler_wins_and_steps_count_on():
    class FlaggingScaler:
        last_step_skipped = True

        def get_scale(self):
            return 8.0  # constant: the scale alone would say "not skipped"

    log = ScalerLog(FlaggingScaler())
    assert log.record()["skipped"] and log.record()["step"] == 1
    assert log.record(10)["step"] == 10 and log.record()["step"] == 11
    assert "grad_amax" not in log.records[0]  # no optimizer or model given


def test_state_dict_round_trip():
    scaler = torch.amp.GradScaler("cpu", init_scale=64.0)
    log = ScalerLog(scaler)
    log.record(4)
    state = log.state_dict()
    resumed = ScalerLog(scaler)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state == {"previous_scale": 64.0, "next_step": 5}
    with pytest.raises(ValueError, match="lacks"):
        resumed.load_state_dict({"previous_scale": 1.0})


def test_constructor_errors():
    with pytest.raises(TypeError, match="get_scale"):
        ScalerLog(object())
    with pytest.raises(ValueError, match="histogram_every"):
        ScalerLog(torch.amp.GradScaler("cpu"), histogram_every=-1)


def test_nonfinite_params_and_grad_amax():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert nonfinite_params(model) == [] and grad_amax(model) is None
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    model[1].weight.grad[0, 1] = math.inf
    model[0].bias.grad[0] = math.nan
    assert nonfinite_params(model) == ["0.bias", "1.weight"]
    assert nonfinite_params(optimizer, model=model) == ["0.bias", "1.weight"]
    assert nonfinite_params(optimizer) == ["param_groups[0][1]", "param_groups[0][2]"]
    assert nonfinite_params(list(model.parameters())) == ["params[1]", "params[2]"]
    assert math.isnan(grad_amax(model))
    model[0].bias.grad[0] = -3.0
    assert grad_amax(model) == math.inf
    model[1].weight.grad[0, 1] = 2.5
    assert grad_amax(model.named_parameters()) == 3.0
    with pytest.raises(TypeError, match="nn.Module, an optimizer"):
        nonfinite_params(42)


def test_summary_says_when_the_loss_went_non_finite(tmp_path):
    # A run that diverges (SGD at lr=50 under fp16 autocast): its later losses are inf/nan, which the log
    # writes as null. The summary once read "1.397 → 17.06", the last *finite* loss, as if the run ended
    # there; it must say how many losses were not finite and from which step.
    from mixprec.inspect.report import summarize
    from mixprec.scaling import GradScaler

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=50.0)
    scaler = GradScaler("cpu")
    log = ScalerLog(scaler, tmp_path / "run.jsonl", optimizer=optimizer, model=model)
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    for _ in range(10):
        optimizer.zero_grad()
        with autocast("cpu", dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        log.record(loss=loss)
    log.close()
    records = [json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()]
    records = [r for r in records if "step" in r]
    bad = [r["step"] for r in records if r["loss"] is None]
    assert bad and bad[-1] == 9  # the run did end on a non-finite loss
    summary = summarize(records)
    assert f"({len(bad)} non-finite, first at step {bad[0]})" in summary


def test_summary_of_a_finite_run_is_unchanged():
    from mixprec.inspect.report import summarize

    records = [{"step": s, "scale": 2.0**16, "skipped": False, "loss": 2.0 - 0.5 * s} for s in range(3)]
    assert "| 2 → 1 |" in summarize(records)
