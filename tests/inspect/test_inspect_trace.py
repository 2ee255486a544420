"""trace_dtypes: per-module op counts by dtype, to check a policy does what was meant."""

import pytest
import torch
from inspect_helpers import assert_no_hooks

from mixprec.autocast import autocast
from mixprec.inspect import DtypeTrace, demo, trace_dtypes
from mixprec.inspect._modules import OUTSIDE
from mixprec.policy import Policy

PINNED = Policy.for_device("cpu", torch.float16).with_modules({"blocks.2": torch.float32})


def _run(model, trace_outside: bool, policy=PINNED):
    inputs = demo.demo_inputs()
    if trace_outside:
        with trace_dtypes(model) as trace, autocast("cpu", policy=policy):
            model(inputs).softmax(0)
    else:
        with autocast("cpu", policy=policy), trace_dtypes(model) as trace:
            model(inputs).softmax(0)
    return trace


def test_counts_follow_the_policy_module_by_module():
    trace = _run(demo.healthy_model(), trace_outside=True)
    assert trace.counts["blocks.0.fc"] == {"linear": {torch.float16: 1}}
    assert trace.counts["blocks.2.fc"] == {"linear": {torch.float32: 1}}
    assert trace.counts["blocks.2.act"] == {"relu": {torch.float32: 1}}
    assert trace.counts["head"] == {"linear": {torch.float16: 1}}
    assert trace.counts[OUTSIDE] == {"softmax": {torch.float16: 1}}
    assert trace.totals["linear"] == {torch.float16: 4, torch.float32: 1}
    assert trace.modules_running("linear", torch.float32) == ["blocks.2.fc"]


def test_either_nesting_order_gives_the_same_counts():
    assert _run(demo.healthy_model(), True).counts == _run(demo.healthy_model(), False).counts


def test_casts_are_counted_only_on_request():
    model = demo.healthy_model()
    with trace_dtypes(model, include_casts=True) as trace, autocast("cpu", dtype=torch.float16):
        model(demo.demo_inputs().half().float())
    assert trace.counts[OUTSIDE]["half"][torch.float16] == 1  # casts the code calls are counted;
    assert "to" not in trace.counts["blocks.0.fc"]  # autocast's own happen inside torch's kernels
    assert "to" not in _run(demo.healthy_model(), True).counts["blocks.0.fc"]


def test_works_with_torch_autocast_and_without_a_model():
    model, inputs = demo.healthy_model(), demo.demo_inputs()
    with trace_dtypes() as trace, torch.autocast("cpu", dtype=torch.bfloat16):
        model(inputs)
    assert trace.counts == {OUTSIDE: {"linear": {torch.bfloat16: 5}, "relu": {torch.bfloat16: 4}}}


def test_table_lists_every_module_and_dtype():
    table = _run(demo.healthy_model(), True).table()
    header, rule, *rows = table.splitlines()
    assert "float16" in header and "float32" in header and set(rule) == {"-"}
    assert any(row.startswith("blocks.2.fc") and row.split()[-1] == "1" for row in rows)
    assert rows[-1].startswith(OUTSIDE)


def test_hooks_only_while_active_and_no_reentry():
    model = demo.healthy_model()
    trace = DtypeTrace(model)
    assert_no_hooks(model)
    with trace:
        assert model.blocks[0].fc._forward_pre_hooks
        with pytest.raises(RuntimeError, match="already active"):
            trace.__enter__()
    assert_no_hooks(model)
    with pytest.raises(TypeError, match="nn.Module"):
        trace_dtypes("model")
