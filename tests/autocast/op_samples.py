"""Small, deterministic CPU call samples for autocast tests.

``cpu_op_samples()`` returns ``(name, fn)`` pairs.  ``fn`` takes no arguments, builds fresh small inputs
from a generator seeded by ``name`` and calls one *Python-level* torch function (the thing a
``TorchFunctionMode`` sees), returning its output.  Every call of ``fn`` gives identical inputs.

Naming: ``"<key>"`` or ``"<key>:<variant>"``.  ``<key>`` (see ``sample_key``) is the name the catalogue in
``mixprec.policy.ops`` is consulted with: an ATen op name from ``CPU_OPS`` (the sample then reaches
that ATen op, possibly through a Python wrapper such as ``F.cross_entropy``), a key of ``ALIASES``,
a key of ``COMPOSITES["cpu"]``, or the name of an op autocast does not touch (an "unlisted" op).

Inputs:

* ``cpu_op_samples()`` (default ``dtype=torch.float32``) builds every floating input in float32, except
  in the ``:mixed...`` / ``:lowp...`` samples, which deliberately combine bfloat16 and float32 tensors.
* ``cpu_op_samples(dtype=torch.bfloat16)`` (or float16) builds the floating inputs in that dtype instead,
  which makes the ``fp32`` category observable (a low-precision input comes out float32).  Many of
  those samples cannot run *outside* autocast (CPU linear algebra / FFT have no bf16 / fp16 kernels);
  only the float32 set is guaranteed to run everywhere.
* ``cpu_op_samples(include_autocast_only=True)`` adds mixed-dtype ``index_copy`` calls that are only legal
  under autocast (the promote policy makes their dtypes agree).

All input construction (including derived inputs such as factorizations) happens with torch-function
handling and torch autocast disabled, so neither ``torch.autocast`` nor a ``TorchFunctionMode`` sees
anything but the op under test (plus trivial glue such as indexing).
"""

from __future__ import annotations

import contextlib
import warnings
import zlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

__all__ = ["cpu_op_samples", "sample_key"]

Sample = tuple[str, Callable[[], object]]

LOWP = torch.bfloat16  # the explicit low-precision dtype of the ``:mixed`` samples


def sample_key(name: str) -> str:
    """The catalogue key of a sample name (the part before ``:``)."""
    return name.split(":", 1)[0]


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Build inputs invisibly: no torch-function modes, no torch autocast."""
    with torch._C.DisableTorchFunction(), torch.autocast("cpu", enabled=False):
        yield


class _In:
    """Deterministic input factory for one sample."""

    def __init__(self, seed: int, dtype: torch.dtype) -> None:
        self.g = torch.Generator().manual_seed(seed)
        self.dtype = dtype

    def _fin(self, t: torch.Tensor, dtype: torch.dtype | None, grad: bool) -> torch.Tensor:
        t = t.to(self.dtype if dtype is None else dtype)
        if grad:
            t.requires_grad_(True)
        return t

    def randn(self, *shape: int, dtype: torch.dtype | None = None, grad: bool = False) -> torch.Tensor:
        with _quiet():
            return self._fin(torch.randn(shape, generator=self.g), dtype, grad)

    def rand(
        self, *shape: int, lo: float = 0.0, hi: float = 1.0, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        with _quiet():
            return self._fin(torch.rand(shape, generator=self.g) * (hi - lo) + lo, dtype, False)

    def sign(self, *shape: int) -> torch.Tensor:
        """A float tensor of +-1 (targets of embedding / margin losses)."""
        with _quiet():
            t = torch.randint(0, 2, shape, generator=self.g).float() * 2 - 1
            return self._fin(t, None, False)

    def randint(self, high: int, *shape: int) -> torch.Tensor:
        with _quiet():
            return torch.randint(0, high, shape, generator=self.g)

    def const(self, values: object) -> torch.Tensor:
        with _quiet():
            return self._fin(torch.tensor(values, dtype=torch.float32), None, False)

    def wellcond(self, n: int, *batch: int) -> torch.Tensor:
        """A well-conditioned (diagonally dominant) square matrix."""
        with _quiet():
            a = torch.randn((*batch, n, n), generator=self.g) * 0.3 + 2.0 * torch.eye(n)
            return self._fin(a, None, False)

    def spd(self, n: int, *batch: int) -> torch.Tensor:
        """A symmetric positive-definite matrix."""
        with _quiet():
            a = torch.randn((*batch, n, n), generator=self.g)
            return self._fin(a @ a.mT + n * torch.eye(n), None, False)

    def chol(self, n: int) -> torch.Tensor:
        """A lower Cholesky factor (positive diagonal)."""
        with _quiet():
            a = torch.randn((n, n), generator=self.g)
            return self._fin(torch.linalg.cholesky(a @ a.mT + n * torch.eye(n)), None, False)

    def upper(self, n: int) -> torch.Tensor:
        with _quiet():
            a = torch.randn((n, n), generator=self.g).triu() * 0.3 + 2.0 * torch.eye(n)
            return self._fin(a, None, False)

    def lu(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        with _quiet():
            a = torch.randn((n, n), generator=self.g) * 0.3 + 2.0 * torch.eye(n)
            lu, piv = torch.linalg.lu_factor(a)
            return self._fin(lu, None, False), piv

    def geqrf(self, m: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        with _quiet():
            a, tau = torch.geqrf(torch.randn((m, n), generator=self.g))
            return self._fin(a, None, False), self._fin(tau, None, False)

    def log_probs(self, *shape: int, dim: int = -1) -> torch.Tensor:
        with _quiet():
            return self._fin(torch.randn(shape, generator=self.g).log_softmax(dim), None, False)

    def probs(self, *shape: int, dim: int = -1) -> torch.Tensor:
        with _quiet():
            return self._fin(torch.randn(shape, generator=self.g).softmax(dim), None, False)

    def pool_indices(self, x_shape: tuple[int, ...], k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(pooled values, indices) of a max-pool, for max_unpool."""
        with _quiet():
            x = torch.randn(x_shape, generator=self.g)
            pool = F.max_pool2d if len(x_shape) == 4 else F.max_pool3d
            out, idx = pool(x, k, return_indices=True)
            return self._fin(out, None, False), idx


def _silent(fn: Callable[[], object]) -> object:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn()


def _lstm_params(i: _In, inp: int, hid: int, gates: int, grad: bool = False) -> list[torch.Tensor]:
    return [
        i.randn(gates * hid, inp, grad=grad),
        i.randn(gates * hid, hid, grad=grad),
        i.randn(gates * hid, grad=grad),
        i.randn(gates * hid, grad=grad),
    ]


def _mha_args(i: _In, e: int = 4, heads: int = 2) -> dict[str, object]:
    return {
        "embed_dim_to_check": e,
        "num_heads": heads,
        "in_proj_weight": i.randn(3 * e, e),
        "in_proj_bias": i.randn(3 * e),
        "bias_k": None,
        "bias_v": None,
        "add_zero_attn": False,
        "dropout_p": 0.0,
        "out_proj_weight": i.randn(e, e),
        "out_proj_bias": i.randn(e),
        "training": False,
    }


def _dropout(x: torch.Tensor) -> torch.Tensor:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return F.dropout(x, p=0.5, training=True)


# Each builder takes an input factory and returns the op's output.
_Builder = Callable[[_In], object]

_LOWER: list[tuple[str, _Builder]] = [
    ("conv1d", lambda i: F.conv1d(i.randn(1, 2, 8), i.randn(3, 2, 3), i.randn(3))),
    ("conv1d:padding_same", lambda i: F.conv1d(i.randn(1, 2, 8), i.randn(3, 2, 3), padding="same")),
    ("conv2d", lambda i: F.conv2d(i.randn(1, 2, 5, 5), i.randn(3, 2, 3, 3), i.randn(3), padding=1)),
    ("conv2d:padding_same", lambda i: F.conv2d(i.randn(1, 2, 5, 5), i.randn(3, 2, 3, 3), padding="same")),
    (
        "conv2d:grad",
        lambda i: F.conv2d(i.randn(1, 2, 5, 5), i.randn(3, 2, 3, 3, grad=True), i.randn(3, grad=True)),
    ),
    ("conv3d", lambda i: F.conv3d(i.randn(1, 2, 4, 4, 4), i.randn(3, 2, 2, 2, 2), i.randn(3))),
    (
        "conv3d:padding_same",
        lambda i: F.conv3d(i.randn(1, 2, 4, 4, 4), i.randn(3, 2, 3, 3, 3), padding="same"),
    ),
    ("bmm", lambda i: torch.bmm(i.randn(2, 3, 4), i.randn(2, 4, 5))),
    ("bmm:method", lambda i: i.randn(2, 3, 4).bmm(i.randn(2, 4, 5))),
    ("mm", lambda i: torch.mm(i.randn(3, 4), i.randn(4, 5))),
    ("mm:method", lambda i: i.randn(3, 4).mm(i.randn(4, 5))),
    ("linalg_vecdot", lambda i: torch.linalg.vecdot(i.randn(3, 4), i.randn(3, 4))),
    ("baddbmm", lambda i: torch.baddbmm(i.randn(2, 3, 5), i.randn(2, 3, 4), i.randn(2, 4, 5))),
    ("addmm", lambda i: torch.addmm(i.randn(5), i.randn(3, 4), i.randn(4, 5))),
    ("addmm:method", lambda i: i.randn(3, 5).addmm(i.randn(3, 4), i.randn(4, 5), beta=0.5)),
    (
        "_addmm_activation",
        lambda i: torch._addmm_activation(i.randn(5), i.randn(3, 4), i.randn(4, 5), use_gelu=True),
    ),
    ("addbmm", lambda i: torch.addbmm(i.randn(3, 5), i.randn(2, 3, 4), i.randn(2, 4, 5))),
    ("linear", lambda i: F.linear(i.randn(3, 4), i.randn(5, 4), i.randn(5))),
    ("linear:nobias", lambda i: F.linear(i.randn(2, 3, 4), i.randn(5, 4))),
    ("linear:grad", lambda i: F.linear(i.randn(3, 4), i.randn(5, 4, grad=True), i.randn(5, grad=True))),
    ("linear:input_grad", lambda i: F.linear(i.randn(3, 4, grad=True), i.randn(5, 4))),
    # The 12-argument (deprecated) overload: the only _convolution overload with a CPU autocast kernel.
    (
        "_convolution",
        lambda i: torch._convolution(
            i.randn(1, 2, 5, 5),
            i.randn(3, 2, 3, 3),
            None,
            [1, 1],
            [0, 0],
            [1, 1],
            False,
            [0, 0],
            1,
            False,
            False,
            True,
        ),
    ),
    ("matmul", lambda i: torch.matmul(i.randn(3, 4), i.randn(4, 5))),
    ("matmul:batched", lambda i: torch.matmul(i.randn(2, 3, 4), i.randn(4, 5))),
    ("matmul:vec", lambda i: torch.matmul(i.randn(4), i.randn(4, 5))),
    ("matmul:method", lambda i: i.randn(3, 4).matmul(i.randn(4, 5))),
    ("matmul:grad", lambda i: torch.matmul(i.randn(3, 4, grad=True), i.randn(4, 5, grad=True))),
    ("__matmul__", lambda i: i.randn(3, 4) @ i.randn(4, 5)),
    ("__rmatmul__", lambda i: i.randn(4, 5).__rmatmul__(i.randn(3, 4))),
    ("conv_tbc", lambda i: torch.conv_tbc(i.randn(5, 2, 3), i.randn(3, 3, 4), i.randn(4), 1)),
    # mkldnn_rnn_layer has no Python binding; the CPU LSTM (torch._VF.lstm, used by nn.LSTM) reaches it.
    (
        "mkldnn_rnn_layer",
        lambda i: torch._VF.lstm(
            i.randn(5, 2, 3),
            (i.randn(1, 2, 4), i.randn(1, 2, 4)),
            _lstm_params(i, 3, 4, 4),
            True,
            1,
            0.0,
            False,
            False,
            False,
        ),
    ),
    (
        "mkldnn_rnn_layer:grad",
        lambda i: torch._VF.lstm(
            i.randn(5, 2, 3),
            (i.randn(1, 2, 4), i.randn(1, 2, 4)),
            _lstm_params(i, 3, 4, 4, grad=True),
            True,
            1,
            0.0,
            True,
            False,
            False,
        ),
    ),
    ("conv_transpose1d", lambda i: F.conv_transpose1d(i.randn(1, 2, 6), i.randn(2, 3, 3), i.randn(3))),
    (
        "conv_transpose2d",
        lambda i: F.conv_transpose2d(i.randn(1, 2, 4, 4), i.randn(2, 3, 3, 3), i.randn(3), stride=2),
    ),
    ("conv_transpose3d", lambda i: F.conv_transpose3d(i.randn(1, 2, 3, 3, 3), i.randn(2, 3, 2, 2, 2))),
    ("prelu", lambda i: F.prelu(i.randn(2, 3, 4), i.rand(1))),
    ("prelu:channels", lambda i: F.prelu(i.randn(2, 3, 4), i.rand(3))),
    (
        "scaled_dot_product_attention",
        lambda i: F.scaled_dot_product_attention(
            i.randn(1, 2, 3, 4), i.randn(1, 2, 3, 4), i.randn(1, 2, 3, 4)
        ),
    ),
    (
        "scaled_dot_product_attention:causal",
        lambda i: F.scaled_dot_product_attention(
            i.randn(1, 2, 3, 4), i.randn(1, 2, 3, 4), i.randn(1, 2, 3, 4), is_causal=True
        ),
    ),
    (
        "scaled_dot_product_attention:float_mask",
        lambda i: F.scaled_dot_product_attention(
            i.randn(1, 2, 3, 4), i.randn(1, 2, 3, 4), i.randn(1, 2, 3, 4), attn_mask=i.randn(3, 3)
        ),
    ),
    (
        "_native_multi_head_attention",
        lambda i: torch._native_multi_head_attention(
            i.randn(2, 3, 4),
            i.randn(2, 3, 4),
            i.randn(2, 3, 4),
            4,
            2,
            i.randn(12, 4),
            i.randn(12),
            i.randn(4, 4),
            i.randn(4),
        ),
    ),
]

_FP32: list[tuple[str, _Builder]] = [
    ("avg_pool3d", lambda i: F.avg_pool3d(i.randn(1, 2, 4, 4, 4), 2)),
    ("binary_cross_entropy", lambda i: F.binary_cross_entropy(i.rand(6, lo=0.05, hi=0.95), i.rand(6))),
    (
        "binary_cross_entropy:grad",
        lambda i: F.binary_cross_entropy(torch.sigmoid(i.randn(6, grad=True)), i.rand(6)),
    ),
    (
        "grid_sampler",
        lambda i: torch.grid_sampler(i.randn(1, 2, 4, 4), i.rand(1, 3, 3, 2, lo=-1), 0, 0, False),
    ),
    (
        "grid_sample",
        lambda i: F.grid_sample(i.randn(1, 2, 4, 4), i.rand(1, 3, 3, 2, lo=-1), align_corners=False),
    ),
    (
        "grid_sample:3d",
        lambda i: F.grid_sample(i.randn(1, 2, 3, 3, 3), i.rand(1, 2, 2, 2, 3, lo=-1), align_corners=True),
    ),
    (
        "grid_sampler_2d",
        lambda i: torch.grid_sampler_2d(i.randn(1, 2, 4, 4), i.rand(1, 3, 3, 2, lo=-1), 0, 0, False),
    ),
    (
        "_grid_sampler_2d_cpu_fallback",
        lambda i: torch._grid_sampler_2d_cpu_fallback(
            i.randn(1, 2, 4, 4), i.rand(1, 3, 3, 2, lo=-1), 0, 0, False
        ),
    ),
    (
        "grid_sampler_3d",
        lambda i: torch.grid_sampler_3d(i.randn(1, 2, 3, 3, 3), i.rand(1, 2, 2, 2, 3, lo=-1), 0, 0, False),
    ),
    ("polar", lambda i: torch.polar(i.rand(4, lo=0.1), i.randn(4))),
    ("prod", lambda i: torch.prod(i.rand(4, lo=0.5, hi=1.5))),
    ("prod:dim", lambda i: torch.prod(i.rand(3, 4, lo=0.5, hi=1.5), 1)),
    ("prod:method", lambda i: i.rand(3, 4, lo=0.5, hi=1.5).prod(dim=0, keepdim=True)),
    ("quantile", lambda i: torch.quantile(i.randn(10), 0.3)),
    ("quantile:tensor_q", lambda i: torch.quantile(i.randn(3, 10), i.const([0.25, 0.75]), dim=1)),
    ("nanquantile", lambda i: torch.nanquantile(i.randn(10), 0.6)),
    ("nanquantile:tensor_q", lambda i: torch.nanquantile(i.randn(3, 10), i.const([0.1, 0.9]), dim=1)),
    (
        "stft",
        lambda i: torch.stft(i.randn(64), 16, window=i.rand(16, lo=0.5), center=False, return_complex=True),
    ),
    ("stft:center", lambda i: torch.stft(i.randn(2, 64), 16, hop_length=4, return_complex=True)),
    ("cdist", lambda i: torch.cdist(i.randn(3, 4), i.randn(5, 4))),
    ("cdist:batched_p1", lambda i: torch.cdist(i.randn(2, 3, 4), i.randn(2, 5, 4), p=1.0)),
    ("trace", lambda i: torch.trace(i.randn(4, 4))),
    ("view_as_complex", lambda i: torch.view_as_complex(i.randn(3, 2))),
    ("cholesky", lambda i: _silent(lambda: torch.cholesky(i.spd(3)))),
    ("cholesky_inverse", lambda i: torch.cholesky_inverse(i.chol(3))),
    ("cholesky_solve", lambda i: torch.cholesky_solve(i.randn(3, 2), i.chol(3))),
    ("inverse", lambda i: torch.inverse(i.wellcond(3))),
    # the legacy torch.lu_solve; torch.linalg.lu_solve is a different (unlisted) op, linalg_lu_solve
    ("lu_solve", lambda i: _silent(lambda: torch.lu_solve(i.randn(3, 2), *i.lu(3)))),
    ("orgqr", lambda i: torch.orgqr(*i.geqrf(4, 3))),
    ("ormqr", lambda i: torch.ormqr(*i.geqrf(4, 3), i.randn(4, 2))),
    ("pinverse", lambda i: torch.pinverse(i.randn(4, 3))),
    ("max_pool3d", lambda i: F.max_pool3d(i.randn(1, 2, 4, 4, 4), 2)),
    ("max_unpool2d", lambda i: F.max_unpool2d(*i.pool_indices((1, 2, 4, 4), 2), 2)),
    ("max_unpool3d", lambda i: F.max_unpool3d(*i.pool_indices((1, 2, 4, 4, 4), 2), 2)),
    ("adaptive_avg_pool3d", lambda i: F.adaptive_avg_pool3d(i.randn(1, 2, 4, 4, 4), 2)),
    ("reflection_pad1d", lambda i: torch._C._nn.reflection_pad1d(i.randn(1, 2, 5), [1, 2])),
    ("reflection_pad2d", lambda i: torch._C._nn.reflection_pad2d(i.randn(1, 2, 5, 5), [1, 1, 2, 2])),
    ("replication_pad1d", lambda i: torch._C._nn.replication_pad1d(i.randn(1, 2, 5), [1, 2])),
    ("replication_pad2d", lambda i: torch._C._nn.replication_pad2d(i.randn(1, 2, 5, 5), [1, 1, 2, 2])),
    (
        "replication_pad3d",
        lambda i: torch._C._nn.replication_pad3d(i.randn(1, 2, 3, 3, 3), [1, 1, 1, 1, 1, 1]),
    ),
    ("mse_loss", lambda i: F.mse_loss(i.randn(3, 4), i.randn(3, 4))),
    ("mse_loss:grad", lambda i: F.mse_loss(i.randn(3, 4, grad=True), i.randn(3, 4), reduction="sum")),
    ("cosine_embedding_loss", lambda i: F.cosine_embedding_loss(i.randn(3, 4), i.randn(3, 4), i.sign(3))),
    ("nll_loss", lambda i: F.nll_loss(i.log_probs(3, 5), i.randint(5, 3))),
    ("nll_loss:weight", lambda i: F.nll_loss(i.log_probs(3, 5), i.randint(5, 3), weight=i.rand(5, lo=0.5))),
    ("nll_loss2d", lambda i: torch._C._nn.nll_loss2d(i.log_probs(2, 3, 4, 4, dim=1), i.randint(3, 2, 4, 4))),
    ("nll_loss2d:F.nll_loss", lambda i: F.nll_loss(i.log_probs(2, 3, 4, 4, dim=1), i.randint(3, 2, 4, 4))),
    ("hinge_embedding_loss", lambda i: F.hinge_embedding_loss(i.randn(3, 4), i.sign(3, 4))),
    ("poisson_nll_loss", lambda i: F.poisson_nll_loss(i.randn(3, 4), i.rand(3, 4, hi=3.0))),
    ("smooth_l1_loss", lambda i: F.smooth_l1_loss(i.randn(3, 4), i.randn(3, 4))),
    ("cross_entropy_loss", lambda i: F.cross_entropy(i.randn(3, 5), i.randint(5, 3))),
    ("cross_entropy_loss:probs", lambda i: F.cross_entropy(i.randn(3, 5), i.probs(3, 5))),
    (
        "cross_entropy_loss:smoothing_grad",
        lambda i: F.cross_entropy(i.randn(3, 5, grad=True), i.randint(5, 3), label_smoothing=0.1),
    ),
    ("cross_entropy_loss:2d", lambda i: F.cross_entropy(i.randn(2, 3, 4, 4), i.randint(3, 2, 4, 4))),
    ("l1_loss", lambda i: F.l1_loss(i.randn(3, 4), i.randn(3, 4))),
    ("huber_loss", lambda i: F.huber_loss(i.randn(3, 4), i.randn(3, 4), delta=0.5)),
    ("margin_ranking_loss", lambda i: F.margin_ranking_loss(i.randn(4), i.randn(4), i.sign(4))),
    ("soft_margin_loss", lambda i: F.soft_margin_loss(i.randn(3, 4), i.sign(3, 4))),
    ("triplet_margin_loss", lambda i: F.triplet_margin_loss(i.randn(3, 4), i.randn(3, 4), i.randn(3, 4))),
    ("multi_margin_loss", lambda i: F.multi_margin_loss(i.randn(3, 5), i.randint(5, 3))),
    (
        "ctc_loss",
        lambda i: F.ctc_loss(i.log_probs(6, 2, 4), i.randint(3, 2, 3) + 1, (6, 5), (3, 2)),
    ),
    (
        "ctc_loss:tensor_lengths",
        lambda i: F.ctc_loss(
            i.log_probs(6, 2, 4), i.randint(3, 2, 3) + 1, torch.tensor([6, 5]), torch.tensor([3, 2])
        ),
    ),
    ("kl_div", lambda i: F.kl_div(i.log_probs(3, 4), i.probs(3, 4), reduction="batchmean")),
    (
        "multilabel_margin_loss",
        lambda i: F.multilabel_margin_loss(i.randn(2, 4), torch.tensor([[3, 0, -1, 1], [1, 2, 3, -1]])),
    ),
    # multilabel_margin_loss_forward has no public binding; F.multilabel_margin_loss reaches it.
    (
        "multilabel_margin_loss_forward",
        lambda i: F.multilabel_margin_loss(
            i.randn(3, 4), torch.tensor([[0, -1, 2, 1], [3, 2, 1, 0], [1, -1, 0, 0]])
        ),
    ),
    (
        "binary_cross_entropy_with_logits",
        lambda i: F.binary_cross_entropy_with_logits(i.randn(3, 4), i.rand(3, 4)),
    ),
    (
        "binary_cross_entropy_with_logits:pos_weight",
        lambda i: F.binary_cross_entropy_with_logits(
            i.randn(3, 4), i.rand(3, 4), pos_weight=i.rand(4, lo=0.5)
        ),
    ),
    ("fft_fft", lambda i: torch.fft.fft(i.randn(8))),
    ("fft_ifft", lambda i: torch.fft.ifft(i.randn(8))),
    ("fft_fft2", lambda i: torch.fft.fft2(i.randn(4, 4))),
    ("fft_ifft2", lambda i: torch.fft.ifft2(i.randn(4, 4))),
    ("fft_fftn", lambda i: torch.fft.fftn(i.randn(2, 4, 4))),
    ("fft_ifftn", lambda i: torch.fft.ifftn(i.randn(2, 4, 4))),
    ("fft_rfft", lambda i: torch.fft.rfft(i.randn(8))),
    ("fft_irfft", lambda i: torch.fft.irfft(i.randn(5))),
    ("fft_rfft2", lambda i: torch.fft.rfft2(i.randn(4, 4))),
    ("fft_irfft2", lambda i: torch.fft.irfft2(i.randn(4, 3))),
    ("fft_rfftn", lambda i: torch.fft.rfftn(i.randn(2, 4, 4))),
    ("fft_irfftn", lambda i: torch.fft.irfftn(i.randn(2, 4, 3))),
    ("fft_hfft", lambda i: torch.fft.hfft(i.randn(5))),
    ("fft_ihfft", lambda i: torch.fft.ihfft(i.randn(8))),
    ("linalg_cond", lambda i: torch.linalg.cond(i.wellcond(3))),
    ("linalg_cond:p_str", lambda i: torch.linalg.cond(i.wellcond(3), "fro")),
    ("linalg_matrix_rank", lambda i: torch.linalg.matrix_rank(i.randn(4, 3))),
    ("linalg_matrix_rank:atol_rtol", lambda i: torch.linalg.matrix_rank(i.randn(4, 3), atol=1e-3, rtol=0.0)),
    ("linalg_solve", lambda i: torch.linalg.solve(i.wellcond(3), i.randn(3, 2))),
    ("linalg_cholesky", lambda i: torch.linalg.cholesky(i.spd(3))),
    ("linalg_svdvals", lambda i: torch.linalg.svdvals(i.randn(4, 3))),
    ("linalg_eigvals", lambda i: torch.linalg.eigvals(i.wellcond(3))),
    ("linalg_eigvalsh", lambda i: torch.linalg.eigvalsh(i.spd(3))),
    ("linalg_inv", lambda i: torch.linalg.inv(i.wellcond(3))),
    ("linalg_householder_product", lambda i: torch.linalg.householder_product(*i.geqrf(4, 3))),
    ("linalg_tensorinv", lambda i: torch.linalg.tensorinv(i.wellcond(4).reshape(4, 2, 2), ind=1)),
    (
        "linalg_tensorsolve",
        lambda i: torch.linalg.tensorsolve(i.wellcond(4).reshape(2, 2, 2, 2), i.randn(2, 2)),
    ),
    (
        "fake_quantize_per_tensor_affine",
        lambda i: torch.fake_quantize_per_tensor_affine(i.randn(6), 0.1, 0, -128, 127),
    ),
    ("geqrf", lambda i: torch.geqrf(i.randn(4, 3))),
    ("_lu_with_info", lambda i: torch._lu_with_info(i.wellcond(3))),
    ("lu", lambda i: _silent(lambda: torch.lu(i.wellcond(3)))),
    ("qr", lambda i: torch.qr(i.randn(4, 3))),
    ("svd", lambda i: torch.svd(i.randn(4, 3))),
    ("triangular_solve", lambda i: torch.triangular_solve(i.randn(3, 2), i.upper(3))),
    (
        "fractional_max_pool2d",
        lambda i: F.fractional_max_pool2d(
            i.randn(1, 2, 5, 5), 2, output_size=3, _random_samples=i.rand(1, 2, 2)
        ),
    ),
    (
        "fractional_max_pool2d_with_indices",
        lambda i: F.fractional_max_pool2d(
            i.randn(1, 2, 5, 5), 2, output_size=3, return_indices=True, _random_samples=i.rand(1, 2, 2)
        ),
    ),
    (
        "fractional_max_pool3d",
        lambda i: F.fractional_max_pool3d(
            i.randn(1, 2, 5, 5, 5), 2, output_size=3, _random_samples=i.rand(1, 2, 3)
        ),
    ),
    (
        "fractional_max_pool3d_with_indices",
        lambda i: F.fractional_max_pool3d(
            i.randn(1, 2, 5, 5, 5), 2, output_size=3, return_indices=True, _random_samples=i.rand(1, 2, 3)
        ),
    ),
    ("adaptive_max_pool3d", lambda i: F.adaptive_max_pool3d(i.randn(1, 2, 4, 4, 4), 2)),
    ("adaptive_max_pool3d_with_indices", lambda i: F.adaptive_max_pool3d(i.randn(1, 2, 4, 4, 4), 2, True)),
    ("linalg_qr", lambda i: torch.linalg.qr(i.randn(4, 3))),
    ("linalg_cholesky_ex", lambda i: torch.linalg.cholesky_ex(i.spd(3))),
    ("linalg_svd", lambda i: torch.linalg.svd(i.randn(4, 3), full_matrices=False)),
    ("linalg_eig", lambda i: torch.linalg.eig(i.wellcond(3))),
    ("linalg_eigh", lambda i: torch.linalg.eigh(i.spd(3))),
    ("linalg_lstsq", lambda i: torch.linalg.lstsq(i.randn(4, 3), i.randn(4, 2))),
    ("linalg_inv_ex", lambda i: torch.linalg.inv_ex(i.wellcond(3))),
]

_PROMOTE: list[tuple[str, _Builder]] = [
    ("cat", lambda i: torch.cat([i.randn(2, 3), i.randn(1, 3)])),
    ("cat:dim", lambda i: torch.cat((i.randn(2, 3), i.randn(2, 1)), dim=1)),
    ("cat:mixed_fp32_first", lambda i: torch.cat([i.randn(2, dtype=torch.float32), i.randn(3, dtype=LOWP)])),
    ("cat:mixed_lowp_first", lambda i: torch.cat([i.randn(2, dtype=LOWP), i.randn(3, dtype=torch.float32)])),
    ("cat:lowp_only", lambda i: torch.cat([i.randn(2, dtype=LOWP), i.randn(3, dtype=LOWP)])),
    ("cat:grad", lambda i: torch.cat([i.randn(2, grad=True), i.randn(3)])),
    ("stack", lambda i: torch.stack([i.randn(2, 3), i.randn(2, 3)])),
    (
        "stack:mixed_fp32_first",
        lambda i: torch.stack([i.randn(3, dtype=torch.float32), i.randn(3, dtype=LOWP)]),
    ),
    (
        "stack:mixed_lowp_first",
        lambda i: torch.stack([i.randn(3, dtype=LOWP), i.randn(3, dtype=torch.float32)]),
    ),
    ("index_copy", lambda i: torch.index_copy(i.randn(4, 3), 0, torch.tensor([0, 2]), i.randn(2, 3))),
    ("index_copy:method", lambda i: i.randn(4, 3).index_copy(1, torch.tensor([2]), i.randn(4, 1))),
]

# Calls that are only legal under autocast: outside it index_copy rejects mixed dtypes, under autocast the
# promote policy makes them agree.  Returned only with ``cpu_op_samples(include_autocast_only=True)``.
_AUTOCAST_ONLY: list[tuple[str, _Builder]] = [
    (
        "index_copy:mixed_fp32_first",
        lambda i: torch.index_copy(
            i.randn(4, 3, dtype=torch.float32), 0, torch.tensor([1]), i.randn(1, 3, dtype=LOWP)
        ),
    ),
    (
        "index_copy:mixed_lowp_first",
        lambda i: torch.index_copy(
            i.randn(4, 3, dtype=LOWP), 0, torch.tensor([1]), i.randn(1, 3, dtype=torch.float32)
        ),
    ),
]

# Composites: names autocast has no kernel for, but whose ATen decomposition reaches listed ops.
_COMPOSITE: list[tuple[str, _Builder]] = [
    ("einsum", lambda i: torch.einsum("ij,jk->ik", i.randn(3, 4), i.randn(4, 5))),
    ("einsum:batched", lambda i: torch.einsum("bij,bjk->bik", i.randn(2, 3, 4), i.randn(2, 4, 5))),
    ("einsum:elementwise", lambda i: torch.einsum("ij,ij->ij", i.randn(3, 4), i.randn(3, 4))),
    ("einsum:reduce", lambda i: torch.einsum("ij->i", i.randn(3, 4))),
    ("tensordot", lambda i: torch.tensordot(i.randn(3, 4), i.randn(4, 5), dims=1)),
    ("tensordot:dims2", lambda i: torch.tensordot(i.randn(2, 3, 4), i.randn(3, 4, 5), dims=2)),
    ("inner", lambda i: torch.inner(i.randn(3, 4), i.randn(5, 4))),
    (
        "chain_matmul",
        lambda i: _silent(lambda: torch.chain_matmul(i.randn(3, 4), i.randn(4, 5), i.randn(5, 2))),
    ),
    ("linalg_multi_dot", lambda i: torch.linalg.multi_dot([i.randn(3, 4), i.randn(4, 5), i.randn(5, 2)])),
    ("linalg_matrix_power", lambda i: torch.linalg.matrix_power(i.randn(3, 3), 3)),
    ("matrix_power", lambda i: i.randn(3, 3).matrix_power(2)),
    ("linalg_pinv", lambda i: torch.linalg.pinv(i.randn(4, 3))),
    ("cov", lambda i: torch.cov(i.randn(3, 6))),
    ("corrcoef", lambda i: torch.corrcoef(i.randn(3, 6))),
    ("affine_grid", lambda i: F.affine_grid(i.randn(2, 2, 3), [2, 1, 4, 4], align_corners=False)),
    (
        "multi_head_attention_forward",
        lambda i: F.multi_head_attention_forward(
            i.randn(3, 2, 4), i.randn(3, 2, 4), i.randn(3, 2, 4), **_mha_args(i)
        ),
    ),
    (
        "lstm",  # 2-layer bidirectional batch-first LSTM (CPU: mkldnn_rnn_layer)
        lambda i: torch._VF.lstm(
            i.randn(2, 5, 3),
            (i.randn(4, 2, 4), i.randn(4, 2, 4)),
            [
                *_lstm_params(i, 3, 4, 4),
                *_lstm_params(i, 3, 4, 4),
                *_lstm_params(i, 8, 4, 4),
                *_lstm_params(i, 8, 4, 4),
            ],
            True,
            2,
            0.0,
            False,
            True,
            True,
        ),
    ),
    (
        "rnn_tanh",
        lambda i: torch._VF.rnn_tanh(
            i.randn(5, 2, 3), i.randn(1, 2, 4), _lstm_params(i, 3, 4, 1), True, 1, 0.0, False, False, False
        ),
    ),
    (
        "rnn_relu",
        lambda i: torch._VF.rnn_relu(
            i.randn(5, 2, 3), i.randn(1, 2, 4), _lstm_params(i, 3, 4, 1), True, 1, 0.0, False, False, False
        ),
    ),
    (
        "rnn_tanh_cell",
        lambda i: torch._VF.rnn_tanh_cell(i.randn(2, 3), i.randn(2, 4), *_lstm_params(i, 3, 4, 1)),
    ),
    (
        "rnn_relu_cell",
        lambda i: torch._VF.rnn_relu_cell(i.randn(2, 3), i.randn(2, 4), *_lstm_params(i, 3, 4, 1)),
    ),
    # Argument-dependent (mixprec.policy.ops.CONDITIONAL); only visible with low-precision inputs:
    ("local_response_norm:4d", lambda i: F.local_response_norm(i.randn(1, 4, 3, 3), 2)),
    ("pad:reflect2d", lambda i: F.pad(i.randn(1, 2, 4, 4), (1, 1, 1, 1), mode="reflect")),
    ("pad:replicate3d", lambda i: F.pad(i.randn(1, 2, 3, 3, 3), (1, 1, 1, 1, 1, 1), mode="replicate")),
]

# Ops torch.autocast leaves alone (output dtype follows the inputs).
_UNLISTED: list[tuple[str, _Builder]] = [
    ("add", lambda i: torch.add(i.randn(3, 4), i.randn(3, 4))),
    ("add:mixed", lambda i: torch.add(i.randn(3, 4, dtype=LOWP), i.randn(3, 4, dtype=torch.float32))),
    ("add:operator_grad", lambda i: i.randn(3, 4, grad=True) + i.randn(3, 4)),
    ("mul", lambda i: torch.mul(i.randn(3, 4), i.randn(3, 4))),
    ("mul:mixed", lambda i: i.randn(3, 4, dtype=torch.float32) * i.randn(3, 4, dtype=LOWP)),
    ("sub", lambda i: torch.sub(i.randn(3, 4), i.randn(3, 4), alpha=2)),
    ("div", lambda i: torch.div(i.randn(3, 4), i.rand(3, 4, lo=0.5))),
    ("exp", lambda i: torch.exp(i.randn(3, 4))),
    ("log", lambda i: torch.log(i.rand(3, 4, lo=0.1))),
    ("sin", lambda i: torch.sin(i.randn(3, 4))),
    ("tanh", lambda i: torch.tanh(i.randn(3, 4))),
    ("sigmoid", lambda i: torch.sigmoid(i.randn(3, 4))),
    ("pow", lambda i: torch.pow(i.rand(3, 4, lo=0.1), 2.5)),
    ("rsqrt", lambda i: torch.rsqrt(i.rand(3, 4, lo=0.1))),
    ("reciprocal", lambda i: torch.reciprocal(i.rand(3, 4, lo=0.1))),
    ("erfinv", lambda i: torch.erfinv(i.rand(3, 4, lo=-0.9, hi=0.9))),
    ("clamp", lambda i: torch.clamp(i.randn(3, 4), -0.5, 0.5)),
    ("where", lambda i: torch.where(i.randn(3, 4) > 0, i.randn(3, 4), i.randn(3, 4))),
    ("relu", lambda i: F.relu(i.randn(3, 4))),
    ("gelu", lambda i: F.gelu(i.randn(3, 4))),
    ("silu", lambda i: F.silu(i.randn(3, 4))),
    ("leaky_relu", lambda i: F.leaky_relu(i.randn(3, 4), 0.1)),
    ("elu", lambda i: F.elu(i.randn(3, 4))),
    ("hardswish", lambda i: F.hardswish(i.randn(3, 4))),
    ("softplus", lambda i: F.softplus(i.randn(3, 4))),
    ("glu", lambda i: F.glu(i.randn(3, 4))),
    ("softmax", lambda i: F.softmax(i.randn(3, 4), dim=-1)),
    ("log_softmax", lambda i: F.log_softmax(i.randn(3, 4), dim=-1)),
    ("softmin", lambda i: F.softmin(i.randn(3, 4), dim=-1)),
    ("layer_norm", lambda i: F.layer_norm(i.randn(3, 4), (4,), i.randn(4), i.randn(4))),
    ("group_norm", lambda i: F.group_norm(i.randn(2, 4, 3), 2, i.randn(4), i.randn(4))),
    (
        "batch_norm",
        lambda i: F.batch_norm(i.randn(2, 3, 4), i.randn(3), i.rand(3, lo=0.5), i.randn(3), i.randn(3)),
    ),
    ("instance_norm", lambda i: F.instance_norm(i.randn(2, 3, 4))),
    ("rms_norm", lambda i: F.rms_norm(i.randn(3, 4), (4,), i.randn(4))),
    ("normalize", lambda i: F.normalize(i.randn(3, 4), dim=1)),
    ("sum", lambda i: torch.sum(i.randn(3, 4))),
    ("mean", lambda i: i.randn(3, 4).mean(dim=1)),
    ("var", lambda i: torch.var(i.randn(3, 4), dim=0)),
    ("std", lambda i: torch.std(i.randn(3, 4))),
    ("amax", lambda i: torch.amax(i.randn(3, 4), dim=1)),
    ("topk", lambda i: torch.topk(i.randn(3, 4), 2)),
    ("sort", lambda i: torch.sort(i.randn(3, 4))),
    ("cumsum", lambda i: torch.cumsum(i.randn(3, 4), dim=1)),
    ("cumprod", lambda i: torch.cumprod(i.rand(3, 4, lo=0.5, hi=1.5), dim=1)),
    ("logsumexp", lambda i: torch.logsumexp(i.randn(3, 4), dim=1)),
    ("norm", lambda i: torch.norm(i.randn(3, 4))),
    ("linalg_vector_norm", lambda i: torch.linalg.vector_norm(i.randn(3, 4), dim=1)),
    ("frobenius_norm", lambda i: torch.linalg.matrix_norm(i.randn(3, 4))),
    ("dist", lambda i: torch.dist(i.randn(3, 4), i.randn(3, 4))),
    ("pdist", lambda i: F.pdist(i.randn(4, 3))),
    ("cosine_similarity", lambda i: F.cosine_similarity(i.randn(3, 4), i.randn(3, 4))),
    ("pairwise_distance", lambda i: F.pairwise_distance(i.randn(3, 4), i.randn(3, 4))),
    ("renorm", lambda i: torch.renorm(i.randn(3, 4), 2, 0, 1.0)),
    ("embedding", lambda i: F.embedding(torch.tensor([[0, 2], [4, 1]]), i.randn(5, 3))),
    ("embedding:grad", lambda i: F.embedding(torch.tensor([0, 2, 2]), i.randn(5, 3, grad=True))),
    (
        "embedding_bag",
        lambda i: F.embedding_bag(
            torch.tensor([0, 2, 4, 1]), i.randn(5, 3), torch.tensor([0, 2]), mode="sum"
        ),
    ),
    ("dropout", lambda i: _dropout(i.randn(3, 4))),
    ("avg_pool2d", lambda i: F.avg_pool2d(i.randn(1, 2, 4, 4), 2)),
    ("max_pool2d", lambda i: F.max_pool2d(i.randn(1, 2, 4, 4), 2)),
    ("max_pool3d_with_indices", lambda i: F.max_pool3d(i.randn(1, 2, 4, 4, 4), 2, return_indices=True)),
    ("adaptive_avg_pool2d", lambda i: F.adaptive_avg_pool2d(i.randn(1, 2, 5, 5), 2)),
    ("adaptive_max_pool2d", lambda i: F.adaptive_max_pool2d(i.randn(1, 2, 5, 5), 2)),
    ("interpolate", lambda i: F.interpolate(i.randn(1, 2, 3, 3), scale_factor=2, mode="bilinear")),
    ("interpolate:nearest", lambda i: F.interpolate(i.randn(1, 2, 3, 3), size=(5, 5))),
    ("unfold", lambda i: F.unfold(i.randn(1, 2, 4, 4), 2)),
    ("pixel_shuffle", lambda i: F.pixel_shuffle(i.randn(1, 4, 2, 2), 2)),
    ("pad", lambda i: F.pad(i.randn(1, 2, 4, 4), (1, 1, 1, 1))),
    ("pad:reflect3d", lambda i: F.pad(i.randn(1, 2, 3, 3, 3), (1, 1, 1, 1, 1, 1), mode="reflect")),
    ("pad:circular", lambda i: F.pad(i.randn(1, 2, 4, 4), (1, 1, 1, 1), mode="circular")),
    ("local_response_norm", lambda i: F.local_response_norm(i.randn(1, 4, 3), 2)),
    ("mv", lambda i: torch.mv(i.randn(3, 4), i.randn(4))),
    ("dot", lambda i: torch.dot(i.randn(4), i.randn(4))),
    ("vdot", lambda i: torch.vdot(i.randn(4), i.randn(4))),
    ("addmv", lambda i: torch.addmv(i.randn(3), i.randn(3, 4), i.randn(4))),
    ("addr", lambda i: torch.addr(i.randn(3, 4), i.randn(3), i.randn(4))),
    ("outer", lambda i: torch.outer(i.randn(3), i.randn(4))),
    ("kron", lambda i: torch.kron(i.randn(2, 2), i.randn(2, 3))),
    ("addcmul", lambda i: torch.addcmul(i.randn(3, 4), i.randn(3, 4), i.randn(3, 4), value=0.5)),
    ("addcdiv", lambda i: torch.addcdiv(i.randn(3, 4), i.randn(3, 4), i.rand(3, 4, lo=0.5))),
    ("atan2", lambda i: torch.atan2(i.randn(3, 4), i.randn(3, 4))),
    ("linalg_cross", lambda i: torch.linalg.cross(i.randn(2, 3), i.randn(2, 3))),
    (
        "scatter_add",
        lambda i: torch.scatter_add(i.randn(3, 4), 1, torch.tensor([[0, 1], [2, 3], [1, 1]]), i.randn(3, 2)),
    ),
    ("index_put", lambda i: torch.index_put(i.randn(4, 3), (torch.tensor([0, 2]),), i.randn(2, 3))),
    ("gather", lambda i: torch.gather(i.randn(3, 4), 1, torch.tensor([[0], [3], [2]]))),
    ("bilinear", lambda i: F.bilinear(i.randn(2, 3), i.randn(2, 4), i.randn(5, 3, 4), i.randn(5))),
    # torch.convolution and the 13-argument _convolution overload have no CPU autocast kernel.
    (
        "convolution",
        lambda i: torch.convolution(
            i.randn(1, 2, 5, 5), i.randn(3, 2, 3, 3), None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1
        ),
    ),
    (
        "_convolution:allow_tf32",
        lambda i: torch._convolution(
            i.randn(1, 2, 5, 5),
            i.randn(3, 2, 3, 3),
            None,
            [1, 1],
            [0, 0],
            [1, 1],
            False,
            [0, 0],
            1,
            False,
            False,
            True,
            True,
        ),
    ),
    # svd-based norms: torch raises for low-precision inputs even under autocast (checked before dispatch)
    ("nuclear_norm", lambda i: torch.nuclear_norm(i.randn(4, 3))),
    ("linalg_norm", lambda i: torch.linalg.norm(i.randn(4, 3), 2)),
    ("linalg_matrix_norm", lambda i: torch.linalg.matrix_norm(i.randn(4, 3), "nuc")),
    ("linalg_lu_solve", lambda i: torch.linalg.lu_solve(*i.lu(3), i.randn(3, 2))),
    ("linalg_lu_factor", lambda i: torch.linalg.lu_factor(i.wellcond(3))),
    ("linalg_det", lambda i: torch.linalg.det(i.wellcond(3))),
    (
        "linalg_solve_triangular",
        lambda i: torch.linalg.solve_triangular(i.upper(3), i.randn(3, 2), upper=True),
    ),
    (
        "lstm_cell",
        lambda i: torch._VF.lstm_cell(
            i.randn(2, 3), (i.randn(2, 4), i.randn(2, 4)), *_lstm_params(i, 3, 4, 4)
        ),
    ),
    ("gru_cell", lambda i: torch._VF.gru_cell(i.randn(2, 3), i.randn(2, 4), *_lstm_params(i, 3, 4, 3))),
    (
        "gru",
        lambda i: torch._VF.gru(
            i.randn(5, 2, 3), i.randn(1, 2, 4), _lstm_params(i, 3, 4, 3), True, 1, 0.0, False, False, False
        ),
    ),
    ("matrix_exp", lambda i: torch.matrix_exp(i.randn(3, 3) * 0.1)),
    (
        "triplet_margin_with_distance_loss",
        lambda i: F.triplet_margin_with_distance_loss(i.randn(3, 4), i.randn(3, 4), i.randn(3, 4)),
    ),
    ("gaussian_nll_loss", lambda i: F.gaussian_nll_loss(i.randn(3, 4), i.randn(3, 4), i.rand(3, 4, lo=0.5))),
    (
        "multilabel_soft_margin_loss",
        lambda i: F.multilabel_soft_margin_loss(i.randn(3, 4), i.rand(3, 4).round()),
    ),
    ("transpose", lambda i: i.randn(3, 4).transpose(0, 1)),
    ("reshape", lambda i: torch.reshape(i.randn(3, 4), (4, 3))),
]


def _seed(name: str) -> int:
    return zlib.crc32(name.encode())


def _wrap(name: str, builder: _Builder, dtype: torch.dtype) -> Callable[[], object]:
    seed = _seed(name)

    def call() -> object:
        return builder(_In(seed, dtype))

    call.__name__ = f"sample_{name}"
    call.__qualname__ = call.__name__
    return call


SAMPLE_GROUPS: dict[str, list[tuple[str, _Builder]]] = {
    "lower": _LOWER,
    "fp32": _FP32,
    "promote": _PROMOTE,
    "composite": _COMPOSITE,
    "unlisted": _UNLISTED,
}


def cpu_op_samples(dtype: torch.dtype = torch.float32, include_autocast_only: bool = False) -> list[Sample]:
    """All samples, each a ``(name, zero-argument callable)``; see the module docstring.

    With the default ``dtype`` every sample runs without error outside autocast.  ``include_autocast_only``
    adds the few mixed-dtype calls that only autocast makes legal (``index_copy`` with bf16 + fp32).
    """
    out: list[Sample] = []
    groups = [*SAMPLE_GROUPS.values(), _AUTOCAST_ONLY] if include_autocast_only else SAMPLE_GROUPS.values()
    for group in groups:
        out.extend((name, _wrap(name, builder, dtype)) for name, builder in group)
    return out
