"""Workload registry: what is trained, on which real data, for how long, and how it is scored.

A workload is built in two phases so the runner can measure memory between them: ``load`` reads the data
set (CPU tensors, shared by every mode), then ``build`` seeds torch and makes the model, optimizer, batch
iterator, loss and evaluation. Sizes are presets: ``tiny`` (tests), ``quick`` (a smoke run: fewer steps),
``default`` (cut to fit ``--time``), ``full`` (the longer study behind ``--full``,
about 10 minutes) and ``large`` (sized for a GPU; hours on a CPU). Everything a preset changes, including
the rounds the modes take turns in, is in the registry table at the end of this file.

``lm-gemm`` is the GEMM-bound workload: a GPT of width 2048, 4 layers, context 1024 (8 x 1024 tokens a
step), where the linear layers' GEMMs dominate the step so the fp8 modes show what they are worth on a
GPU. It runs only where asked for (``--workload lm-gemm``), and on a CPU only at ``tiny`` (its other
presets, about 10 TFLOP a step, are refused there: a step would take minutes).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mixprec.bench import data as datasets
from mixprec.bench.models import CharGPT, RegressionMLP, SmallCNN

Batch = tuple[torch.Tensor, torch.Tensor]
Forward = Callable[[torch.Tensor], torch.Tensor]
SIZES = ("tiny", "quick", "default", "full", "large")


@dataclass(frozen=True)
class Preset:
    """One size of one workload: step counts and the workload-specific knobs in ``params``.

    ``round_steps``: steps each mode trains before the next mode takes a turn (see
    ``mixprec.bench.schedule``). ``cost_ms``: the mean step time over the default CPU modes on the
    reference (this project's 2-core x86_64 with AVX512-BF16, one thread per run), for the time estimate.
    ``cpu_fp16`` says whether fp16 modes run on a CPU at this size (CPUs have no fast fp16 matmul).
    ``cpu`` says whether the preset runs on a CPU at all (False: sized for a GPU, refused on a CPU).
    """

    steps: int
    warmup: int
    round_steps: int
    params: Mapping[str, Any]
    cost_ms: float = 1.0
    cpu_fp16: bool = False
    cpu: bool = True


@dataclass
class Workload:
    """Everything one training run needs, freshly built from a seed."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    batches: Iterator[Batch]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    evaluate: Callable[[Forward], tuple[float, float]]
    make_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None


@dataclass(frozen=True)
class WorkloadSpec:
    """A registered workload: its presets, how to load its data and how to build a run from it."""

    name: str
    summary: str
    metric: str
    presets: Mapping[str, Preset]
    load: Callable[[Preset, Any], Any]  # (preset, job): the job's seed, data and images
    build: Callable[[Any, Preset, int, int, torch.device], Workload]
    metric_higher_is_better: bool = True
    default: bool = True  # run when no --workload is given (False: only when named)
    #: what the held-out loss is, for the table's footer ("": the footer names no loss)
    loss_meaning: str = ""


def _cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # Loss in fp32 whatever the output dtype, as torch.autocast does for cross_entropy.
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1))


def _mse(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(pred.float(), target)


# ---------------------------------------------------------------- lm
def _load_lm(preset: Preset, job: Any) -> datasets.TextCorpus:
    return datasets.text_corpus(preset.params["corpus_bytes"], job.data)


def _lm_batches(ids: torch.Tensor, context: int, batch: int, seed: int) -> Iterator[Batch]:
    generator = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(len(ids) - context - 1, (batch,), generator=generator)
        window = torch.stack([ids[s : s + context + 1] for s in starts.tolist()])
        yield window[:, :-1], window[:, 1:]


def _build_lm(
    corpus: datasets.TextCorpus, preset: Preset, seed: int, steps: int, device: torch.device
) -> Workload:
    p = preset.params
    torch.manual_seed(seed)
    model = CharGPT(len(corpus.vocab), p["context"], p["width"], p["layers"], p["heads"]).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=p["lr"], betas=(0.9, 0.99), weight_decay=0.01)
    chunk = p["context"] + 1
    n_windows = min(p["eval_windows"], len(corpus.val) // chunk)
    if n_windows < 1:
        raise ValueError(f"validation text is shorter than one context window ({chunk} characters)")
    windows = corpus.val[: n_windows * chunk].view(n_windows, chunk)

    def evaluate(forward: Forward) -> tuple[float, float]:
        total = 0.0
        for part in windows.split(16):
            part = part.to(device)
            logits = forward(part[:, :-1])
            total += _cross_entropy(logits, part[:, 1:]).item() * len(part)
        loss = total / n_windows
        return loss, math.exp(min(loss, 50.0))

    batches = _lm_batches(corpus.train, p["context"], p["batch"], seed)
    return Workload(model, optimizer, batches, _cross_entropy, evaluate, _warmup_cosine(steps))


def _warmup_cosine(steps: int) -> Callable[[torch.optim.Optimizer], Any]:
    """The usual transformer schedule: linear warm-up over 10% of the steps, cosine decay to 10%."""
    warmup = max(1, steps // 10)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, steps - warmup))
        return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))

    return lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# ---------------------------------------------------------------- cnn
def _load_cnn(preset: Preset, job: Any) -> datasets.Split:
    if job.images is None:
        return datasets.sklearn_digits(job.seed)
    return datasets.idx_images(job.images)


def _shuffled_batches(x: torch.Tensor, y: torch.Tensor, batch: int, seed: int) -> Iterator[Batch]:
    generator = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(y), generator=generator)
        for start in range(0, len(y) - batch + 1, batch):
            idx = order[start : start + batch]
            yield x[idx], y[idx]


def _build_cnn(
    split: datasets.Split, preset: Preset, seed: int, steps: int, device: torch.device
) -> Workload:
    p = preset.params
    torch.manual_seed(seed)
    model = SmallCNN(image_size=split.x_train.shape[-1]).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=p["lr"])
    x_test, y_test = split.x_test[: p["eval_images"]], split.y_test[: p["eval_images"]]

    def evaluate(forward: Forward) -> tuple[float, float]:
        loss_sum, correct = 0.0, 0
        for xs, ys in zip(x_test.split(500), y_test.split(500), strict=True):
            logits = forward(xs.to(device)).float()
            ys = ys.to(device)
            loss_sum += F.cross_entropy(logits, ys, reduction="sum").item()
            correct += int((logits.argmax(1) == ys).sum())
        return loss_sum / len(y_test), correct / len(y_test)

    batch = min(p["batch"], len(split.y_train))
    batches = _shuffled_batches(split.x_train, split.y_train, batch, seed)
    return Workload(model, optimizer, batches, _cross_entropy, evaluate)


# ---------------------------------------------------------------- tabular-regression
def _load_tabular(preset: Preset, job: Any) -> datasets.Split:
    return datasets.sklearn_diabetes(job.seed)


def _loader_batches(loader: torch.utils.data.DataLoader) -> Iterator[Batch]:
    while True:  # one pass of the loader per epoch: ``for epoch ...: for x, y in loader``
        yield from loader


def _build_tabular(
    split: datasets.Split, preset: Preset, seed: int, steps: int, device: torch.device
) -> Workload:
    """A small tabular regression loop: Adam + OneCycleLR(cycle_momentum=False) + a shuffled DataLoader."""
    p = preset.params
    torch.manual_seed(seed)
    model = RegressionMLP(split.x_train.shape[1], p["hidden"]).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=p["max_lr"])
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(split.x_train, split.y_train),
        batch_size=p["batch"],
        shuffle=True,
        generator=torch.Generator().manual_seed(seed),
    )

    def make_scheduler(opt: torch.optim.Optimizer) -> Any:
        return torch.optim.lr_scheduler.OneCycleLR(opt, p["max_lr"], total_steps=steps, cycle_momentum=False)

    def evaluate(forward: Forward) -> tuple[float, float]:
        pred = forward(split.x_test.to(device)).float()
        target = split.y_test.to(device)
        sse = float(((pred - target) ** 2).sum())
        sst = float(((target - target.mean()) ** 2).sum())
        return sse / len(target), 1.0 - sse / sst

    return Workload(model, optimizer, _loader_batches(loader), _mse, evaluate, make_scheduler)


# ---------------------------------------------------------------- registry
_LM = {"context": 128, "width": 256, "layers": 4, "heads": 4, "lr": 1e-3}
_LM_TINY = {"context": 32, "width": 64, "layers": 2, "heads": 2, "lr": 1e-3}
_LM_LARGE = {"context": 256, "width": 512, "layers": 6, "heads": 8, "lr": 6e-4}
#: GEMM-bound: the linears' GEMMs are ~93% of a step's FLOPs (attention's the rest), as in the fp8 studies
_LM_GEMM = {"context": 1024, "width": 2048, "layers": 4, "heads": 16, "lr": 3e-4, "batch": 8}
_LM_GEMM_DATA = {"corpus_bytes": 8_000_000, "eval_windows": 32}
#: Reference (2-core CPU) ms of one lm-gemm step: ~10.7 TFLOP (6 x 201M parameters x 8192 tokens, plus
#: attention) at the ~100 GFLOP/s the lm presets' cost_ms imply; for the refusal's estimate only
_LM_GEMM_MS = 107_000.0
_TAB = {"batch": 32, "hidden": 256, "max_lr": 3e-3}
_TAB_EPOCH = 12  # steps per epoch: ceil(354 training rows / batch 32)

#: The built-in workloads, by name.
WORKLOADS: dict[str, WorkloadSpec] = {
    "lm": WorkloadSpec(
        name="lm",
        summary="GPT-style char-level transformer (d=256, 4 layers, context 128) on Python's stdlib sources",
        metric="perplexity",
        metric_higher_is_better=False,
        loss_meaning="validation cross-entropy per character",
        presets={
            "tiny": Preset(
                3, 1, 1, {**_LM_TINY, "batch": 4, "corpus_bytes": 200_000, "eval_windows": 4}, 5.0, True
            ),
            "quick": Preset(
                24, 4, 4, {**_LM, "batch": 8, "corpus_bytes": 1_000_000, "eval_windows": 32}, 200.0
            ),
            "default": Preset(
                64, 4, 4, {**_LM, "batch": 16, "corpus_bytes": 2_000_000, "eval_windows": 64}, 390.0
            ),
            "full": Preset(
                180, 10, 10, {**_LM, "batch": 32, "corpus_bytes": 4_000_000, "eval_windows": 128}, 780.0
            ),
            "large": Preset(
                300,
                20,
                20,
                {**_LM_LARGE, "batch": 64, "corpus_bytes": 8_000_000, "eval_windows": 256},
                4000.0,
            ),
        },
        load=_load_lm,
        build=_build_lm,
    ),
    "lm-gemm": WorkloadSpec(
        name="lm-gemm",
        summary="GEMM-bound GPT (d=2048, 4 layers, context 1024, batch 8) on the same text; GPU only, "
        "named to run",
        metric="perplexity",
        metric_higher_is_better=False,
        loss_meaning="validation cross-entropy per character",
        presets={
            "tiny": Preset(
                3,
                1,
                1,
                {"context": 64, "width": 128, "layers": 2, "heads": 2, "lr": 1e-3, "batch": 2}
                | {"corpus_bytes": 200_000, "eval_windows": 2},
                20.0,
                True,
            ),
            "quick": Preset(24, 4, 4, {**_LM_GEMM, **_LM_GEMM_DATA}, _LM_GEMM_MS, cpu=False),
            "default": Preset(64, 4, 4, {**_LM_GEMM, **_LM_GEMM_DATA}, _LM_GEMM_MS, cpu=False),
            "full": Preset(180, 10, 10, {**_LM_GEMM, **_LM_GEMM_DATA}, _LM_GEMM_MS, cpu=False),
            "large": Preset(300, 20, 20, {**_LM_GEMM, **_LM_GEMM_DATA}, _LM_GEMM_MS, cpu=False),
        },
        load=_load_lm,
        build=_build_lm,
        default=False,
    ),
    "cnn": WorkloadSpec(
        name="cnn",
        summary="3-conv CNN on scikit-learn's 8x8 digits, or on IDX images (--images DIR: Fashion-MNIST)",
        metric="accuracy",
        loss_meaning="test cross-entropy",
        presets={
            "tiny": Preset(3, 1, 1, {"batch": 8, "lr": 1e-3, "eval_images": 64}, 2.0, True),
            "quick": Preset(60, 10, 10, {"batch": 64, "lr": 1e-3, "eval_images": 2000}, 12.0),
            "default": Preset(300, 20, 20, {"batch": 128, "lr": 1e-3, "eval_images": 10_000}, 20.0),
            "full": Preset(600, 20, 20, {"batch": 128, "lr": 1e-3, "eval_images": 10_000}, 20.0),
            "large": Preset(600, 20, 20, {"batch": 512, "lr": 2e-3, "eval_images": 10_000}, 80.0),
        },
        load=_load_cnn,
        build=_build_cnn,
    ),
    "tabular-regression": WorkloadSpec(
        name="tabular-regression",
        summary="MLP regression on scikit-learn's diabetes table: Adam + OneCycleLR + a shuffled DataLoader",
        metric="R^2",
        loss_meaning="validation MSE (standardised target)",
        presets={
            "tiny": Preset(3, 1, 1, {**_TAB, "hidden": 32}, 1.0, True),
            "quick": Preset(8 * _TAB_EPOCH, _TAB_EPOCH, _TAB_EPOCH, _TAB, 1.2, True),
            "default": Preset(50 * _TAB_EPOCH, 2 * _TAB_EPOCH, 3 * _TAB_EPOCH, _TAB, 1.2, True),
            "full": Preset(50 * _TAB_EPOCH, 2 * _TAB_EPOCH, 3 * _TAB_EPOCH, _TAB, 1.2, True),
            "large": Preset(50 * _TAB_EPOCH, 2 * _TAB_EPOCH, 3 * _TAB_EPOCH, _TAB, 1.2, True),
        },
        load=_load_tabular,
        build=_build_tabular,
    ),
}
