"""Real data sets that are always present offline, loaded the same way for every mode.

* text: Python's own standard-library sources (``sysconfig.get_paths()["stdlib"]``), ``.py`` files read in
  sorted order and capped at a byte budget, or any UTF-8 text file the user names;
* images: scikit-learn's bundled 8x8 digits, or any directory of MNIST-style IDX files (gzipped or not),
  such as Fashion-MNIST (Debian package ``dataset-fashion-mnist``: ``/usr/share/datasets/fashion-mnist``);
* tabular: scikit-learn's bundled diabetes regression set.

Nothing here is synthetic and nothing depends on the precision mode: every mode sees the same tensors.
"""

from __future__ import annotations

import gzip
import struct
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

FASHION_MNIST_DIRS: tuple[Path, ...] = (Path("/usr/share/datasets/fashion-mnist"),)
FASHION_MNIST_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


@dataclass(frozen=True)
class TextCorpus:
    """A character-level corpus: train/validation token ids and the vocabulary that maps them."""

    train: torch.Tensor
    val: torch.Tensor
    vocab: str
    source: str


@dataclass(frozen=True)
class Split:
    """A supervised data set already split into train and held-out parts."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    source: str


def stdlib_text(max_bytes: int) -> tuple[str, str]:
    """Concatenate the stdlib's ``.py`` sources in sorted path order until ``max_bytes`` is reached.

    Returns:
        The text and a short description of where it came from.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if not _SKIP_DIRS.intersection(p.relative_to(root).parts))
    parts: list[str] = []
    size = 0
    for path in files:
        if size >= max_bytes:
            break
        chunk = path.read_bytes()[: max_bytes - size]
        parts.append(chunk.decode("utf-8", errors="replace"))
        size += len(chunk)
    if not parts:
        raise RuntimeError(f"no .py files found under the standard library at {root}; pass --data FILE")
    return "".join(parts), f"Python stdlib sources ({len(parts)} files, {size / 1e6:.1f} MB)"


MIN_TEXT_BYTES = 10_000


def check_text_file(path: str | Path) -> None:
    """Raise unless ``path`` is a readable file of at least ``MIN_TEXT_BYTES`` bytes (the lm's --data).

    Raises:
        FileNotFoundError: not a file. ValueError: unreadable or too short.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--data {str(path)!r} is not a file; pass a UTF-8 text file")
    try:
        with path.open("rb") as handle:
            size = len(handle.read(MIN_TEXT_BYTES))
    except OSError as exc:
        raise ValueError(f"--data {str(path)!r} cannot be read: {exc.strerror}") from exc
    if size < MIN_TEXT_BYTES:
        raise ValueError(
            f"--data {str(path)!r} holds {size} bytes; the lm workload needs at least {MIN_TEXT_BYTES}"
        )


def file_text(path: str | Path, max_bytes: int) -> tuple[str, str]:
    """Read the first ``max_bytes`` of a UTF-8 text file (undecodable bytes are replaced)."""
    check_text_file(path)
    path = Path(path)
    with path.open("rb") as handle:
        raw = handle.read(max_bytes)
    return raw.decode("utf-8", errors="replace"), f"{path.name} ({len(raw) / 1e6:.1f} MB)"


def text_corpus(max_bytes: int, path: str | Path | None = None, val_fraction: float = 0.1) -> TextCorpus:
    """Character-level corpus; the last ``val_fraction`` of the text is the validation split."""
    text, source = stdlib_text(max_bytes) if path is None else file_text(path, max_bytes)
    codes = torch.frombuffer(bytearray(text.encode("utf-32-le")), dtype=torch.int32)
    code_points, ids = torch.unique(codes, sorted=True, return_inverse=True)
    vocab = "".join(chr(c) for c in code_points.tolist())
    cut = int(len(ids) * (1.0 - val_fraction))
    return TextCorpus(train=ids[:cut], val=ids[cut:], vocab=vocab, source=source)


def _read_idx(path: Path) -> torch.Tensor:
    """Parse one IDX file (the MNIST container: magic, dims, big-endian uint8 payload)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as handle:
        raw = handle.read()
    zero, dtype_code, ndim = struct.unpack(">HBB", raw[:4])
    if zero != 0 or dtype_code != 0x08:
        raise ValueError(f"{path} is not a uint8 IDX file (magic {raw[:4].hex()})")
    shape = struct.unpack(f">{ndim}I", raw[4 : 4 + 4 * ndim])
    payload = bytearray(raw[4 + 4 * ndim :])
    return torch.frombuffer(payload, dtype=torch.uint8).reshape(shape)


def _find_idx(directory: Path, stem: str) -> Path | None:
    for candidate in (directory / stem, directory / f"{stem}.gz"):
        if candidate.is_file():
            return candidate
    return None


def missing_idx_files(directory: str | Path) -> list[str]:
    """The IDX files (of ``FASHION_MNIST_FILES``, gzipped or not) that ``directory`` lacks."""
    directory = Path(directory)
    return [stem for stem in FASHION_MNIST_FILES.values() if _find_idx(directory, stem) is None]


def idx_images(directory: str | Path) -> Split:
    """MNIST-style IDX images (e.g. Fashion-MNIST: 60k train / 10k test, 28x28), standardised on train.

    Raises:
        FileNotFoundError: naming the files ``directory`` lacks.
    """
    directory = Path(directory)
    missing = missing_idx_files(directory)
    if missing:
        raise FileNotFoundError(
            f"--images {str(directory)!r} lacks {', '.join(missing)} (.gz or not); Fashion-MNIST: "
            "apt-get install dataset-fashion-mnist, then --images /usr/share/datasets/fashion-mnist"
        )
    paths = {key: _find_idx(directory, stem) for key, stem in FASHION_MNIST_FILES.items()}
    data = {key: _read_idx(path) for key, path in paths.items()}  # type: ignore[arg-type]
    x_train = data["train_images"].float().div_(255.0).unsqueeze(1)
    x_test = data["test_images"].float().div_(255.0).unsqueeze(1)
    mean, std = x_train.mean(), x_train.std()
    return Split(
        x_train=x_train.sub_(mean).div_(std),
        y_train=data["train_labels"].long(),
        x_test=x_test.sub_(mean).div_(std),
        y_test=data["test_labels"].long(),
        source=f"IDX images from {directory} ({x_train.shape[-2]}x{x_train.shape[-1]})",
    )


def fashion_mnist(dirs: tuple[Path, ...] = FASHION_MNIST_DIRS) -> Split | None:
    """:func:`idx_images` from the first of ``dirs`` that holds all four files; None if none does."""
    for directory in dirs:
        if not missing_idx_files(directory):
            return idx_images(directory)
    return None


def _seeded_split(n: int, test_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_test = round(n * test_fraction)
    return order[n_test:], order[:n_test]


def _sklearn_dataset(loader: str, workload: str) -> Any:
    try:
        import sklearn.datasets
    except ImportError as exc:
        raise RuntimeError(
            f"the {workload} workload needs scikit-learn: pip install 'mixprec[bench]'"
        ) from exc
    return getattr(sklearn.datasets, loader)()


def sklearn_digits(seed: int) -> Split:
    """scikit-learn's bundled 8x8 digits (1797 images), 80/20 split fixed by ``seed``."""
    bunch = _sklearn_dataset("load_digits", "cnn")
    x = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(bunch.target, dtype=torch.long)
    train, test = _seeded_split(len(y), 0.2, seed)
    mean, std = x[train].mean(), x[train].std()
    x = (x - mean) / std
    return Split(x[train], y[train], x[test], y[test], source="scikit-learn digits (8x8)")


def sklearn_diabetes(seed: int) -> Split:
    """scikit-learn's bundled diabetes regression set (442 x 10), 80/20 split, standardised on train."""
    bunch = _sklearn_dataset("load_diabetes", "tabular-regression")
    x = torch.tensor(bunch.data, dtype=torch.float32)
    y = torch.tensor(bunch.target, dtype=torch.float32)
    train, test = _seeded_split(len(y), 0.2, seed)
    x = (x - x[train].mean(0)) / x[train].std(0)
    y = (y - y[train].mean()) / y[train].std()
    return Split(x[train], y[train], x[test], y[test], source="scikit-learn diabetes (442 x 10)")
