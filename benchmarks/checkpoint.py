"""Results that survive a time limit, for the benchmarks that ``benchmarks/gpu.sh`` runs under ``timeout``.

``timeout`` sends SIGTERM at a step's limit and SIGKILL 3 s later. :func:`stop_on_sigterm` turns the
SIGTERM into a ``KeyboardInterrupt`` (as Ctrl-C), so a script's ``except KeyboardInterrupt`` can write
what it has; :func:`write_json` replaces the results file whole (``mixprec._files.write_atomic``), so a
SIGKILL in the middle of a write leaves the previous version. Each script writes after every row it
measures, with ``"partial"`` saying why the file is not final (``"running: 3 of 10 rows"`` while it
runs, ``"stopped by SIGTERM after 3 of 10 rows"`` when cut), and ``"partial": None`` once it finished;
``benchmarks/gpu_summary.py`` prints a file with a ``partial`` reason under a PARTIAL heading.
"""

from __future__ import annotations

import json
import math
import signal
import threading
from pathlib import Path
from typing import Any

from mixprec._files import write_atomic

STOPPED = "stopped by SIGTERM (the step's time limit)"


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(STOPPED)


def stop_on_sigterm() -> None:
    """From now on SIGTERM raises ``KeyboardInterrupt`` in the main thread (no-op in another thread)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)


def _finite(value: Any) -> Any:
    """NaN and infinities as None, so the file is strict JSON (a diverged loss is a result, not a crash)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def write_json(path: str | Path | None, payload: dict[str, Any], partial: str | None) -> None:
    """Replace ``path`` (nothing when None) by ``payload`` with ``"partial": partial``, atomically."""
    if path is None:
        return
    text = json.dumps(_finite({**payload, "partial": partial}), indent=1, allow_nan=False) + "\n"
    write_atomic(path, text)
