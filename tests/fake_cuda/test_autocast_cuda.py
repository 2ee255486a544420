"""autocast("cuda") regions on fake CUDA tensors: torch.autocast("cuda") in the same run is the oracle.

The default policy must give torch's dtype for every op; an edited policy exactly the edited ops' new
lists (the rest stays torch's); a module pin exactly the pinned module's dtype. No region syncs or copies.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec import Policy

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def _inputs() -> dict[str, torch.Tensor]:
    cuda = {"device": "cuda", "dtype": FP32}
    return {
        "x": torch.randn(8, 32, **cuda),
        "w": torch.randn(16, 32, **cuda),
        "b3": torch.randn(4, 8, 32, **cuda),
        "img": torch.randn(2, 3, 8, 8, **cuda),
        "k": torch.randn(4, 3, 3, 3, **cuda),
        "h": torch.randn(8, 32, device="cuda", dtype=FP16),
    }


# op name as the policy knows it -> the call, on the inputs above
OPS: dict[str, Callable[[dict[str, torch.Tensor]], torch.Tensor]] = {
    "linear": lambda t: F.linear(t["x"], t["w"]),
    "matmul": lambda t: t["x"] @ t["w"].t(),
    "mm": lambda t: torch.mm(t["x"], t["w"].t()),
    "addmm": lambda t: torch.addmm(t["x"][:, :16], t["x"], t["w"].t()),
    "bmm": lambda t: torch.bmm(t["b3"], t["b3"].transpose(1, 2)),
    "baddbmm": lambda t: torch.baddbmm(t["b3"][:, :, :8], t["b3"], t["b3"].transpose(1, 2)),
    "conv2d": lambda t: F.conv2d(t["img"], t["k"]),
    "softmax": lambda t: torch.softmax(t["x"], -1),
    "log_softmax": lambda t: torch.log_softmax(t["x"], -1),
    "layer_norm": lambda t: F.layer_norm(t["x"], (32,)),
    "gelu": lambda t: F.gelu(t["x"]),
    "exp": lambda t: torch.exp(t["h"]),
    "sum": lambda t: t["h"].sum(),
    "mse_loss": lambda t: F.mse_loss(t["h"], t["h"]),
    "cat": lambda t: torch.cat([t["h"], t["x"]]),
    "stack": lambda t: torch.stack([t["h"], t["x"]]),
    "cross_entropy": lambda t: F.cross_entropy(t["x"], torch.zeros(8, dtype=torch.long, device="cuda")),
}


def _dtypes(region: Callable[[], object]) -> dict[str, torch.dtype]:
    inputs = _inputs()
    with region():
        return {name: op(inputs).dtype for name, op in OPS.items()}


@pytest.mark.parametrize("dtype", [FP16, BF16])
def test_default_policy_is_torch_autocast_cuda(fake_hopper, dtype: torch.dtype) -> None:
    expected = _dtypes(lambda: torch.autocast("cuda", dtype=dtype))
    assert expected["linear"] == dtype and expected["softmax"] == FP32  # torch's CUDA lists are in force
    assert expected["cat"] == FP32  # promote: the widest input
    assert _dtypes(lambda: mixprec.autocast("cuda", dtype=dtype)) == expected
    assert fake_hopper.events == []


@pytest.mark.parametrize("dtype", [FP16, BF16])
def test_an_edited_policy_changes_exactly_the_edited_ops(fake_hopper, dtype: torch.dtype) -> None:
    edits = {"linear": FP32, "conv2d": FP32, "softmax": dtype, "layer_norm": dtype, "exp": FP32}
    policy = Policy.for_device("cuda").with_ops(
        fp32=["linear", "conv2d", "exp"], lower=["softmax", "layer_norm"]
    )
    expected = _dtypes(lambda: torch.autocast("cuda", dtype=dtype))
    seen = _dtypes(lambda: mixprec.autocast("cuda", dtype=dtype, policy=policy))
    assert {op: seen[op] for op in edits} == edits
    assert {op: d for op, d in seen.items() if op not in edits} == {
        op: d for op, d in expected.items() if op not in edits
    }
    assert fake_hopper.events == []


def test_none_takes_an_op_off_every_list(fake_hopper) -> None:
    policy = Policy.for_device("cuda").with_ops(none=["linear", "softmax"])
    seen = _dtypes(lambda: mixprec.autocast("cuda", dtype=FP16, policy=policy))
    assert seen["linear"] == seen["softmax"] == FP32  # fp32 inputs stay fp32 once off the lists
    assert seen["mm"] == FP16


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 32, device="cuda")
        self.norm = nn.LayerNorm(32, device="cuda")
        self.out = nn.Linear(32, 16, device="cuda")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.proj(x)).softmax(-1))


def _module_dtypes(model: nn.Module, region: Callable[[], object]) -> dict[str, torch.dtype]:
    seen: dict[str, torch.dtype] = {}
    hooks = [
        m.register_forward_hook(lambda mod, args, out, name=name: seen.__setitem__(name, out.dtype))
        for name, m in model.named_modules()
        if name
    ]
    with region():
        model(torch.randn(8, 32, device="cuda"))
    for hook in hooks:
        hook.remove()
    return seen


@pytest.mark.parametrize(
    ("pins", "changed"),
    [
        ({"proj": FP32}, {"proj": FP32}),
        ({nn.Linear: FP32}, {"proj": FP32, "out": FP32}),
        ({"norm": Policy.for_device("cuda").with_ops(lower=["layer_norm"])}, {"norm": FP16}),
        ({"out": BF16}, {"out": BF16}),
    ],
    ids=["name", "class", "policy", "other-dtype"],
)
def test_module_pins_change_exactly_the_pinned_modules(fake_hopper, pins, changed) -> None:
    model = _Block()
    expected = _module_dtypes(model, lambda: torch.autocast("cuda", dtype=FP16))
    assert expected == {"proj": FP16, "norm": FP32, "out": FP16}
    policy = Policy.for_device("cuda").with_modules(pins)
    seen = _module_dtypes(model, lambda: mixprec.autocast("cuda", dtype=FP16, policy=policy))
    assert seen == {**expected, **changed}
    assert fake_hopper.events == []
