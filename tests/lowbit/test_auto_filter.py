"""mixprec.lowbit.auto_filter: torchao's filtering tests with mixprec's filter substituted, its errors,
and the planner and the filter agreeing on which layers are too small to gain (issue 33 item 3).

``test_end_to_end_filtering`` and ``test_exact_boundary_dimensions_*`` are copied from torchao's
test/float8/test_auto_filter.py (pytorch/ao at 36027d82, BSD 3-Clause, Copyright (c) Meta Platforms, Inc.
and affiliates), with torchao's three functions replaced by the shims below; torchao's own functions run
the same cases in the same run as the oracle.
"""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch
from torch import nn

from mixprec.lowbit import auto_filter, convert_to_lowbit_training, lowbit_linears
from mixprec.lowbit.cost import TARGETS, gemm_cost, relative_cost
from mixprec.plan import plan_precision

#: torchao's thresholds come from measured H100 speedups; the roofline meets them at these settings
#: (with the quantization priced on CUDA eager's Triton path, pinned so that MIXPREC_FUSED_QUANTIZE in
#: the environment does not change the test; the compiled path's decisions agree, checked below).
AS_TORCHAO = {"target": "h100", "tokens_per_step": 16384, "min_gain": 0.28, "quantize": "triton"}


def _auto_filter_for_recipe(recipe, filter_fqns):
    return auto_filter(f"fp8_{recipe}", filter_fqns=filter_fqns, **AS_TORCHAO)


def _auto_filter_for_rowwise(mod, fqn, filter_fqns):
    return _auto_filter_for_recipe("rowwise", filter_fqns)(mod, fqn)


def _auto_filter_for_tensorwise(mod, fqn, filter_fqns):
    return _auto_filter_for_recipe("tensorwise", filter_fqns)(mod, fqn)


END_TO_END = [
    # Tensorwise tests
    ("tensorwise", (8192, 2048), "valid.layer", [], True),
    # FQN matches filter
    ("tensorwise", (8192, 2048), "skip_layer.linear", ["skip_layer"], False),
    # Threshold fail
    ("tensorwise", (4096, 1024), "valid.layer", [], False),
    # Rowwise tests
    ("rowwise", (4096, 8192), "valid.layer", [], True),
    ("rowwise", (4096, 8192), "skip_layer.linear", ["skip_layer"], False),
    # Combined threshold fail
    ("rowwise", (2048, 4096), "valid.layer", [], False),
]


# ---- torchao's tests (copied; torchao's names bound to mixprec above) --------------------------------
@pytest.mark.parametrize("recipe_type,module_dims,fqn,filter_fqns,expected", END_TO_END)
def test_end_to_end_filtering(recipe_type, module_dims, fqn, filter_fqns, expected):
    """Test complete filtering workflow for both recipe types."""
    in_features, out_features = module_dims

    # Get the filter function
    filter_func = _auto_filter_for_recipe(recipe_type, filter_fqns)

    # Create test module
    test_module = nn.Linear(in_features, out_features)

    # Test filtering
    result = filter_func(test_module, fqn)
    assert result is expected


def test_exact_boundary_dimensions_rowwise():
    """Test exact boundary dimensions for rowwise filtering."""
    # Test exact thresholds
    module_n_2048 = nn.Linear(4096, 2048)  # N exactly 2048
    assert _auto_filter_for_rowwise(module_n_2048, "layer", []) is False

    module_k_1024 = nn.Linear(1024, 4112)  # K exactly 1024
    assert _auto_filter_for_rowwise(module_k_1024, "layer", []) is False


def test_exact_boundary_dimensions_tensorwise():
    """Test exact boundary dimensions for tensorwise filtering."""
    # Test exact combined threshold
    module_boundary = nn.Linear(4096, 1024)  # K=4096, N=1024
    assert _auto_filter_for_tensorwise(module_boundary, "layer", []) is False


# ---- mixprec's own ---------------------------------------------------------------------------------
def test_torchaos_own_filter_gives_the_same_answers_in_this_run() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ao = pytest.importorskip("torchao.float8.float8_linear_utils")
    cases = [(r, dims, fqn, fqns) for r, dims, fqn, fqns, _ in END_TO_END]
    cases += [("rowwise", (4096, 2048), "layer", []), ("rowwise", (1024, 4112), "layer", [])]
    cases += [("tensorwise", (4096, 1024), "layer", [])]
    with torch.device("meta"):
        for recipe, (k, n), fqn, fqns in cases:
            module = nn.Linear(k, n)
            theirs = ao._auto_filter_for_recipe(recipe, fqns)(module, fqn)
            assert _auto_filter_for_recipe(recipe, fqns)(module, fqn) is theirs, (recipe, k, n, fqn)


def test_the_compiled_paths_decisions_are_torchaos_too() -> None:
    for recipe, (k, n), fqn, fqns, expected in END_TO_END:
        fn = auto_filter(f"fp8_{recipe}", filter_fqns=fqns, **{**AS_TORCHAO, "quantize": None}, compiled=True)
        assert fn(nn.Linear(k, n, device="meta"), fqn) is expected, (recipe, k, n)


def test_it_is_the_roofline_at_the_given_rows_and_gain() -> None:
    fn = auto_filter("fp8_tensorwise", **AS_TORCHAO)
    h100 = TARGETS["h100"]
    with torch.device("meta"):
        for k, n in ((8192, 2048), (4096, 1024), (2048, 4096)):
            ratio = gemm_cost(h100, "fp8_tensorwise", 16384, n, k) / gemm_cost(h100, "bf16", 16384, n, k)
            assert fn(nn.Linear(k, n), "x") is (ratio < 1 - 0.28)
        # fewer tokens per step: the casts weigh more, a layer that gained at 16384 rows no longer does
        assert fn(nn.Linear(8192, 2048), "x") is True
        few = auto_filter("fp8_tensorwise", target="h100", tokens_per_step=1024, min_gain=0.28)
        assert few(nn.Linear(8192, 2048), "x") is False
        # dims that are not multiples of 16 have no tensor-core kernel; a non-Linear is never converted
        assert fn(nn.Linear(8200, 8192), "x") is False and fn(nn.Conv1d(4, 4, 1), "x") is False


def test_it_drives_convert_to_lowbit_training() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    # a user cost in which every low-bit format costs half of bf16: both convert; b200 at 16 rows: none
    cost = lambda fmt, m, n, k: 1.0 if fmt == "bf16" else 0.5  # noqa: E731
    convert_to_lowbit_training(
        model, "mxfp8", module_filter_fn=auto_filter("mxfp8", tokens_per_step=64, target=cost)
    )
    assert [f for f, _ in lowbit_linears(model)] == ["0", "2"]
    small = nn.Sequential(nn.Linear(32, 32))
    with pytest.warns(UserWarning):  # nothing converted: the swap says so
        convert_to_lowbit_training(small, "mxfp8", module_filter_fn=auto_filter("mxfp8", tokens_per_step=16))
    assert type(small[0]) is nn.Linear


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"tokens_per_step": 0}, "tokens_per_step must be a positive int"),
        ({"tokens_per_step": 12.5}, "tokens_per_step must be a positive int .* got 12.5"),
        ({"tokens_per_step": True}, "tokens_per_step must be a positive int"),
        ({"tokens_per_step": 8, "target": "a100"}, "unknown cost target 'a100'; known: h100"),
        ({"tokens_per_step": 8, "min_gain": 1.0}, r"min_gain must be a share in \[0, 1\), got 1.0"),
    ],
)
def test_bad_arguments_are_refused_by_name(kwargs, error) -> None:
    with pytest.raises(ValueError, match=error):
        auto_filter("mxfp8", **kwargs)


def test_unknown_recipe_and_bad_filter_fqns() -> None:
    with pytest.raises(ValueError, match="fp8_rowwize"):
        auto_filter("fp8_rowwize", tokens_per_step=8)
    with pytest.raises(TypeError, match="filter_fqns must be a sequence of strings, got 'head'"):
        auto_filter("mxfp8", tokens_per_step=8, filter_fqns="head")


def test_the_planner_and_the_filter_agree_on_which_layers_are_too_small() -> None:
    torch.manual_seed(0)
    widths = [64, 2048, 2048, 1024, 64]
    layers: list[nn.Module] = []
    for k, n in itertools.pairwise(widths):
        layers += [nn.Linear(k, n), nn.ReLU()]
    model = nn.Sequential(*layers[:-1])
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 64, generator=g), torch.randn(8, 64, generator=g))]

    def loss_fn(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return nn.functional.mse_loss(m(batch[0]), batch[1])

    for tokens in (512, 4096):
        # a budget no format breaks, so only the cost decides: a layer stays bf16 only where it cannot gain
        plan = plan_precision(
            model,
            batches,
            loss_fn,
            formats=("fp8_tensorwise", "bf16"),
            budget=1.0,
            cost="h100",
            tokens_per_step=tokens,
        )
        fn = auto_filter("fp8_tensorwise", tokens_per_step=tokens, target="h100")
        converted = {fqn for fqn, m in model.named_modules() if fn(m, fqn)}
        assert converted == {f for f, fmt in plan.formats.items() if fmt == "fp8_tensorwise"}, tokens
        for fqn, info in plan.layers.items():
            ratio = relative_cost(
                lambda *a: gemm_cost(TARGETS["h100"], *a), "fp8_tensorwise", tokens, *info["shape"][1:]
            )
            assert (fqn in converted) is (ratio < 1), (tokens, fqn, ratio)
        if tokens == 4096:
            assert converted == {"2"}  # the 2048 x 2048 layer; the others are memory-bound there
        else:
            assert converted == set()
