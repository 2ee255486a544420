"""mixprec.GradScaler against torch.amp.GradScaler(device="cpu"), run in lockstep on random sequences.

Both sides get the same model, optimizers, inputs and misuse-free call sequence (gradient accumulation,
unscale_ + clipping, inf/nan injected anywhere, update(new_scale), checkpoints swapped mid-run between the
two libraries). After every update the scale, the growth tracker, every parameter and every optimizer state
tensor must be bit-identical.
"""

from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mixprec.scaling

from .helpers import bits_equal

OPTIMIZER_SETUPS = ["sgd", "adam", "adam-fused", "sgd+adamw-fused", "adam-foreach+sgd-fused"]


def build_optimizers(setup: str, params: list[torch.nn.Parameter]) -> list[torch.optim.Optimizer]:
    first, second = params[:2], params[2:]
    table = {
        "sgd": lambda: [torch.optim.SGD(params, lr=0.05, momentum=0.9, foreach=True)],
        "adam": lambda: [torch.optim.Adam(params, lr=0.01, foreach=False)],
        "adam-fused": lambda: [torch.optim.Adam(params, lr=0.01, fused=True)],
        "sgd+adamw-fused": lambda: [
            torch.optim.SGD(first, lr=0.05, momentum=0.5),
            torch.optim.AdamW(second, lr=0.01, fused=True),
        ],
        "adam-foreach+sgd-fused": lambda: [
            torch.optim.Adam(first, lr=0.01, foreach=True),
            torch.optim.SGD(second, lr=0.05, momentum=0.9, fused=True),
        ],
    }
    return table[setup]()


class Side:
    """One library's copy of the training loop."""

    def __init__(self, scaler, setup: str) -> None:
        generator = torch.Generator().manual_seed(1)
        shapes = [
            ((6, 5), torch.float32),
            ((5,), torch.float32),
            ((5, 3), torch.bfloat16),
            ((3,), torch.float32),
        ]
        self.params = [
            torch.nn.Parameter(torch.randn(shape, generator=generator).to(dtype)) for shape, dtype in shapes
        ]
        self.optimizers = build_optimizers(setup, self.params)
        self.scaler = scaler
        # Create the optimizer state with a zero-gradient step: torch's SGD(fused=True) leaves its momentum
        # buffers uninitialised (torch.empty) when its first step is skipped, so they could not be compared.
        for param in self.params:
            param.grad = torch.zeros_like(param)
        for optimizer in self.optimizers:
            optimizer.step()

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        w1, b1, w2, b2 = self.params
        return (torch.relu(x @ w1 + b1) @ w2.float() + b2).square().mean()

    def iterate(self, step: dict, index: int) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad()
        for micro in range(step["micro"]):
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * index + micro))
            loss = self.loss(x)
            if step["loss_poison"] is not None and micro == 0:
                loss = loss * step["loss_poison"]
            self.scaler.scale(loss).backward()
            if step["poison"] is not None and micro == step["poison"][0] % step["micro"]:
                _, which, where, value = step["poison"]
                grad = self.params[which].grad.view(-1)
                grad[where % grad.numel()] = value
        if step["clip"]:
            for optimizer in self.optimizers:
                self.scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        for optimizer in self.optimizers:
            self.scaler.step(optimizer)
        new_scale = step["new_scale"]
        if isinstance(new_scale, torch.Tensor):
            new_scale = new_scale.clone()
        elif isinstance(new_scale, int) and isinstance(self.scaler, torch.amp.GradScaler):
            new_scale = float(new_scale)  # torch takes only floats and tensors
        self.scaler.update(new_scale)


def tracker(scaler) -> int:
    if isinstance(scaler, mixprec.scaling.GradScaler):
        return scaler.rule.get_growth_tracker()
    return scaler._get_growth_tracker()


def assert_identical(ours: Side, theirs: Side, index: int) -> None:
    assert ours.scaler.get_scale() == theirs.scaler.get_scale(), f"scale differs after iteration {index}"
    assert tracker(ours.scaler) == tracker(theirs.scaler), f"growth tracker differs after iteration {index}"
    for a, b in zip(ours.params, theirs.params, strict=True):
        assert bits_equal(a, b), f"parameters differ after iteration {index}"
    for mine, torchs in zip(ours.optimizers, theirs.optimizers, strict=True):
        for state_a, state_b in zip(mine.state.values(), torchs.state.values(), strict=True):
            for key, value in state_a.items():
                assert bits_equal(value, state_b[key]), f"optimizer state {key} differs after {index}"


def swap_checkpoints(ours: Side, theirs: Side, config: dict) -> None:
    """Mid-run: torch's checkpoint into a fresh mixprec scaler and mixprec's into a fresh torch one."""
    torch_state, our_state = theirs.scaler.state_dict(), ours.scaler.state_dict()
    ours.scaler = mixprec.scaling.GradScaler(**config)
    ours.scaler.load_state_dict(torch_state)
    theirs.scaler = torch.amp.GradScaler("cpu", **config)
    theirs.scaler.load_state_dict(our_state)


poison = st.one_of(
    st.none(),
    st.tuples(
        st.integers(0, 2),
        st.integers(0, 3),
        st.integers(0, 40),
        st.sampled_from([math.inf, -math.inf, math.nan, 3.0e38, -1e-30]),
    ),
)
steps = st.fixed_dictionaries(
    {
        "micro": st.integers(1, 3),
        "poison": st.one_of(st.none(), poison),
        "loss_poison": st.sampled_from([None, None, None, None, math.inf, math.nan]),
        "clip": st.booleans(),
        "new_scale": st.sampled_from([None] * 8 + [3.0, 2.0**20, 1, torch.tensor(64.0)]),
        "checkpoint": st.sampled_from([False] * 5 + [True]),
    }
)
CLEAN = {
    "micro": 1,
    "poison": None,
    "loss_poison": None,
    "clip": False,
    "new_scale": None,
    "checkpoint": False,
}
configs = st.fixed_dictionaries(
    {
        "init_scale": st.sampled_from([2.0**16, 8.0, 3.0, 2.0**125]),
        "growth_factor": st.sampled_from([2.0, 3.0, 1.5]),
        "backoff_factor": st.sampled_from([0.5, 0.3]),
        "growth_interval": st.integers(1, 4),
    }
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    setup=st.sampled_from(OPTIMIZER_SETUPS), config=configs, sequence=st.lists(steps, min_size=1, max_size=8)
)
def test_random_sequences_are_bit_identical_to_torch(setup, config, sequence):
    ours = Side(mixprec.scaling.GradScaler(**config), setup)
    theirs = Side(torch.amp.GradScaler("cpu", **config), setup)
    for index, step in enumerate(sequence):
        ours.iterate(step, index)
        theirs.iterate(step, index)
        assert_identical(ours, theirs, index)
        if step["checkpoint"]:
            swap_checkpoints(ours, theirs, config)


def test_long_seeded_run_with_everything_is_bit_identical_to_torch():
    rng = torch.Generator().manual_seed(7)

    def pick(options):
        return options[int(torch.randint(len(options), (), generator=rng))]

    config = {"init_scale": 2.0**16, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 3}
    ours = Side(mixprec.scaling.GradScaler(**config), "sgd+adamw-fused")
    theirs = Side(torch.amp.GradScaler("cpu", **config), "sgd+adamw-fused")
    for index in range(80):
        step = {
            "micro": pick([1, 2, 3]),
            "poison": pick(
                [None] * 4 + [(0, pick([0, 1, 2, 3]), pick(range(30)), pick([math.inf, math.nan]))]
            ),
            "loss_poison": pick([None] * 15 + [math.inf]),
            "clip": pick([True, False]),
            "new_scale": pick([None] * 15 + [2.0**10]),
            "checkpoint": index % 17 == 16,
        }
        ours.iterate(step, index)
        theirs.iterate(step, index)
        assert_identical(ours, theirs, index)
        if step["checkpoint"]:
            swap_checkpoints(ours, theirs, config)
    assert ours.scaler.skipped_steps > 5


def test_sparse_gradients_are_bit_identical_to_torch():
    def run(scaler):
        torch.manual_seed(3)
        embedding = torch.nn.Embedding(12, 4, sparse=True)
        optimizer = torch.optim.SGD(embedding.parameters(), lr=0.1, momentum=0.9)
        scales = []
        for index in range(12):
            optimizer.zero_grad()
            ids = torch.tensor([index % 12, (3 * index) % 12, index % 12])
            scaler.scale(embedding(ids).square().sum()).backward()
            if index % 4 == 2:
                embedding.weight.grad._values()[1, index % 4] = math.inf
            scaler.step(optimizer)
            scaler.update()
            scales.append(scaler.get_scale())
        return embedding.weight.detach(), scales

    ours, our_scales = run(mixprec.scaling.GradScaler(growth_interval=2))
    theirs, their_scales = run(torch.amp.GradScaler("cpu", growth_interval=2))
    assert our_scales == their_scales and bits_equal(ours, theirs)
