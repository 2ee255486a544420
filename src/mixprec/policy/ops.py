"""The autocast op catalogue: which ops run in which precision, as plain data.

A mixprec region is torch's autocast state, so torch's own kernels apply these lists to the default
policy; the catalogue is what a policy is edited against and reported from. Where a policy moves an op,
mixprec's deviation mode (a ``torch.overrides.TorchFunctionMode``) sees Python-level torch functions and
Tensor methods (``torch.nn.functional.linear``, ``torch.matmul``, ``Tensor.__matmul__``, ``torch._VF.lstm``,
``F.cross_entropy`` ...) by their ``__name__``, and looks that name up here.

Where the lists come from
-------------------------
The lists are those of PyTorch's own autocast, ``aten/src/ATen/autocast_mode.cpp`` (the CPU list is
spelled out there; the CUDA lists are the ``AT_FORALL_*`` macros of ``aten/src/ATen/autocast_mode.h``,
plus the two cudnn convolutions registered directly in the .cpp and ``_cudnn_rnn`` from
``aten/src/ATen/cudnn/AutocastRNN.cpp``) as shipped in torch 2.13.  They were
checked against the kernels torch 2.13 actually registers (``torch._C._dispatch_get_registrations_for_
dispatch_key("AutocastCPU" / "AutocastCUDA")``, which works in CPU-only builds too, where only
``_cudnn_rnn`` is missing) and, for CPU, by
running every op under ``torch.autocast("cpu", dtype=torch.bfloat16)`` and ``torch.float16`` (the CPU
float16 autocast uses the very same lists; only the target dtype differs).  The tests in
``tests/policy/test_ops_catalogue.py`` redo all of these checks.

Names are ATen operator names without the overload suffix (``conv_transpose2d``, not
``conv_transpose2d.input``); one name per op.  Where torch registers an autocast kernel only for some
overloads of an op, ``PARTIAL_OVERLOADS`` says which calls are *not* autocast.

Categories (``torch.autocast``'s ``CastPolicy``)
-----------------------------------------------
``LOWER``               cast every floating input to the low-precision dtype (bf16 / fp16), run there.
``FP32``                cast every floating input to float32, run there.
``FP32_SET_OPT_DTYPE``  ops with an optional ``dtype=`` argument (softmax, sum, cumsum ...): when the
                        caller gave no ``dtype`` and the first tensor argument is eligible, run with
                        ``dtype=torch.float32`` (so the output is float32); an explicit ``dtype`` wins.
``FP32_APPEND_DTYPE``   ``norm`` overloads without a dtype: redispatch to the dtype overload with
                        ``dtype=float32`` when the first argument is eligible.
``PROMOTE``             ops needing equal input dtypes: run in the widest floating input dtype (float32
                        if any eligible input is float32, else the low dtype).

Eligibility (applies to every category): only floating-point tensors on the autocast device that are
not float64 are cast; float64, integer, bool and complex tensors, and non-tensor arguments, are left
alone.  Calls with ``out=`` and in-place variants are never autocast.  ``PROMOTE`` in torch raises
``RuntimeError("Unexpected floating ScalarType in at::autocast::prioritize")`` when it meets a floating
dtype that is neither float32 nor the current low dtype before any float32 input (e.g. ``torch.cat
([bf16, fp32])`` under a float16 autocast; ``[fp32, bf16]`` is fine).

Python-level names
------------------
``ALIASES`` maps Python-level ``__name__`` s that differ from the ATen name (``__matmul__``,
``cross_entropy``, ``grid_sample`` ...) to the ATen name used in the lists.  ``COMPOSITES`` lists, per
device family, Python-level names that are in no list but whose ATen decomposition reaches listed ops,
so ``torch.autocast`` changes their dtype anyway (e.g. ``torch.einsum`` decomposes into ``bmm``).  Some
of those only apply for some arguments; ``CONDITIONAL`` describes those conditions (and a few
argument-dependent cases that are *not* in ``COMPOSITES`` at all, such as ``F.pad``).
``category_of(family, name)`` resolves a name through all of these (except ``CONDITIONAL``).
"""

from __future__ import annotations

__all__ = [
    "ALIASES",
    "ALL_OP_NAMES",
    "BANNED_OPS",
    "CATEGORIES",
    "COMPOSITES",
    "CONDITIONAL",
    "CPU_OPS",
    "CUDA_OPS",
    "FAMILIES",
    "FP32",
    "FP32_APPEND_DTYPE",
    "FP32_SET_OPT_DTYPE",
    "LOWER",
    "PARTIAL_OVERLOADS",
    "PROMOTE",
    "category_of",
    "ops_for",
]

LOWER = "lower"
FP32 = "fp32"
PROMOTE = "promote"
FP32_SET_OPT_DTYPE = "fp32_set_opt_dtype"
FP32_APPEND_DTYPE = "fp32_append_dtype"

CATEGORIES: tuple[str, ...] = (LOWER, FP32, FP32_SET_OPT_DTYPE, FP32_APPEND_DTYPE, PROMOTE)

FAMILIES: tuple[str, ...] = ("cpu", "cuda")

# --------------------------------------------------------------------------------------------------
# CPU  (TORCH_LIBRARY_IMPL(aten, AutocastCPU, m) in autocast_mode.cpp; bf16 and fp16 share the lists)
# --------------------------------------------------------------------------------------------------

_CPU_LOWER = frozenset(
    {
        "conv1d",  # default and .padding (string padding) overloads
        "conv2d",  # default and .padding
        "conv3d",  # default and .padding
        "bmm",
        "mm",
        "linalg_vecdot",
        "baddbmm",
        "addmm",
        "_addmm_activation",
        "addbmm",
        "linear",
        "_convolution",  # only the 12-argument .deprecated overload (see PARTIAL_OVERLOADS)
        "matmul",
        "conv_tbc",
        "mkldnn_rnn_layer",  # no Python binding: reached through torch._VF.lstm (nn.LSTM) on CPU
        "conv_transpose1d",
        "conv_transpose2d",  # .input overload
        "conv_transpose3d",  # .input overload
        "prelu",
        "scaled_dot_product_attention",
        "_native_multi_head_attention",  # nn.MultiheadAttention's inference fast path
    }
)

_CPU_FP32 = frozenset(
    {
        "avg_pool3d",
        "binary_cross_entropy",  # CPU runs it in fp32; CUDA bans it (see BANNED_OPS)
        "grid_sampler",
        "polar",
        "prod",  # default and .dim_int (.dim_Dimname has no kernel)
        "quantile",  # default (tensor q) and .scalar
        "nanquantile",  # default (tensor q) and .scalar
        "stft",  # default and .center
        "cdist",
        "grid_sampler_2d",
        "_grid_sampler_2d_cpu_fallback",
        "grid_sampler_3d",
        "trace",
        "view_as_complex",
        "cholesky",
        "cholesky_inverse",
        "cholesky_solve",
        "inverse",
        "lu_solve",  # the legacy torch.lu_solve; torch.linalg.lu_solve (linalg_lu_solve) is NOT listed
        "orgqr",
        "ormqr",
        "pinverse",
        "max_pool3d",  # F.max_pool3d(return_indices=True) is max_pool3d_with_indices: NOT listed
        "max_unpool2d",
        "max_unpool3d",
        "adaptive_avg_pool3d",
        "reflection_pad1d",
        "reflection_pad2d",  # (no reflection_pad3d)
        "replication_pad1d",
        "replication_pad2d",
        "replication_pad3d",
        "mse_loss",
        "cosine_embedding_loss",
        "nll_loss",
        "nll_loss2d",
        "hinge_embedding_loss",
        "poisson_nll_loss",
        "smooth_l1_loss",
        "cross_entropy_loss",
        "l1_loss",
        "huber_loss",
        "margin_ranking_loss",
        "soft_margin_loss",
        "triplet_margin_loss",
        "multi_margin_loss",
        "ctc_loss",  # .IntList and .Tensor overloads
        "kl_div",
        "multilabel_margin_loss",
        "binary_cross_entropy_with_logits",
        "fft_fft",
        "fft_ifft",
        "fft_fft2",
        "fft_ifft2",
        "fft_fftn",
        "fft_ifftn",
        "fft_rfft",
        "fft_irfft",
        "fft_rfft2",
        "fft_irfft2",
        "fft_rfftn",
        "fft_irfftn",
        "fft_hfft",
        "fft_ihfft",
        "linalg_cond",  # default and .p_str
        "linalg_matrix_rank",  # default, .tol_tensor, .atol_rtol_tensor, .atol_rtol_float
        "linalg_solve",
        "linalg_cholesky",
        "linalg_svdvals",
        "linalg_eigvals",
        "linalg_eigvalsh",
        "linalg_inv",
        "linalg_householder_product",
        "linalg_tensorinv",
        "linalg_tensorsolve",
        "fake_quantize_per_tensor_affine",  # not the .tensor_qparams overload
        "geqrf",
        "_lu_with_info",
        "qr",
        "svd",
        "triangular_solve",
        "fractional_max_pool2d",
        "fractional_max_pool3d",
        "adaptive_max_pool3d",
        "multilabel_margin_loss_forward",  # no Python binding: reached through F.multilabel_margin_loss
        "linalg_qr",
        "linalg_cholesky_ex",
        "linalg_svd",
        "linalg_eig",
        "linalg_eigh",
        "linalg_lstsq",
        "linalg_inv_ex",
    }
)

_CPU_PROMOTE = frozenset({"stack", "cat", "index_copy"})  # index_copy: default overload (not .dimname)

CPU_OPS: dict[str, frozenset[str]] = {
    LOWER: _CPU_LOWER,
    FP32: _CPU_FP32,
    FP32_SET_OPT_DTYPE: frozenset(),
    FP32_APPEND_DTYPE: frozenset(),
    PROMOTE: _CPU_PROMOTE,
}

# --------------------------------------------------------------------------------------------------
# CUDA  (TORCH_LIBRARY_IMPL(aten, Autocast, m): the AT_FORALL_* lists of autocast_mode.h)
# --------------------------------------------------------------------------------------------------

_CUDA_LOWER = frozenset(
    {
        "_convolution",  # default and .deprecated
        "conv1d",  # default overload only: .padding (string padding) decomposes to `convolution`
        "conv2d",  # default only (as conv1d)
        "conv3d",  # default only (as conv1d)
        "conv_tbc",
        "conv_transpose1d",
        "conv_transpose2d",
        "conv_transpose3d",
        "convolution",
        "prelu",
        "addmm",
        "addmv",
        "addr",
        "matmul",
        "einsum",
        "mm",
        "mv",
        "linalg_vecdot",
        "linear",
        "addbmm",
        "baddbmm",
        "bmm",
        "chain_matmul",
        "linalg_multi_dot",
        "_thnn_fused_lstm_cell",
        "_thnn_fused_gru_cell",
        "lstm_cell",
        "gru_cell",
        "rnn_tanh_cell",
        "rnn_relu_cell",
        "_scaled_dot_product_flash_attention",
        "scaled_dot_product_attention",
        "cudnn_convolution",  # registered directly in autocast_mode.cpp
        "cudnn_convolution_transpose",  # registered directly in autocast_mode.cpp
        # aten/src/ATen/cudnn/AutocastRNN.cpp (CUDA builds with cuDNN only): every cuDNN RNN (nn.LSTM,
        # nn.GRU, nn.RNN) reaches it; it casts input, hx, cx and the flat weights to float16 *always*
        # (hard-coded kHalf, also inside a bfloat16 autocast region).
        "_cudnn_rnn",
    }
)

_CUDA_FP32 = frozenset(
    {
        "acos",
        "asin",
        "cosh",
        "erfinv",
        "exp",
        "expm1",
        "log",
        "log10",
        "log2",
        "log1p",
        "reciprocal",
        "rsqrt",
        "sinh",
        "tan",
        "pow",  # .Tensor_Scalar, .Tensor_Tensor, .Scalar
        "softplus",
        "layer_norm",
        "native_layer_norm",
        "rms_norm",
        "group_norm",
        "frobenius_norm",  # .dim overload
        "nuclear_norm",  # default and .dim
        "cosine_similarity",
        "poisson_nll_loss",
        "cosine_embedding_loss",
        "nll_loss",
        "nll_loss2d",
        "hinge_embedding_loss",
        "kl_div",
        "l1_loss",
        "smooth_l1_loss",
        "huber_loss",
        "mse_loss",
        "margin_ranking_loss",
        "multilabel_margin_loss",
        "soft_margin_loss",
        "triplet_margin_loss",
        "multi_margin_loss",
        "binary_cross_entropy_with_logits",
        "dist",
        "pdist",
        "cdist",
        "renorm",
        "logsumexp",
        "upsample_nearest1d",  # the upsample_* kernels are on the default overloads; the .vec overloads
        "_upsample_nearest_exact1d",  # that F.interpolate calls decompose into them
        "upsample_nearest2d",
        "_upsample_nearest_exact2d",
        "upsample_nearest3d",
        "_upsample_nearest_exact3d",
        "upsample_linear1d",
        "upsample_bilinear2d",
        "_upsample_bilinear2d_aa",
        "upsample_trilinear3d",
        "upsample_bicubic2d",
        "_upsample_bicubic2d_aa",
    }
)

_CUDA_FP32_SET_OPT_DTYPE = frozenset(
    {
        "prod",  # default and .dim_int
        "softmax",  # .int
        "log_softmax",  # .int
        "cumprod",
        "cumsum",
        "linalg_vector_norm",
        "linalg_matrix_norm",  # default and .str_ord
        "sum",  # default and .dim_IntList
    }
)

_CUDA_FP32_APPEND_DTYPE = frozenset({"norm"})  # .Scalar and .ScalarOpt_dim (the overloads without dtype)

_CUDA_PROMOTE = frozenset(
    {
        "addcdiv",
        "addcmul",
        "atan2",
        "bilinear",
        "cross",
        "dot",
        "vdot",
        "grid_sampler",
        "index_put",
        "tensordot",
        "scatter_add",
    }
)

CUDA_OPS: dict[str, frozenset[str]] = {
    LOWER: _CUDA_LOWER,
    FP32: _CUDA_FP32,
    FP32_SET_OPT_DTYPE: _CUDA_FP32_SET_OPT_DTYPE,
    FP32_APPEND_DTYPE: _CUDA_FP32_APPEND_DTYPE,
    PROMOTE: _CUDA_PROMOTE,
}

# Ops whose autocast kernel raises instead of casting.  CUDA: "torch.nn.functional.binary_cross_entropy
# and torch.nn.BCELoss are unsafe to autocast" (use binary_cross_entropy_with_logits).
BANNED_OPS: dict[str, frozenset[str]] = {
    "cpu": frozenset(),
    "cuda": frozenset({"binary_cross_entropy"}),
}

# Overloads WITHOUT an autocast kernel, for ops that are otherwise listed (torch 2.13 registrations;
# TorchScript-only scalar overloads such as ``log.int`` and ``out=`` overloads are left out).
PARTIAL_OVERLOADS: dict[str, dict[str, str]] = {
    "cpu": {
        "_convolution": "only the 12-argument .deprecated overload is autocast; the 13-argument overload "
        "(with allow_tf32) runs in the input dtype",
        "mm": "mm.dtype (out_dtype=) is not autocast",
        "bmm": "bmm.dtype (out_dtype=) is not autocast",
        "addmm": "addmm.dtype (out_dtype=) is not autocast",
        "baddbmm": "baddbmm.dtype (out_dtype=) is not autocast",
        "polar": "only the Tensor overload (the scalar overloads are TorchScript-only)",
        "fake_quantize_per_tensor_affine": ".tensor_qparams (tensor scale / zero_point) is not autocast",
        "prod": ".dim_Dimname (named tensors) is not autocast",
        "index_copy": ".dimname (named tensors) is not autocast",
    },
    "cuda": {
        "conv1d": ".padding (string padding) has no kernel of its own; it decomposes into `convolution`, "
        "which is listed, so the result is the same",
        "conv2d": "as conv1d",
        "conv3d": "as conv1d",
        "mm": "mm.dtype (out_dtype=) is not autocast",
        "bmm": "bmm.dtype (out_dtype=) is not autocast",
        "addmm": "addmm.dtype (out_dtype=) is not autocast",
        "baddbmm": "baddbmm.dtype (out_dtype=) is not autocast",
        "einsum": ".sublist is not autocast",
        "index_put": ".hacked_twin is not autocast",
        "norm": "only .Scalar and .ScalarOpt_dim (the overloads without dtype): an explicit dtype wins",
        "_scaled_dot_product_flash_attention": ".quantized is not autocast",
        "softmax": ".Dimname is not autocast (named tensors); an explicit dtype= wins",
        "log_softmax": ".Dimname is not autocast (named tensors); an explicit dtype= wins",
        "sum": ".dim_DimnameList is not autocast; an explicit dtype= wins",
        "prod": ".dim_Dimname is not autocast; an explicit dtype= wins",
        "cumsum": ".dimname is not autocast; an explicit dtype= wins",
        "cumprod": ".dimname is not autocast; an explicit dtype= wins",
    },
}

# --------------------------------------------------------------------------------------------------
# Python-level names
# --------------------------------------------------------------------------------------------------

# Python-level __name__ -> ATen name in the lists (family-independent; look the ATen name up in the
# family's lists: e.g. cross_entropy_loss is CPU fp32 but in no CUDA list, see COMPOSITES["cuda"]).
ALIASES: dict[str, str] = {
    "__matmul__": "matmul",  # Tensor.__matmul__ (the `@` operator)
    "__rmatmul__": "matmul",
    "__pow__": "pow",  # (Tensor.__pow__'s __name__ is already "pow")
    "__rpow__": "pow",
    "__rdiv__": "reciprocal",  # Tensor.__rdiv__ / __rtruediv__ (both named "__rdiv__"): reciprocal() * other
    "__rtruediv__": "reciprocal",
    "multi_dot": "linalg_multi_dot",  # the name used by the PyTorch docs
    "cross_entropy": "cross_entropy_loss",  # F.cross_entropy
    "nll_loss_nd": "nll_loss",  # torch._C._nn.nll_loss_nd (F.nll_loss's backend; 4-D input -> nll_loss2d)
    "grid_sample": "grid_sampler",  # F.grid_sample
    "lu": "_lu_with_info",  # torch.lu (deprecated)
    # F.fractional_max_pool2d/3d(return_indices=True), F.adaptive_max_pool3d(return_indices=True):
    "fractional_max_pool2d_with_indices": "fractional_max_pool2d",
    "fractional_max_pool3d_with_indices": "fractional_max_pool3d",
    "adaptive_max_pool3d_with_indices": "adaptive_max_pool3d",
    "softmin": "softmax",  # F.softmin is softmax(-x)
    "normalize": "norm",  # F.normalize divides by x.norm(p, dim)
}

# Python-level names in no list whose ATen decomposition reaches listed ops (observed for CPU with
# torch 2.13; the CUDA entries follow from the CUDA lists and the same decompositions, they could not be
# observed without a CUDA device).
COMPOSITES: dict[str, dict[str, str]] = {
    "cpu": {
        "einsum": LOWER,  # -> bmm (contracting equations only, see CONDITIONAL)
        "tensordot": LOWER,  # -> mm
        "inner": LOWER,  # -> tensordot -> mm (not for two 1-D inputs: dot)
        "chain_matmul": LOWER,  # -> linalg_multi_dot -> mm
        "linalg_multi_dot": LOWER,  # -> mm
        "matrix_power": LOWER,  # -> matmul (|n| >= 2)
        "linalg_matrix_power": LOWER,
        "linalg_pinv": LOWER,  # svd (fp32) then matmul (lower): the result is low precision
        "cov": LOWER,  # -> mm
        "corrcoef": LOWER,  # -> cov
        "affine_grid": LOWER,  # -> bmm
        "multi_head_attention_forward": LOWER,  # -> linear / bmm / baddbmm
        "lstm": LOWER,  # torch._VF.lstm -> mkldnn_rnn_layer (fp16: oneDNN may have no kernel, torch raises)
        "rnn_tanh": LOWER,  # torch._VF.rnn_tanh -> linear / matmul
        "rnn_relu": LOWER,
        "rnn_tanh_cell": LOWER,  # -> linear
        "rnn_relu_cell": LOWER,
    },
    "cuda": {
        "cross_entropy_loss": FP32,  # -> log_softmax (fp32_set_opt_dtype) + nll_loss (fp32)
        "cross_entropy": FP32,
        "interpolate": FP32,  # F.interpolate -> upsample_* (all modes but "area": adaptive_avg_pool)
        "upsample": FP32,  # F.upsample -> interpolate
        "upsample_nearest": FP32,
        "upsample_bilinear": FP32,
        "inner": PROMOTE,  # -> tensordot, or dot for two 1-D inputs: both promote
        "linalg_matrix_power": LOWER,  # -> matmul
        "matrix_power": LOWER,
        "cov": LOWER,  # -> mm
        "corrcoef": LOWER,
        "affine_grid": LOWER,  # -> bmm
        "multi_head_attention_forward": LOWER,  # -> linear / bmm / baddbmm (softmax in fp32)
        "lstm": LOWER,  # -> _cudnn_rnn (float16 even in a bfloat16 region, see CONDITIONAL)
        "gru": LOWER,
        "rnn_tanh": LOWER,
        "rnn_relu": LOWER,
    },
}

# Argument-dependent behaviour: family -> {Python-level name -> (category when the condition holds,
# condition)}.  Outside the condition the op keeps its input dtype (or follows its own list entry).
CONDITIONAL: dict[str, dict[str, tuple[str, str]]] = {
    "cpu": {
        "einsum": (
            LOWER,
            "only when the equation sums an index shared by two operands (it then runs bmm, e.g. "
            "'ij,jk->ik', 'i,i->'); pure elementwise / outer / single-operand equations ('ij,ij->ij', "
            "'i,j->ij', 'ij->i', 'ii->') keep the input dtype",
        ),
        "inner": (LOWER, "unless both inputs are 1-D (then it is dot, unlisted on CPU)"),
        "chain_matmul": (LOWER, "with two or more matrices (a single matrix is returned as is)"),
        "matrix_power": (
            LOWER,
            "|n| >= 2; n in (0, 1) keep the input dtype, n == -1 is inverse (fp32 list)",
        ),
        "linalg_matrix_power": (LOWER, "as matrix_power"),
        "lstm": (
            LOWER,
            "bf16: always.  fp16: with float32 inputs torch.autocast raises RuntimeError('could not create a "
            "primitive descriptor for the LSTM forward propagation primitive') on CPUs whose oneDNN lacks "
            "that fp16 kernel (observed on the development machine); float16 inputs work",
        ),
        "pad": (
            FP32,
            "F.pad with mode='reflect' and 1-d/2-d padding (reflection_pad1d/2d) or mode='replicate' "
            "(replication_pad1d/2d/3d); constant/circular modes and 3-d reflect padding keep the input dtype",
        ),
        "local_response_norm": (
            FP32,
            "inputs with >= 4 dims (it runs avg_pool3d); 3-D inputs keep the dtype",
        ),
        "max_pool3d": (FP32, "only without return_indices (that is max_pool3d_with_indices, unlisted)"),
    },
    "cuda": {
        "einsum": (LOWER, "listed itself on CUDA: always lower (also elementwise equations)"),
        "interpolate": (FP32, "all modes except 'area' (adaptive_avg_pool*, unlisted)"),
        "upsample": (FP32, "as interpolate"),
        "lstm": (
            LOWER,
            "when cuDNN runs the RNN (the usual CUDA case): _cudnn_rnn casts to float16 whatever the "
            "autocast dtype (bfloat16 regions included)",
        ),
        "gru": (LOWER, "as lstm"),
        "rnn_tanh": (LOWER, "as lstm"),
        "rnn_relu": (LOWER, "as lstm"),
    },
}


def ops_for(family: str) -> dict[str, frozenset[str]]:
    """The category -> ATen names table of a device family (``"cpu"`` or ``"cuda"``)."""
    if family == "cpu":
        return CPU_OPS
    if family == "cuda":
        return CUDA_OPS
    raise ValueError(f"unknown device family {family!r}; expected one of {FAMILIES}")


def category_of(family: str, name: str) -> str | None:
    """The category of a Python-level or ATen ``name`` for a device family, None when torch's autocast
    leaves it alone: ``ALIASES`` first, then the family's lists, then ``COMPOSITES`` (by the name or its
    alias target).  ``CONDITIONAL`` is not consulted: it needs the call's arguments."""
    target = ALIASES.get(name, name)
    table = ops_for(family)
    for category in CATEGORIES:
        if target in table[category]:
            return category
    composites = COMPOSITES[family]
    return composites.get(name, composites.get(target))


ALL_OP_NAMES: frozenset[str] = frozenset().union(
    *CPU_OPS.values(),
    *CUDA_OPS.values(),
    *BANNED_OPS.values(),
    ALIASES,
    *COMPOSITES.values(),
    *CONDITIONAL.values(),
)
