"""The op catalogue (mixprec.policy.ops) against torch: its source, its docs, its registrations, its
observed behaviour under ``torch.autocast("cpu", ...)`` for bfloat16 and float16."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from mixprec.policy import ops

_ROOT = str(Path(__file__).resolve().parents[2])  # the repository root: makes `tests.autocast` importable
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
from tests.autocast.op_samples import SAMPLE_GROUPS, cpu_op_samples, sample_key  # noqa: E402

LOW_DTYPES = (torch.bfloat16, torch.float16)
TORCH_2_13 = torch.__version__.startswith("2.13")

# --------------------------------------------------------------------------------------------------
# Reference lists from the PyTorch AMP docs (docs/source/amp.md, "Autocast Op Reference"), verbatim.
# --------------------------------------------------------------------------------------------------

DOCS_CUDA_LOWER = [
    "__matmul__", "addbmm", "addmm", "addmv", "addr", "baddbmm", "bmm", "multi_dot", "conv1d", "conv2d",
    "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "GRUCell", "linear", "LSTMCell",
    "matmul", "mm", "mv", "prelu", "RNNCell",
]  # fmt: skip
DOCS_CUDA_FP32 = [
    "__pow__", "__rdiv__", "__rpow__", "__rtruediv__", "acos", "asin", "binary_cross_entropy_with_logits",
    "cosh", "cosine_embedding_loss", "cdist", "cosine_similarity", "cross_entropy", "cumprod", "cumsum",
    "dist", "erfinv", "exp", "expm1", "group_norm", "hinge_embedding_loss", "kl_div", "l1_loss",
    "layer_norm", "log", "log_softmax", "log10", "log1p", "log2", "margin_ranking_loss", "mse_loss",
    "multilabel_margin_loss", "multi_margin_loss", "nll_loss", "norm", "normalize", "pdist",
    "poisson_nll_loss", "pow", "prod", "reciprocal", "rsqrt", "sinh", "smooth_l1_loss", "soft_margin_loss",
    "softmax", "softmin", "softplus", "sum", "renorm", "tan", "triplet_margin_loss",
]  # fmt: skip
DOCS_CUDA_PROMOTE = [
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "grid_sample", "index_put", "scatter_add",
    "tensordot",
]  # fmt: skip

DOCS_CPU_LOWER = [
    "conv1d", "conv2d", "conv3d", "bmm", "mm", "linalg_vecdot", "baddbmm", "addmm", "addbmm", "linear",
    "matmul", "_convolution", "conv_tbc", "mkldnn_rnn_layer", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d", "prelu", "scaled_dot_product_attention", "_native_multi_head_attention",
]  # fmt: skip
DOCS_CPU_FP32 = [
    "avg_pool3d", "binary_cross_entropy", "grid_sampler", "grid_sampler_2d", "_grid_sampler_2d_cpu_fallback",
    "grid_sampler_3d", "polar", "prod", "quantile", "nanquantile", "stft", "cdist", "trace",
    "view_as_complex", "cholesky_inverse", "cholesky_solve", "inverse", "lu_solve", "orgqr", "inverse",
    "ormqr", "pinverse", "max_pool3d", "max_unpool2d", "max_unpool3d", "adaptive_avg_pool3d",
    "reflection_pad1d", "reflection_pad2d", "replication_pad1d", "replication_pad2d", "replication_pad3d",
    "mse_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss",
    "poisson_nll_loss", "cross_entropy_loss", "l1_loss", "huber_loss", "margin_ranking_loss",
    "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss", "ctc_loss", "kl_div",
    "multilabel_margin_loss", "binary_cross_entropy_with_logits", "fft_fft", "fft_ifft", "fft_fft2",
    "fft_ifft2", "fft_fftn", "fft_ifftn", "fft_rfft", "fft_irfft", "fft_rfft2", "fft_irfft2", "fft_rfftn",
    "fft_irfftn", "fft_hfft", "fft_ihfft", "linalg_cond", "linalg_matrix_rank", "linalg_solve",
    "linalg_cholesky", "linalg_svdvals", "linalg_eigvals", "linalg_eigvalsh", "linalg_inv",
    "linalg_householder_product", "linalg_tensorinv", "linalg_tensorsolve",
    "fake_quantize_per_tensor_affine", "geqrf", "_lu_with_info", "qr", "svd", "triangular_solve",
    "fractional_max_pool2d", "fractional_max_pool3d", "adaptive_max_pool3d", "multilabel_margin_loss_forward",
    "linalg_qr", "linalg_cholesky_ex", "linalg_svd", "linalg_eig", "linalg_eigh", "linalg_lstsq",
    "linalg_inv_ex",
]  # fmt: skip
DOCS_CPU_PROMOTE = ["cat", "stack", "index_copy"]

# Docs names that are modules / Python spellings -> ATen names.
DOCS_TO_ATEN = {
    "__matmul__": {"matmul"},
    "multi_dot": {"linalg_multi_dot"},
    "GRUCell": {"gru_cell"},
    "LSTMCell": {"lstm_cell"},
    "RNNCell": {"rnn_tanh_cell", "rnn_relu_cell"},
    "__pow__": {"pow"},
    "__rpow__": {"pow"},
    "__rdiv__": {"reciprocal"},
    "__rtruediv__": {"reciprocal"},
    "normalize": {"norm"},
    "softmin": {"softmax"},
    "grid_sample": {"grid_sampler"},
    # CUDA has no cross_entropy_loss kernel: F.cross_entropy decomposes into log_softmax + nll_loss.
    "cross_entropy": {"log_softmax", "nll_loss"},
}

# The docs lump the three fp32 policies together; the source splits them like this.
SOURCE_CUDA_SET_OPT_DTYPE = {"prod", "softmax", "log_softmax", "cumprod", "cumsum", "sum"}
SOURCE_CUDA_APPEND_DTYPE = {"norm"}

# In the C++ source (autocast_mode.h AT_FORALL_* of torch 2.13, plus autocast_mode.cpp) but not in the
# docs.  The source is what runs, so it wins.
SOURCE_ONLY_CUDA = {
    ops.LOWER: {
        "_convolution", "conv_tbc", "convolution", "einsum", "linalg_vecdot", "chain_matmul",
        "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "_scaled_dot_product_flash_attention",
        "scaled_dot_product_attention", "cudnn_convolution", "cudnn_convolution_transpose",
        "_cudnn_rnn",  # aten/src/ATen/cudnn/AutocastRNN.cpp
    },
    ops.FP32: {
        "native_layer_norm", "rms_norm", "frobenius_norm", "nuclear_norm", "nll_loss2d", "huber_loss",
        "logsumexp", "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d",
        "_upsample_nearest_exact2d", "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d",
        "upsample_bilinear2d", "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d",
        "_upsample_bicubic2d_aa",
    },
    ops.FP32_SET_OPT_DTYPE: {"linalg_vector_norm", "linalg_matrix_norm"},
    ops.FP32_APPEND_DTYPE: set(),
    ops.PROMOTE: {"vdot"},
}  # fmt: skip
# The CPU docs lists omit "cholesky" (they list "inverse" twice), "smooth_l1_loss" and
# "_addmm_activation"; autocast_mode.cpp registers KERNEL_CPU(cholesky, fp32), KERNEL_CPU(smooth_l1_loss,
# fp32) and KERNEL_CPU(_addmm_activation, lower_precision_fp), so the source wins again.
SOURCE_ONLY_CPU = {
    ops.LOWER: {"_addmm_activation"},
    ops.FP32: {"cholesky", "smooth_l1_loss"},
    ops.PROMOTE: set(),
}


def _docs_to_aten(names: list[str]) -> set[str]:
    out: set[str] = set()
    for n in names:
        out |= DOCS_TO_ATEN.get(n, {n})
    return out


# --------------------------------------------------------------------------------------------------
# Structure
# --------------------------------------------------------------------------------------------------


def test_category_of() -> None:
    assert ops.category_of("cpu", "__matmul__") == ops.LOWER
    assert ops.category_of("cpu", "cross_entropy") == ops.FP32
    assert ops.category_of("cuda", "cross_entropy") == ops.FP32  # composite on CUDA
    assert ops.category_of("cpu", "multi_dot") == ops.LOWER  # alias of a CPU composite
    assert ops.category_of("cuda", "softmin") == ops.FP32_SET_OPT_DTYPE
    assert ops.category_of("cpu", "softmax") is None
    assert ops.category_of("cpu", "relu") is None and ops.category_of("cuda", "relu") is None


def test_structure() -> None:
    assert ops.CATEGORIES == (
        ops.LOWER,
        ops.FP32,
        ops.FP32_SET_OPT_DTYPE,
        ops.FP32_APPEND_DTYPE,
        ops.PROMOTE,
    )
    for table in (ops.CPU_OPS, ops.CUDA_OPS):
        assert set(table) == set(ops.CATEGORIES)
        names = [n for cat in ops.CATEGORIES for n in table[cat]]
        assert len(names) == len(set(names)), "an op is in two categories"
        assert all(isinstance(v, frozenset) for v in table.values())
        assert all("." not in n for n in names), "names carry no overload suffix"
    assert not ops.CPU_OPS[ops.FP32_SET_OPT_DTYPE] and not ops.CPU_OPS[ops.FP32_APPEND_DTYPE]
    assert ops.ops_for("cpu") is ops.CPU_OPS and ops.ops_for("cuda") is ops.CUDA_OPS
    with pytest.raises(ValueError):
        ops.ops_for("tpu")


def test_aliases_and_composites_are_consistent() -> None:
    listed = {fam: frozenset().union(*ops.ops_for(fam).values()) for fam in ops.FAMILIES}
    for alias, target in ops.ALIASES.items():
        assert alias != target
        assert any(target in listed[f] for f in ops.FAMILIES), (alias, target)
    for fam, comps in ops.COMPOSITES.items():
        for name, cat in comps.items():
            assert cat in ops.CATEGORIES
            assert name not in listed[fam], f"{name} is listed for {fam}; not a composite"
            assert ops.ALIASES.get(name, name) not in listed[fam], name
    for fam, conds in ops.CONDITIONAL.items():
        for name, (cat, why) in conds.items():
            assert cat in ops.CATEGORIES and why, name
            assert fam in ops.FAMILIES
    everything = set(ops.ALIASES)
    for fam in ops.FAMILIES:
        everything |= listed[fam] | set(ops.COMPOSITES[fam]) | set(ops.CONDITIONAL[fam]) | ops.BANNED_OPS[fam]
    assert everything == ops.ALL_OP_NAMES
    assert isinstance(ops.ALL_OP_NAMES, frozenset)


# --------------------------------------------------------------------------------------------------
# CUDA and CPU lists vs the docs and the C++ source
# --------------------------------------------------------------------------------------------------


def test_cuda_lists_match_docs_plus_source() -> None:
    docs_fp32 = _docs_to_aten(DOCS_CUDA_FP32)
    expected = {
        ops.LOWER: _docs_to_aten(DOCS_CUDA_LOWER),
        ops.FP32_SET_OPT_DTYPE: docs_fp32 & SOURCE_CUDA_SET_OPT_DTYPE,
        ops.FP32_APPEND_DTYPE: docs_fp32 & SOURCE_CUDA_APPEND_DTYPE,
        ops.FP32: docs_fp32 - SOURCE_CUDA_SET_OPT_DTYPE - SOURCE_CUDA_APPEND_DTYPE,
        ops.PROMOTE: _docs_to_aten(DOCS_CUDA_PROMOTE),
    }
    for cat in ops.CATEGORIES:
        want = expected[cat] | SOURCE_ONLY_CUDA[cat]
        got = set(ops.CUDA_OPS[cat])
        assert got == want, f"{cat}: missing {sorted(want - got)}, extra {sorted(got - want)}"


def test_cuda_python_names_resolve_to_docs_category() -> None:
    """Every Python-level name of the CUDA docs resolves (directly, via ALIASES or COMPOSITES) to the
    category the docs give it."""
    fp32_like = {ops.FP32, ops.FP32_SET_OPT_DTYPE, ops.FP32_APPEND_DTYPE}
    modules = {"GRUCell", "LSTMCell", "RNNCell"}  # modules, not functions: checked via DOCS_TO_ATEN
    for names, allowed in (
        (DOCS_CUDA_LOWER, {ops.LOWER}),
        (DOCS_CUDA_FP32, fp32_like),
        (DOCS_CUDA_PROMOTE, {ops.PROMOTE}),
    ):
        for n in set(names) - modules:
            assert _category("cuda", n) in allowed, n


def test_cpu_lists_match_docs_plus_source() -> None:
    for cat, docs in (
        (ops.LOWER, DOCS_CPU_LOWER),
        (ops.FP32, DOCS_CPU_FP32),
        (ops.PROMOTE, DOCS_CPU_PROMOTE),
    ):
        want = set(docs) | SOURCE_ONLY_CPU[cat]
        got = set(ops.CPU_OPS[cat])
        assert got == want, f"{cat}: missing {sorted(want - got)}, extra {sorted(got - want)}"


CUDNN_BUILD_ONLY = {"_cudnn_rnn"}


def _registered(key: str) -> set[str]:
    try:
        regs = torch._C._dispatch_get_registrations_for_dispatch_key(key)
    except (AttributeError, RuntimeError) as exc:  # pragma: no cover - private API moved
        pytest.skip(f"cannot list {key} registrations: {exc}")
    return {r.split("::", 1)[1].split(".", 1)[0] for r in regs if r.startswith("aten::")}


@pytest.mark.skipif(not TORCH_2_13, reason="the catalogue is pinned to torch 2.13's registrations")
@pytest.mark.parametrize("family,key", [("cpu", "AutocastCPU"), ("cuda", "AutocastCUDA")])
def test_lists_equal_torch_registrations(family: str, key: str) -> None:
    """The union of a family's lists (plus banned ops) is exactly the set of ops torch 2.13 registers an
    autocast kernel for (this works in CPU-only builds: the CUDA autocast kernels are registered too)."""
    ours = frozenset().union(*ops.ops_for(family).values()) | ops.BANNED_OPS[family]
    theirs = _registered(key)
    if family == "cuda" and not torch.backends.cudnn.is_available():
        theirs |= CUDNN_BUILD_ONLY  # AutocastRNN.cpp is compiled into cuDNN builds only
    assert ours == theirs, f"missing {sorted(theirs - ours)}, extra {sorted(ours - theirs)}"


# --------------------------------------------------------------------------------------------------
# CPU: observed behaviour of torch.autocast
# --------------------------------------------------------------------------------------------------


_category = ops.category_of


# Samples whose arguments take them out of (or into) their key's category (see ops.CONDITIONAL).
VARIANT_CATEGORY: dict[str, str | None] = {
    "einsum:elementwise": None,
    "einsum:reduce": None,
    "_convolution:allow_tf32": None,  # 13-argument overload: no CPU autocast kernel
    "pad:reflect2d": ops.FP32,
    "pad:replicate3d": ops.FP32,
    "local_response_norm:4d": ops.FP32,
}

_REAL_OF_COMPLEX = {
    torch.complex32: torch.float16,
    torch.complex64: torch.float32,
    torch.complex128: torch.float64,
}


def _sample_category(name: str) -> str | None:
    if name in VARIANT_CATEGORY:
        return VARIANT_CATEGORY[name]
    return _category("cpu", sample_key(name))


def _float_dtypes(out: object) -> list[torch.dtype]:
    """The (real) floating dtypes of every floating / complex tensor in a (nested) output."""
    found: list[torch.dtype] = []
    stack = [out]
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            if o.is_complex():
                found.append(_REAL_OF_COMPLEX[o.dtype])
            elif o.is_floating_point():
                found.append(o.dtype)
        elif isinstance(o, (tuple, list)):
            stack.extend(o)
    return found


def _run(fn, dtype: torch.dtype | None) -> tuple[object, BaseException | None]:
    try:
        if dtype is None:
            return fn(), None
        with torch.autocast("cpu", dtype=dtype):
            return fn(), None
    except Exception as exc:  # torch raising is a result we compare too
        return None, exc


def _prioritize_error(exc: BaseException | None) -> bool:
    return isinstance(exc, RuntimeError) and "Unexpected floating ScalarType" in str(exc)


# CPU LSTMs run through oneDNN's mkldnn_rnn_layer.
LSTM_KEYS = {"mkldnn_rnn_layer", "lstm"}

# Outputs with no floating tensor at all (the fp32 cast is still proven: bf16/fp16 inputs fail
# outside autocast and succeed inside, see test_cpu_autocast_lowp_inputs).
INT_ONLY_OUTPUT = {"linalg_matrix_rank"}


def _check(name: str, low: torch.dtype, out: object, exc: BaseException | None, input_dtype: torch.dtype):
    """Assert the observed autocast result of sample ``name`` matches its catalogue category."""
    cat = _sample_category(name)
    variant = name.partition(":")[2]
    lowp_first = variant.endswith("lowp_first") or variant == "lowp_only"
    # PROMOTE meets a bf16 before any fp32 while the autocast dtype is fp16: torch raises.
    if cat == ops.PROMOTE and low == torch.float16 and lowp_first:
        assert _prioritize_error(exc), f"{name}: expected the prioritize RuntimeError, got {exc!r}"
        return
    # oneDNN may lack a low-precision LSTM kernel (machine dependent: no fp16 one on an AVX512-BF16 CPU,
    # neither bf16 nor fp16 under ONEDNN_MAX_CPU_ISA=AVX2): torch.autocast raises, nothing to observe.
    if sample_key(name) in LSTM_KEYS and isinstance(exc, RuntimeError) and "primitive descriptor" in str(exc):
        return
    assert exc is None, f"{name}: torch.autocast raised {exc!r}"
    got = set(_float_dtypes(out))
    if sample_key(name) in INT_ONLY_OUTPUT:
        assert not got
        return
    assert got, f"{name}: no floating output"
    if cat == ops.LOWER:
        want = low
    elif cat == ops.FP32:
        want = torch.float32
    elif cat == ops.PROMOTE:
        if variant.startswith("mixed"):
            want = torch.float32
        elif variant == "lowp_only":
            want = torch.bfloat16
        else:
            want = input_dtype
    else:
        raise AssertionError(f"{name}: category {cat} not expected on CPU")
    assert got == {want}, f"{name} ({cat}): got {sorted(map(str, got))}, want {want}"


FP32_SAMPLES = cpu_op_samples(include_autocast_only=True)
FP32_IDS = [n for n, _ in FP32_SAMPLES]


@pytest.mark.parametrize("low", LOW_DTYPES, ids=str)
@pytest.mark.parametrize("name,fn", FP32_SAMPLES, ids=FP32_IDS)
def test_cpu_autocast_fp32_inputs(name: str, fn, low: torch.dtype) -> None:
    """Float32 inputs: lower -> low dtype, fp32 -> float32, promote -> widest, anything else unchanged."""
    out, exc = _run(fn, low)
    if _sample_category(name) is None:
        ref, ref_exc = _run(fn, None)
        assert ref_exc is None and exc is None, (name, ref_exc, exc)
        assert _float_dtypes(out) == _float_dtypes(ref), f"{name}: unlisted op changed dtype under autocast"
        return
    _check(name, low, out, exc, torch.float32)


def _lowp_cases() -> list[tuple[str, object, torch.dtype]]:
    cases = []
    for low in LOW_DTYPES:
        for name, fn in cpu_op_samples(dtype=low):
            variant = name.partition(":")[2]
            if variant.startswith("mixed") or variant == "lowp_only":
                continue  # explicit dtypes: identical to the float32-input run
            cases.append(pytest.param(name, fn, low, id=f"{name}-{low}"))
    return cases


@pytest.mark.parametrize("name,fn,low", _lowp_cases())
def test_cpu_autocast_lowp_inputs(name: str, fn, low: torch.dtype) -> None:
    """Low-precision inputs (the autocast dtype itself): makes the fp32 category observable."""
    out, exc = _run(fn, low)
    cat = _sample_category(name)
    if cat is None or name.split(":")[0] in ops.COMPOSITES["cpu"]:
        # Unlisted (or composite): autocast raises only if the plain call raises too.
        ref, ref_exc = _run(fn, None)
        if exc is not None:
            assert ref_exc is not None, f"{name}: torch.autocast raised {exc!r}, plain call did not"
            return
        if cat is None:
            assert ref_exc is None
            assert _float_dtypes(out) == _float_dtypes(ref), f"{name}: unlisted op changed dtype"
            return
    _check(name, low, out, exc, low)


# --------------------------------------------------------------------------------------------------
# The samples themselves
# --------------------------------------------------------------------------------------------------


def test_samples_cover_every_cpu_op_and_composite() -> None:
    names = [n for n, _ in cpu_op_samples()]
    assert len(names) == len(set(names)), "duplicate sample names"
    reached = {ops.ALIASES.get(sample_key(n), sample_key(n)) for n in names}
    for cat in ops.CATEGORIES:
        missing = ops.CPU_OPS[cat] - reached
        assert not missing, f"{cat} ops without a sample: {sorted(missing)}"
    missing = set(ops.COMPOSITES["cpu"]) - {sample_key(n) for n in names}
    assert not missing, f"composites without a sample: {sorted(missing)}"
    unlisted = {sample_key(n) for n, _ in SAMPLE_GROUPS["unlisted"]}
    assert len(unlisted) >= 40
    assert all(_category("cpu", k) is None for k in unlisted - {"_convolution"})
    assert any(":mixed" in n for n in names) and any("grad" in n for n in names)


def test_samples_run_in_fp32_outside_autocast_deterministically() -> None:
    for name, fn in cpu_op_samples():
        assert not torch.is_autocast_enabled("cpu")
        out, exc = _run(fn, None)
        assert exc is None, f"{name}: {exc!r}"
        again = fn()
        flat, flat_again = _flatten(out), _flatten(again)
        assert flat, f"{name}: returned no tensor"
        assert len(flat) == len(flat_again)
        for a, b in zip(flat, flat_again, strict=True):
            # Same inputs every call; LAPACK (e.g. lstsq's gelsy) may still differ in the last ulp.
            assert a.dtype == b.dtype and a.shape == b.shape, name
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), f"{name}: not deterministic"
        if ":mixed" not in name and ":lowp" not in name:
            assert all(d == torch.float32 for d in _float_dtypes(out)), name


def _flatten(out: object) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out.detach()]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _flatten(o)]
    return []
