"""Whole training loops on real data (scikit-learn's bundled digits): opt levels, bf16 weights, resume.

Adam at a small learning rate makes most updates smaller than half a bf16 ulp of the weights, so plain bf16
weights lose accuracy to fp32 and the compensated variants (Kahan, stochastic rounding) have to win it back.
Run with ``-s`` to see the accuracy table.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mixprec.amp import initialize

sklearn = pytest.importorskip("sklearn")
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

SEEDS = (0, 1)
EPOCHS, BATCH, LR = 20, 32, 3e-4
CONFIGS = {
    "fp32": None,
    "O1": ("O1", {}),
    "O2": ("O2", {}),
    "bf16-true": ("bf16-true", {}),
    "kahan": ("bf16-true", {"weight_update": "kahan"}),
    "stochastic rounding": ("bf16-true", {"weight_update": "stochastic"}),
    "fp32, beta2 0.99": None,
    "kahan, bf16 state": ("bf16-true", {"weight_update": "kahan"}),
    "stochastic, bf16 state": ("bf16-true", {"weight_update": "stochastic"}),
}
# beta2 = 0.99 lets the compensated paths keep Adam's state in bf16 (at 0.999 it stays fp32)
BETAS = {name: (0.9, 0.99) for name in ("fp32, beta2 0.99", "kahan, bf16 state", "stochastic, bf16 state")}


@pytest.fixture(scope="module")
def digits():
    features, labels = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        features / 16.0, labels, test_size=0.25, random_state=0, stratify=labels
    )
    as_x = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
    return as_x(x_train), torch.tensor(y_train), as_x(x_test), torch.tensor(y_test)


def autocast_available():
    try:
        from mixprec.autocast import autocast  # noqa: F401
    except ImportError:
        return False
    return True


def classifier(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 10))


def batches(x, y, epochs, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=g)
        for start in range(0, len(x), BATCH):
            index = order[start : start + BATCH]
            yield x[index], y[index]


def prepared(config, seed):
    """(model, optimizer with backward/step/zero_grad); fp32 is plain torch, the reference."""
    model = classifier(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR, betas=BETAS.get(config, (0.9, 0.999)))
    if CONFIGS[config] is None:
        return model, optimizer
    level, overrides = CONFIGS[config]
    return initialize(model, optimizer, level, **overrides)


def step(optimizer, loss):
    optimizer.zero_grad()
    if hasattr(optimizer, "backward"):
        optimizer.backward(loss)
    else:
        loss.backward()
    optimizer.step()


def accuracy(model, x, y):
    model.eval()
    with torch.no_grad():
        return (model(x).float().argmax(1) == y).float().mean().item() * 100


@pytest.fixture(scope="module")
def results(digits):
    x_train, y_train, x_test, y_test = digits
    table = {}
    for config in CONFIGS:
        if config == "O1" and not autocast_available():
            continue
        scores = []
        for seed in SEEDS:
            model, optimizer = prepared(config, seed)
            for x, y in batches(x_train, y_train, EPOCHS, seed):
                step(optimizer, nn.functional.cross_entropy(model(x).float(), y))
            scores.append(accuracy(model, x_test, y_test))
        table[config] = sum(scores) / len(scores)
    print("\ndigits test accuracy (%), Adam lr 3e-4, 20 epochs, mean of seeds", SEEDS)
    for config, score in table.items():
        print(f"  {config:20s} {score:6.2f}   ({score - table['fp32']:+.2f} vs fp32)")
    return table


@pytest.mark.parametrize("config", ["O1", "O2"])
def test_mixed_precision_levels_reach_fp32_accuracy(results, config):
    if config not in results:
        pytest.skip("O1 needs mixprec.autocast")
    assert results["fp32"] > 95
    assert abs(results[config] - results["fp32"]) <= 1.0


def test_plain_bf16_weights_lose_accuracy_and_compensation_recovers_it(results):
    assert results["bf16-true"] < results["fp32"] - 2.0
    assert abs(results["kahan"] - results["fp32"]) <= 1.0
    assert abs(results["stochastic rounding"] - results["fp32"]) <= 1.0


def test_compensation_with_bf16_optimizer_state_keeps_fp32_accuracy(results):
    assert abs(results["kahan, bf16 state"] - results["fp32, beta2 0.99"]) <= 1.0
    assert abs(results["stochastic, bf16 state"] - results["fp32, beta2 0.99"]) <= 1.0


def test_o2_keeps_batchnorm_fp32_and_returns_fp32(digits):
    model, _ = prepared("O2", 0)
    assert model[0].weight.dtype == torch.bfloat16 and model[1].weight.dtype == torch.float32
    assert model(digits[0][:8]).dtype == torch.float32


def run_steps(model, optimizer, stream, count, schedule=None):
    for _ in range(count):
        x, y = next(stream)
        step(optimizer, nn.functional.cross_entropy(model(x).float(), y))
        if schedule is not None:
            schedule.step()


@pytest.mark.parametrize(
    "config", ["O2", "kahan", "stochastic rounding"], ids=["O2", "kahan", "stochastic-rounding"]
)
def test_resume_from_a_checkpoint_is_bit_identical(digits, config):
    x_train, y_train = digits[0], digits[1]

    def fresh():
        model, optimizer = prepared(config, 0)
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=60)
        return model, optimizer, schedule

    model, optimizer, schedule = fresh()
    run_steps(model, optimizer, batches(x_train, y_train, 2, 0), 60, schedule)
    straight = copy.deepcopy(model.state_dict())

    model, optimizer, schedule = fresh()
    stream = batches(x_train, y_train, 2, 0)
    run_steps(model, optimizer, stream, 30, schedule)
    checkpoint = copy.deepcopy(
        {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "schedule": schedule.state_dict()}
    )
    model, optimizer, schedule = fresh()
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    schedule.load_state_dict(checkpoint["schedule"])
    run_steps(model, optimizer, stream, 30, schedule)
    resumed = model.state_dict()
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


def test_an_overflowing_o2_step_changes_no_weight_and_no_optimizer_state(digits):
    model, optimizer = prepared("O2", 0)
    stream = batches(digits[0], digits[1], 1, 0)
    run_steps(model, optimizer, stream, 5)
    before = copy.deepcopy(
        {"params": list(model.parameters()), "optimizer": optimizer.optimizer.state_dict()}
    )
    masters = copy.deepcopy(optimizer.master_params)
    scale = optimizer.loss_scale
    x, y = next(stream)
    step(optimizer, nn.functional.cross_entropy(model(x).float(), y) * float("inf"))
    assert all(torch.equal(a, b) for a, b in zip(before["params"], model.parameters(), strict=True))
    after = optimizer.optimizer.state_dict()["state"]
    assert all(
        torch.equal(v, after[i][k]) for i, s in before["optimizer"]["state"].items() for k, v in s.items()
    )
    assert all(torch.equal(a, b) for a, b in zip(masters, optimizer.master_params, strict=True))
    assert optimizer.loss_scale == scale / 2
