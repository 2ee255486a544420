"""The gradient pass, and the grouping it reads, against torch's check-and-unscale op, bit for bit."""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mixprec.scaling import unscale
from mixprec.scaling.grads import collect_grads

from .helpers import bits_equal, no_host_sync

KERNELS = [unscale.per_tensor_kernel, unscale.foreach_kernel]
SPECIAL = [0.0, -0.0, 1e-45, -1e-45, 1e-38, 3.4e38, -3.4e38, 65504.0, 1e-8, 1.0, -2.5]
values = st.one_of(
    st.floats(width=32, allow_nan=False, allow_infinity=False),
    st.sampled_from(SPECIAL),
    st.sampled_from([math.inf, -math.inf, math.nan]),
)


def reference(grads, inv_scale):
    grads = [g.clone() for g in grads]
    found_inf = torch.zeros(())
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
    return grads, found_inf


def check_with(kernel, groups, inv_scale, unscale_=True):
    """check_and_unscale_ measuring amax, with ``kernel`` as the CPU's public-op kernel."""
    with mock.patch.dict(unscale.KERNELS, {"cpu": kernel}):
        return unscale.check_and_unscale_(groups, inv_scale, unscale_, want_amax=True)


def mixprec_pass(tensors, inv_scale, kernel, unscale_=True):
    tensors = [g.clone() for g in tensors]
    groups = {torch.device("cpu"): {tensors[0].dtype: tensors}}
    found_inf, amax = check_with(kernel, groups, inv_scale, unscale_)
    return tensors, found_inf[torch.device("cpu")], amax[torch.device("cpu")]


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@settings(max_examples=60, deadline=None)
@given(
    data=st.lists(st.lists(values, min_size=0, max_size=12), min_size=1, max_size=4),
    scale=st.sampled_from([2.0**16, 1.0, 3.0, 0.5, 2.0**-10, 7.0e3, 2.0**100]),
)
def test_matches_torch_kernel_bit_for_bit(kernel, dtype, data, scale):
    grads = [torch.tensor(row, dtype=torch.float32).to(dtype) for row in data]
    inv_scale = torch.tensor(scale, dtype=torch.float64).reciprocal().float()
    expected, expected_found = reference(grads, inv_scale)
    got, found_inf, amax = mixprec_pass(grads, inv_scale, kernel)
    assert found_inf.item() == expected_found.item()
    assert all(bits_equal(a, b) for a, b in zip(got, expected, strict=True))
    if not found_inf.item():
        finite = [g.float().abs().max() for g in grads if g.numel()]
        want = (torch.stack(finite).max() * inv_scale).item() if finite else 0.0
        assert amax.item() == want


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.__name__)
def test_check_only_leaves_gradients_alone(kernel):
    grads = [torch.tensor([3.0, -8.0]), torch.tensor([float("-inf")])]
    got, found_inf, _ = mixprec_pass(grads, torch.tensor(0.25), kernel, unscale_=False)
    assert found_inf.item() == 1.0
    assert all(bits_equal(a, b) for a, b in zip(got, grads, strict=True))
    _, found_inf, amax = mixprec_pass(grads[:1], torch.tensor(0.25), kernel, unscale_=False)
    assert found_inf.item() == 0.0 and amax.item() == 2.0  # amax is always reported unscaled


def test_groups_by_dtype_and_takes_sparse_values():
    dense = torch.nn.Parameter(torch.zeros(3))
    dense.grad = torch.ones(3)
    half = torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
    half.grad = torch.ones(2, dtype=torch.bfloat16)
    sparse = torch.nn.Parameter(torch.zeros(5, 2))
    sparse.grad = torch.sparse_coo_tensor([[0, 3]], torch.ones(2, 2), (5, 2), check_invariants=True)
    untouched = torch.nn.Parameter(torch.zeros(1))
    groups = collect_grads([dense, half, sparse, untouched], allow_fp16=False)
    by_dtype = groups[torch.device("cpu")]
    assert [t.shape for t in by_dtype[torch.float32]] == [(3,), (2, 2)]
    assert len(by_dtype[torch.bfloat16]) == 1


def test_fp16_gradients_need_opting_in_and_sparse_fp16_is_coalesced():
    param = torch.nn.Parameter(torch.zeros(4, 1, dtype=torch.float16))
    param.grad = torch.sparse_coo_tensor(
        [[1, 1]], torch.ones(2, 1, dtype=torch.float16), (4, 1), check_invariants=True
    )
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        collect_grads([param], allow_fp16=False)
    groups = collect_grads([param], allow_fp16=True)
    assert param.grad.is_coalesced()
    assert groups[torch.device("cpu")][torch.float16][0].tolist() == [[2.0]]


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.__name__)
def test_empty_gradients_and_no_sync(kernel):
    grads = [torch.empty(0), torch.tensor([1.0, 2.0]), torch.empty(0, 3)]
    groups = {torch.device("cpu"): {torch.float32: grads}}
    with no_host_sync():
        found_inf, amax = check_with(kernel, groups, torch.tensor(0.5))
    assert found_inf[torch.device("cpu")].item() == 0.0 and amax[torch.device("cpu")].item() == 1.0
    groups = {torch.device("cpu"): {torch.float32: [torch.empty(0)]}}
    found_inf, amax = check_with(kernel, groups, torch.tensor(0.5))
    assert found_inf[torch.device("cpu")].item() == 0.0 and amax[torch.device("cpu")].item() == 0.0
