"""Files that are complete or absent, and readers that say when a file was cut short.

Every file mixprec writes goes through this module:

* **whole files** (JSON, Markdown, PNG, a log rewritten as a whole): :func:`write_atomic` writes
  ``NAME.partial`` in the same directory, flushes and ``fsync``s it, renames it over ``NAME``
  (``os.replace``: atomic within a file system) and ``fsync``s the directory so the rename itself is
  durable. A kill at any moment leaves the old file or the new one, never a mix; at most a stray
  ``NAME.partial`` remains, which no reader opens and the next write replaces. This is the recipe of
  LWN's "Ensuring data reaches disk" (2011), as SQLite and git use it.
* **append-only JSON Lines** (a log written step by step): each line is written whole and flushed, and
  closing the log appends a trailer line ``{"end_of_log": {"records": N, ...}}``
  (:func:`trailer_line`). :func:`read_jsonl` raises :class:`TruncatedFile` for a log cut inside a line
  or holding fewer records than its trailer counts, and returns ``trailer=None`` for a log that has no
  trailer (its writer was stopped before closing it, or is still writing).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

PARTIAL_SUFFIX = ".partial"
TRAILER_KEY = "end_of_log"
PAUSE_ENV = "MIXPREC_WRITE_PAUSE_S"


class TruncatedFile(ValueError):
    """A file ends where it should not: cut inside a line or a JSON document, or missing counted lines."""


def partial_path(path: str | Path) -> Path:
    """Where :func:`write_atomic` stages ``path``: ``NAME.partial`` beside it."""
    path = Path(path)
    return path.with_name(path.name + PARTIAL_SUFFIX)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # a platform without directory handles (Windows): the rename is all there is
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: str | Path, data: str | bytes) -> Path:
    """Replace ``path`` by ``data`` (str: UTF-8) so that a reader sees the old file or the new one.

    The parent directory must exist (mixprec never creates a path the user did not ask for).

    Raises:
        OSError: the directory is missing or not writable (no ``.partial`` is left behind then).
    """
    path = Path(path)
    staged = partial_path(path)
    payload = data.encode() if isinstance(data, str) else data
    half = len(payload) // 2
    try:
        with staged.open("wb") as handle:
            handle.write(payload[:half])
            handle.flush()
            _pause("half-written", staged)
            handle.write(payload[half:])
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(staged, path)
    except BaseException:
        staged.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent if str(path.parent) else Path("."))
    _pause("replaced", path)
    return path


def _pause(event: str, path: Path) -> None:
    """With ``MIXPREC_WRITE_PAUSE_S`` set (tests only), announce ``event`` on stderr and sleep, so that
    a test can kill the process in the middle of a write or right after it."""
    delay = os.environ.get(PAUSE_ENV)
    if delay:
        sys.stderr.write(f"mixprec-write {event} {path}\n")
        sys.stderr.flush()
        time.sleep(float(delay))


def trailer_line(records: int, **fields: Any) -> str:
    """The last line of a complete JSON Lines log: ``{"end_of_log": {"records": N, **fields}}``."""
    return json.dumps({TRAILER_KEY: {"records": records, **fields}}, allow_nan=False) + "\n"


def jsonl_text(records: list[Mapping[str, Any]], **trailer: Any) -> str:
    """JSON Lines for ``records`` (no NaN/inf) followed by their trailer (see :func:`trailer_line`)."""
    lines = [json.dumps(dict(record), allow_nan=False) + "\n" for record in records]
    return "".join(lines) + trailer_line(len(records), **trailer)


def read_jsonl(path: str | Path) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """The JSON objects of a JSON Lines file (blank lines skipped) and its trailer (None: none).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        TruncatedFile: the last line is cut (no newline and not valid JSON), or the trailer counts more
            records than precede it, or lines follow the trailer.
        ValueError: a line (not the last) is not a JSON object, naming the line.
    """
    path = Path(path)
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.split("\n")
    records: list[dict[str, Any]] = []
    trailer: dict[str, Any] | None = None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if trailer is not None:
            raise TruncatedFile(f"{path}:{number}: lines follow the end-of-log record of line {number - 1}")
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            if number == len(lines):  # the file does not end with a newline: the writer was cut off
                raise TruncatedFile(
                    f"{path}:{number}: truncated: the last line is cut off after {len(line)} characters "
                    f"({len(records)} complete records before it); the program writing it was stopped "
                    "mid-line or the file was copied incompletely"
                ) from exc
            raise ValueError(f"{path}:{number}: not valid JSON ({exc.msg}): {line.strip()[:80]!r}") from exc
        if not isinstance(value, dict):
            if number == len(lines):
                raise TruncatedFile(f"{path}:{number}: truncated: the last line is cut off: {line[:80]!r}")
            raise ValueError(f"{path}:{number}: expected a JSON object, got {line.strip()[:80]!r}")
        if TRAILER_KEY in value:
            trailer = value[TRAILER_KEY] if isinstance(value[TRAILER_KEY], dict) else {}
            continue
        records.append(value)
    if trailer is not None and trailer.get("records") != len(records):
        raise TruncatedFile(
            f"{path}: truncated: its end-of-log record counts {trailer.get('records')} records but "
            f"{len(records)} precede it"
        )
    return records, trailer
