"""Check every output path before the first training step, so that a bad path costs seconds, not the run.

Each check raises one ``ValueError`` naming the option, the path and what is accepted. Nothing is
created that the user did not name: a missing parent directory of an output is an error naming it,
unless ``mkdir=True`` (``--mkdir``), which creates it as ``mkdir -p`` would.
"""

from __future__ import annotations

import os
from pathlib import Path


def _writable_dir(directory: Path, option: str, path: Path, mkdir: bool) -> None:
    for parent in (directory, *directory.parents):
        if parent.exists() and not parent.is_dir():
            raise ValueError(f"{option} {str(path)!r}: {str(parent)!r} is a file, not a directory")
    if not directory.exists():
        if not mkdir:
            raise ValueError(
                f"{option} {str(path)!r}: the directory {str(directory)!r} does not exist; create it "
                "or pass --mkdir to create missing directories"
            )
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(
                f"{option} {str(path)!r}: cannot create {str(directory)!r} ({exc.strerror})"
            ) from exc
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ValueError(f"{option} {str(path)!r}: the directory {str(directory)!r} is not writable")


def output_file(path: str | Path, option: str, mkdir: bool = False) -> Path:
    """A file the bench will write (``--json``, ``--log``): not a directory, in a writable directory
    that exists (or is created when ``mkdir``)."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(
            f"{option} {str(path)!r} is a directory; give a file path, e.g. {str(path / 'bench.json')!r}"
        )
    _writable_dir(path.parent if str(path.parent) else Path("."), option, path, mkdir)
    if path.exists() and not os.access(path, os.W_OK):
        raise ValueError(f"{option} {str(path)!r} exists and is not writable")
    return path


def output_dir(path: str | Path, option: str, mkdir: bool = False) -> Path:
    """A directory the bench will write into (``--plot``, ``--out``): not an existing file; created if
    missing when its parent exists (or any missing parents too when ``mkdir``)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{option} {str(path)!r} is a file; give a directory (created if missing)")
    parent = path.parent if str(path.parent) else Path(".")
    if not path.exists():
        _writable_dir(parent, option, path, mkdir)
        try:
            path.mkdir(exist_ok=True)
        except OSError as exc:
            raise ValueError(f"{option} {str(path)!r}: cannot create it ({exc.strerror})") from exc
    _writable_dir(path, option, path, mkdir)
    return path


def distinct(paths: dict[str, str | None]) -> None:
    """Two options must not name the same file (``--json x --log x`` would overwrite one with the other)."""
    seen: dict[Path, str] = {}
    for option, path in paths.items():
        if path is None:
            continue
        resolved = Path(path).resolve()
        if resolved in seen:
            raise ValueError(f"{seen[resolved]} and {option} name the same file {path!r}; give two paths")
        seen[resolved] = option


def matplotlib_available() -> None:
    """``--plot`` needs matplotlib: say how to install it before training instead of after."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise ValueError("--plot needs matplotlib: pip install 'mixprec[plot]'") from exc
