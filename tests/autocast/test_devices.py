"""Every device type torch.autocast takes: a mixprec region there is torch's own state, checked against
torch.autocast in the same process. A CPU-only build of torch enters "mps", "xpu", "hpu", "xla" (and
more) regions without the hardware, so entering, nesting, state, dtypes and warnings run here.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import mixprec
from mixprec import Policy

DEVICES = [d for d in ("mps", "xpu", "hpu", "xla") if torch.amp.is_autocast_available(d)]
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def state(dev: str) -> tuple[bool, torch.dtype]:
    return torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)


def inside(make, dev: str) -> tuple[tuple[bool, torch.dtype], list[str]]:
    """torch's state for ``dev`` inside the region ``make()`` builds, and the warnings that raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with make():
            seen = state(dev)
    return seen, [str(w.message) for w in caught]


def test_the_build_takes_the_devices_this_file_tests() -> None:
    assert DEVICES == ["mps", "xpu", "hpu", "xla"]  # torch 2.13's CPU wheel accepts all four


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("dtype", [BF16, FP16, None])
def test_a_region_is_torch_state_inside_and_restored_after(dev: str, dtype: torch.dtype | None) -> None:
    before = state(dev)
    expected, torch_warned = inside(lambda: torch.autocast(dev, dtype=dtype), dev)
    assert state(dev) == before
    seen, warned = inside(lambda: mixprec.autocast(dev, dtype=dtype), dev)
    assert seen == expected and seen[0]
    assert warned == torch_warned == []
    assert state(dev) == before
    assert state("cpu") == (False, torch.get_autocast_dtype("cpu"))  # the CPU's state is untouched


@pytest.mark.parametrize("dev", DEVICES)
def test_mixprec_queries_follow_the_region(dev: str) -> None:
    default = torch.get_autocast_dtype(dev)
    assert (mixprec.is_autocast_enabled(dev), mixprec.get_autocast_dtype(dev)) == (False, default)
    with mixprec.autocast(dev, dtype=BF16):
        assert (mixprec.is_autocast_enabled(dev), mixprec.get_autocast_dtype(dev)) == (True, BF16)
        assert not mixprec.is_autocast_enabled("cpu")
    assert (mixprec.is_autocast_enabled(dev), mixprec.get_autocast_dtype(dev)) == (False, default)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("dtype", [FP32, torch.float64])
def test_a_dtype_torch_refuses_there_disables_the_region_with_torch_warning(dev: str, dtype) -> None:
    expected, torch_warned = inside(lambda: torch.autocast(dev, dtype=dtype), dev)
    seen, warned = inside(lambda: mixprec.autocast(dev, dtype=dtype), dev)
    assert seen == expected and not seen[0]
    assert warned == torch_warned and "not supported. Disabling autocast" in warned[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert not mixprec.autocast(dev, dtype=dtype).enabled


@pytest.mark.parametrize("dev", DEVICES)
def test_nesting_with_torch_regions_and_islands_restores_each_level(dev: str) -> None:
    with torch.autocast(dev, dtype=FP16):
        with mixprec.autocast(dev, dtype=BF16):
            assert state(dev) == (True, BF16)
            with mixprec.autocast(dev, enabled=False):
                assert not torch.is_autocast_enabled(dev)
            with torch.autocast(dev, enabled=False):
                assert not torch.is_autocast_enabled(dev)
            assert state(dev) == (True, BF16)
        assert state(dev) == (True, FP16)


@pytest.mark.parametrize("dev", DEVICES)
def test_decorator_device_object_and_presets(dev: str) -> None:
    @mixprec.autocast(dev, dtype=BF16)
    def run() -> tuple[bool, torch.dtype]:
        return state(dev)

    assert run() == (True, BF16)
    with mixprec.autocast(torch.device(dev), dtype=FP16):  # mixprec takes a torch.device (torch: a str)
        assert state(dev) == (True, FP16)
    with mixprec.autocast(f"{dev}:0", policy="bf16-mixed"):
        assert state(dev) == (True, BF16)
    assert Policy.for_device(dev, BF16) == Policy(compute_dtype=BF16)  # torch's lists, whatever they are


@pytest.mark.parametrize("dev", DEVICES)
def test_cpu_tensors_inside_a_region_for_another_device_run_as_torch_runs_them(dev: str) -> None:
    lin, x = nn.Linear(4, 3), torch.randn(2, 4)
    with torch.autocast(dev, dtype=BF16):
        expected = lin(x)
    with mixprec.autocast(dev, dtype=BF16):
        actual = lin(x)
    assert actual.dtype == expected.dtype == FP32 and torch.equal(actual, expected)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize(
    ("policy", "named"),
    [
        (Policy().with_ops(fp32=["softmax"]), "op edits"),
        ("conservative", "op edits"),
        (Policy().with_modules({nn.Linear: FP32}), "module pins"),
        (Policy.for_device("cpu"), "'cpu' op lists"),
    ],
)
def test_an_edited_policy_without_a_catalogue_raises_one_clear_error(dev: str, policy, named: str) -> None:
    before = state(dev)
    with pytest.raises(
        ValueError, match=f"{named}.*cannot run on '{dev}'.*catalogues for \\['cpu', 'cuda'\\]"
    ):
        mixprec.autocast(dev, policy=policy)
    assert state(dev) == before


@pytest.mark.parametrize("dev", ["meta", "gpu", "tpu"])
def test_a_device_torch_autocast_refuses_is_refused_naming_torch_check(dev: str) -> None:
    with pytest.raises(ValueError, match=f"unsupported device_type '{dev}'.*is_autocast_available"):
        mixprec.autocast(dev)


def _function(decorate, dev: str, seen: list) -> type[torch.autograd.Function]:
    class Double(torch.autograd.Function):
        @staticmethod
        @decorate(device_type=dev, cast_inputs=FP32)
        def forward(ctx, x):
            seen.append(state(dev))
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return grad * 2

    return Double


@pytest.mark.parametrize("dev", DEVICES)
def test_custom_fwd_with_cast_inputs_turns_that_device_off_inside_as_torch(dev: str) -> None:
    seen: dict[str, list] = {"torch": [], "mixprec": []}
    torch_fn = _function(torch.amp.custom_fwd, dev, seen["torch"])
    mixprec_fn = _function(mixprec.custom_fwd, dev, seen["mixprec"])
    x = torch.randn(3, requires_grad=True)
    for fn, region in ((torch_fn, torch.autocast), (mixprec_fn, mixprec.autocast)):
        with region(dev, dtype=BF16):
            fn.apply(x).sum().backward()
        fn.apply(x)  # outside a region: a no-op decorator
    assert seen["mixprec"] == seen["torch"] and seen["torch"][0][0] is False
    assert x.grad.tolist() == [4.0] * 3
