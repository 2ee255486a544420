"""Semantics of mixprec.autocast: casts, cache, nesting, threads, decorator, errors, torch's bugs."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec import Policy

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@pytest.fixture
def lin() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(8, 8)


@pytest.fixture
def x() -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_lower_fp32_promote_and_unlisted(lin: nn.Linear, x: torch.Tensor, dtype: torch.dtype) -> None:
    with mixprec.autocast("cpu", dtype=dtype):
        y = lin(x)
        assert y.dtype == dtype
        assert (x @ x.t()).dtype == dtype  # Tensor.__matmul__ is matmul
        assert F.mse_loss(y, x).dtype == FP32  # fp32 list: low-precision input cast up
        assert torch.cat([y, x]).dtype == FP32  # promote: widest input wins
        assert torch.relu(y).dtype == dtype  # unlisted: runs in its input's dtype
        assert (y + x).dtype == FP32  # unlisted, ordinary type promotion
        assert x.double().matmul(x.double().t()).dtype == torch.float64  # float64 is never cast
        assert torch.arange(4).dtype == torch.int64


def test_outside_region_nothing_changes(lin: nn.Linear, x: torch.Tensor) -> None:
    with mixprec.autocast("cpu"):
        pass
    assert lin(x).dtype == FP32
    assert not mixprec.is_autocast_enabled("cpu")


def test_gradients_flow_through_recorded_casts(lin: nn.Linear, x: torch.Tensor) -> None:
    x = x.clone().requires_grad_()
    with mixprec.autocast("cpu"):
        loss = lin(x).float().sum()
    loss.backward()
    assert lin.weight.grad is not None and lin.weight.grad.dtype == FP32
    assert x.grad is not None and x.grad.dtype == FP32
    with torch.autocast("cpu", dtype=BF16):
        ref_loss = lin(x).float().sum()
    (ref_w,) = torch.autograd.grad(ref_loss, [lin.weight])
    torch.testing.assert_close(lin.weight.grad, ref_w, rtol=0, atol=0)


def _weight_cast_node(out: torch.Tensor) -> object:
    """The autograd node of the cast of a linear's weight (torch's cache hands out one per region)."""
    (node,) = [f for f, _ in out.grad_fn.next_functions if type(f).__name__ == "TBackward0"]
    return node.next_functions[0][0]


def test_weight_cast_is_cached_for_the_region_and_dropped_on_exit(lin: nn.Linear, x: torch.Tensor) -> None:
    with mixprec.autocast("cpu"):
        first, second = lin(x), lin(x)
        assert _weight_cast_node(first) is _weight_cast_node(second)  # torch's cache: one cast
    with mixprec.autocast("cpu"):
        third = lin(x)
    assert _weight_cast_node(third) is not _weight_cast_node(first)  # dropped when the region exits


def test_cache_disabled_casts_every_time(lin: nn.Linear, x: torch.Tensor) -> None:
    from mixprec.autocast.engine import _state

    with mixprec.autocast("cpu", cache_enabled=False):
        lin(x)
        assert not _state.cache


def test_optimizer_step_inside_region_is_seen(lin: nn.Linear, x: torch.Tensor) -> None:
    """torch.autocast serves the stale cached cast after an optimizer step in the region; mixprec not."""
    opt = torch.optim.SGD(lin.parameters(), lr=0.5)
    for region in (mixprec.autocast("cpu"), torch.autocast("cpu", dtype=BF16)):
        with region:
            lin(x).float().sum().backward()
            opt.step()
            y = lin(x)
        fresh = F.linear(x.bfloat16(), lin.weight.bfloat16(), lin.bias.bfloat16())
        if isinstance(region, mixprec.autocast):
            torch.testing.assert_close(y, fresh, rtol=0, atol=0)
        else:  # the reference bug, kept visible: plain torch.autocast is unchanged by mixprec
            assert not torch.equal(y, fresh)


def test_manual_in_place_update_is_served_the_cached_cast_as_torch(lin: nn.Linear, x: torch.Tensor) -> None:
    """Outside an optimizer step the cast cache is torch's: clear it after editing weights in place."""
    with mixprec.autocast("cpu"):
        lin(x)
        with torch.no_grad():
            lin.weight.mul_(2)
        stale = lin(x)
        torch.clear_autocast_cache()
        y = lin(x)
    fresh = F.linear(x.bfloat16(), lin.weight.bfloat16(), lin.bias.bfloat16())
    assert not torch.equal(stale, fresh)
    torch.testing.assert_close(y, fresh, rtol=0, atol=0)


def test_nested_regions_of_different_dtypes(lin: nn.Linear, x: torch.Tensor) -> None:
    """torch keys its cache by tensor only: a nested fp16 region gets the bf16 weight and fails."""
    with mixprec.autocast("cpu", dtype=BF16):
        assert lin(x).dtype == BF16
        with mixprec.autocast("cpu", dtype=FP16):
            assert lin(x).dtype == FP16
            assert mixprec.get_autocast_dtype("cpu") == FP16
            with mixprec.autocast("cpu", enabled=False):
                assert lin(x).dtype == FP32
                assert not mixprec.is_autocast_enabled("cpu")
            assert lin(x).dtype == FP16
        assert lin(x).dtype == BF16
    with pytest.raises(RuntimeError, match="same dtype"), torch.autocast("cpu", dtype=BF16):
        lin(x)
        with torch.autocast("cpu", dtype=FP16):
            lin(x)


def test_cat_of_bf16_and_fp32_in_fp16_region_is_torchs_unless_the_policy_moves_it() -> None:
    """torch raises 'Unexpected floating ScalarType in at::autocast::prioritize'; so does the default
    policy (it is torch's kernels); a policy that moves cat to "promote" gets the widest dtype."""
    a, b = torch.randn(2).bfloat16(), torch.randn(2)
    with pytest.raises(RuntimeError, match="prioritize"), mixprec.autocast("cpu", dtype=FP16):
        torch.cat([a, b])
    policy = Policy.for_device("cpu").with_ops(promote=["cat", "stack"], fp32=["index_copy"])
    with mixprec.autocast("cpu", dtype=FP16, policy=policy):
        assert torch.cat([a, b]).dtype == FP32
        assert torch.cat([a, a.half()]).dtype == FP32  # bf16 + fp16 -> fp32, the type holding both
        assert torch.stack([a, a]).dtype == BF16  # one dtype: nothing to promote


def test_no_grad_cast_is_not_reused_with_grad(lin: nn.Linear, x: torch.Tensor) -> None:
    with mixprec.autocast("cpu"):
        with torch.no_grad():
            lin(x)
        y = lin(x)
    y.float().sum().backward()
    assert lin.weight.grad is not None


def test_state_is_per_thread(lin: nn.Linear, x: torch.Tensor) -> None:
    results: dict[str, torch.dtype] = {}

    def other() -> None:
        results["other"] = lin(x).dtype
        with mixprec.autocast("cpu", dtype=FP16):
            results["other_region"] = lin(x).dtype

    with mixprec.autocast("cpu"):
        t = threading.Thread(target=other)
        t.start()
        t.join()
        results["main"] = lin(x).dtype
    assert results == {"other": FP32, "other_region": FP16, "main": BF16}


def test_decorator_and_reentrant_use(lin: nn.Linear, x: torch.Tensor) -> None:
    region = mixprec.autocast("cpu")

    @region
    def forward(depth: int) -> torch.Tensor:
        return forward(depth - 1) if depth else lin(x)

    assert forward(3).dtype == BF16
    assert lin(x).dtype == FP32
    with region, region:
        assert lin(x).dtype == BF16
    assert lin(x).dtype == FP32


def test_exception_inside_region_restores_state(lin: nn.Linear, x: torch.Tensor) -> None:
    with pytest.raises(ZeroDivisionError), mixprec.autocast("cpu"):
        lin(x)
        1 / 0  # noqa: B018
    assert lin(x).dtype == FP32
    from mixprec.autocast.engine import _state

    assert not _state.frames and _state.mode is None and not _state.cache


def test_cast_only_tensors_on_the_region_device(x: torch.Tensor) -> None:
    w = torch.randn(8, 8)
    with mixprec.autocast("cuda", dtype=FP16):  # a CUDA region does not touch CPU tensors
        assert (x @ w).dtype == FP32


@pytest.mark.parametrize("bad", [torch.float64, torch.int8, torch.int32])
def test_unsupported_dtype_is_an_error_not_a_silent_disable(bad: torch.dtype) -> None:
    with pytest.raises(ValueError, match=str(bad).removeprefix("torch.")):
        mixprec.autocast("cpu", dtype=bad)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unsupported device_type 'tpu'"):
        mixprec.autocast("tpu")
    with pytest.raises(TypeError, match="enabled must be a bool"):
        mixprec.autocast("cpu", enabled="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="conflicts"):
        mixprec.autocast("cpu", dtype=FP16, policy="bf16-mixed")
    with pytest.raises(ValueError, match="unknown policy preset"):
        mixprec.autocast("cpu", policy="bf16-mixd")


def test_device_strings_and_policy_strings(lin: nn.Linear, x: torch.Tensor) -> None:
    with mixprec.autocast("cpu", policy="16-mixed"):
        assert lin(x).dtype == FP16
    with mixprec.autocast(torch.device("cpu"), policy="p=f32,c=bf16,o=f32,fp32+=linear"):
        assert lin(x).dtype == FP32
    with mixprec.autocast("cpu", policy="conservative"):
        assert torch.softmax(lin(x), -1).dtype == FP32
        assert lin(x).dtype == BF16


def test_user_edited_ops_and_callables(lin: nn.Linear, x: torch.Tensor) -> None:
    def my_op(a: torch.Tensor) -> torch.Tensor:
        return a * 2

    policy = Policy.for_device("cpu", BF16).with_ops(lower=["gelu"], fp32=["matmul"], none=["linear"])
    with mixprec.autocast("cpu", policy=policy):
        assert F.gelu(x).dtype == BF16
        assert (x.bfloat16() @ x.t().bfloat16()).dtype == FP32
        assert lin(x).dtype == FP32  # taken off the lists: runs in its inputs' dtype
    assert policy.category("linear") == "none"


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.seen: list[torch.dtype] = []

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.proj(h)
        self.seen.append(h.dtype)
        return self.norm(h)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.ModuleList([_Block(), _Block()])
        self.head = nn.Linear(8, 4)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for block in self.encoder:
            h = block(h)
        return self.head(h)


@pytest.mark.parametrize(
    "key", ["encoder.1", "encoder.1*", "encoder.*1", lambda m, name: name == "encoder.1"], ids=str
)
def test_module_override_by_name_glob_and_filter(x: torch.Tensor, key: object) -> None:
    torch.manual_seed(0)
    net = _Net()
    policy = Policy.for_device("cpu").with_modules({key: torch.float32})
    with mixprec.autocast("cpu", policy=policy):
        out = net(x)
    assert net.encoder[0].seen == [BF16]
    assert net.encoder[1].seen == [FP32]  # pinned: its linear ran in fp32
    assert out.dtype == BF16  # the head is outside the pin


def test_module_override_by_class_and_by_policy(x: torch.Tensor) -> None:
    torch.manual_seed(0)
    net = _Net()
    policy = Policy.for_device("cpu").with_modules({_Block: "16-mixed"})
    with mixprec.autocast("cpu", policy=policy):
        out = net(x)
    assert net.encoder[0].seen == [FP16] and net.encoder[1].seen == [FP16]
    assert out.dtype == BF16
    pinned = Policy.for_device("cpu").with_modules({nn.Linear: torch.float32})
    with mixprec.autocast("cpu", policy=pinned):
        assert net(x).dtype == FP32
    # the global hooks are only installed while a region with overrides is active; the pinned modules'
    # hooks are listed, and disarm() removes them
    from mixprec.autocast.pins import HOOKS

    assert not HOOKS.root_handles and HOOKS.users == 0
    hooked = [m for m in net.modules() if m._forward_pre_hooks]
    assert hooked and all(m in HOOKS.armed for m in hooked)
    with mixprec.autocast("cpu", policy=pinned), pytest.raises(RuntimeError, match="1 region"):
        HOOKS.disarm()
    HOOKS.disarm()
    assert len(HOOKS.armed) == 0 and not any(m._forward_pre_hooks or m._forward_hooks for m in net.modules())
    with mixprec.autocast("cpu", policy=pinned):
        assert net(x).dtype == FP32  # armed again on the next run


def test_module_override_output_dtype(x: torch.Tensor) -> None:
    torch.manual_seed(0)
    net = _Net()
    inner = Policy.parse("p=f32,c=bf16,o=f32")
    with mixprec.autocast("cpu", policy=Policy.for_device("cpu").with_modules({"encoder.0.proj": inner})):
        net(x)
    assert net.encoder[0].seen == [FP32]  # the policy's output dtype is applied at the module boundary


def test_custom_fwd_bwd_match_torch(x: torch.Tensor) -> None:
    seen: dict[str, torch.dtype] = {}

    class MyMM(torch.autograd.Function):
        @staticmethod
        @mixprec.custom_fwd
        def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            ctx.save_for_backward(a, b)
            out = a.mm(b)
            seen["fwd"] = out.dtype
            return out

        @staticmethod
        @mixprec.custom_bwd
        def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            a, b = ctx.saved_tensors
            ga = grad.mm(b.t())
            seen["bwd"] = ga.dtype
            return ga, a.t().mm(grad)

    a = x.clone().requires_grad_()
    b = torch.randn(8, 3, requires_grad=True)
    with mixprec.autocast("cpu"):
        out = MyMM.apply(a, b)
    out.float().sum().backward()
    assert seen == {"fwd": BF16, "bwd": BF16}

    class Fp32Only(torch.autograd.Function):
        @staticmethod
        @mixprec.custom_fwd(cast_inputs=torch.float32)
        def forward(ctx, a: torch.Tensor) -> torch.Tensor:
            seen["cast"] = a.dtype
            return a.mm(a.t())

        @staticmethod
        @mixprec.custom_bwd
        def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
            return grad

    with mixprec.autocast("cpu"):
        y = Fp32Only.apply(x.bfloat16())
    assert seen["cast"] == FP32 and y.dtype == FP32
    assert Fp32Only.apply(x.bfloat16()).dtype == BF16  # outside a region: a no-op


def test_leaving_a_nested_region_keeps_the_enclosing_module_override(x: torch.Tensor) -> None:
    """A region entered and left inside a pinned module must not drop the pin for the rest of it."""
    seen: list[torch.dtype] = []

    class Pinned(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            seen.append(self.a(h).dtype)
            with mixprec.autocast("cpu", enabled=False):
                pass
            with mixprec.autocast("cpu", dtype=FP16):
                seen.append(self.a(h).dtype)
            seen.append(self.b(h).dtype)
            return h

    net = nn.Sequential(Pinned())
    with mixprec.autocast("cpu", policy=Policy.for_device("cpu").with_modules({"0": torch.float32})):
        net(x)
        seen.append(net[0].a(x).dtype)  # called directly it is its own root, named "": not pinned
    assert seen == [FP32, FP16, FP32, BF16]


def test_cuda_lists_applied_on_cpu_tensors() -> None:
    """The CUDA families (set_opt_dtype, append_dtype, banned) exercised on the CPU via a policy."""
    cuda_rules = Policy.for_device("cuda", BF16)
    x = torch.randn(4, 8)
    with mixprec.autocast("cpu", policy=cuda_rules):
        low = x.bfloat16()
        assert torch.softmax(low, -1).dtype == FP32  # fp32_set_opt_dtype
        assert torch.softmax(low, -1, dtype=BF16).dtype == BF16  # an explicit dtype wins
        assert torch.norm(low).dtype == FP32  # fp32_append_dtype
        assert torch.exp(low).dtype == FP32  # on CUDA's fp32 list, not on CPU's
        assert torch.mm(x, x.t()).dtype == BF16
        with pytest.raises(RuntimeError, match="unsafe to autocast"):
            F.binary_cross_entropy(torch.rand(4), torch.rand(4))
    with mixprec.autocast("cpu", policy=cuda_rules.with_ops(fp32=["binary_cross_entropy"])):
        assert F.binary_cross_entropy(torch.rand(4).bfloat16(), torch.rand(4).bfloat16()).dtype == FP32
    with mixprec.autocast("cuda"):  # banned only for tensors on the region's device
        F.binary_cross_entropy(torch.rand(4), torch.rand(4))


@pytest.mark.parametrize("policy", [None, "p=f32,c=bf16,o=f32,fp32+=linear"])
def test_region_exited_in_another_thread_says_so_and_changes_nothing(policy):
    """torch's autocast state is per thread: a region handed to another thread to exit cannot restore it.
    The exit raises a RuntimeError naming both threads, and both threads' states are as they were."""
    region = mixprec.autocast("cpu", dtype=torch.bfloat16, policy=policy)
    region.__enter__()
    errors = []

    def exit_elsewhere():
        try:
            region.__exit__(None, None, None)
        except RuntimeError as error:
            errors.append((str(error), torch.is_autocast_enabled("cpu"), mixprec.is_autocast_enabled("cpu")))

    worker = threading.Thread(target=exit_elsewhere)
    worker.start()
    worker.join()
    assert len(errors) == 1
    message, torch_on_there, mixprec_on_there = errors[0]
    assert f"entered in thread {threading.get_ident()} and exited in thread" in message
    assert "same thread" in message
    assert not torch_on_there and not mixprec_on_there
    assert torch.is_autocast_enabled("cpu") and mixprec.is_autocast_enabled("cpu")  # still open here
    region.__exit__(None, None, None)  # the right thread closes it
    assert not torch.is_autocast_enabled("cpu") and not mixprec.is_autocast_enabled("cpu")


def test_region_exited_without_entry_says_so():
    with pytest.raises(RuntimeError, match="exited without being entered"):
        mixprec.autocast("cpu").__exit__(None, None, None)
