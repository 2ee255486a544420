"""How busy the CPU is right now, and how many threads a run should use on it.

torch runs each CPU op on a pool of threads (one per core by default) that wait for each other at the
end of every op. When another program keeps a core busy, the thread on that core gets a fraction of a
time slice per op and every op waits for it: a step can take several times longer and its time jumps
from step to step (figures: docs/measured-figures.md, "threads on a busy CPU"). So ``--threads auto`` uses
torch's default on a quiet machine and, on a busy one, as many threads as there are idle cores (at least
1), and says so.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

_STAT = Path("/proc/stat")
BUSY_THRESHOLD = 0.5  # cores' worth of other work that counts as "busy"


def _cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs from /proc/stat, or None where it cannot be read."""
    try:
        fields = [int(v) for v in _STAT.read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def busy_cores(interval_s: float = 0.5) -> float:
    """Cores' worth of CPU time other programs used over ``interval_s`` (Linux /proc/stat; else loadavg)."""
    cores = os.cpu_count() or 1
    before = _cpu_times()
    if before is None:
        try:
            return min(os.getloadavg()[0], float(cores))
        except OSError:
            return 0.0
    time.sleep(interval_s)
    after = _cpu_times()
    if after is None or after[1] == before[1]:
        return 0.0
    return cores * (after[0] - before[0]) / (after[1] - before[1])


def choose_threads(requested: str, device: str) -> tuple[int, str]:
    """The torch thread count for each run and why: ``requested`` is ``"auto"`` or a positive integer.

    The reason is ``"torch's default"`` whenever the count is torch's own (also on a busy machine where
    fewer threads are not possible), so that callers only mention a count that changed.

    Raises:
        ValueError: ``requested`` is neither.
    """
    default = torch.get_num_threads()
    if requested != "auto":
        try:
            threads = int(requested)
        except ValueError:
            threads = 0
        if threads < 1:
            raise ValueError(f"--threads must be 'auto' or a positive integer, got {requested!r}")
        return threads, "set by --threads"
    if device.startswith("cuda"):
        return default, "torch's default"
    busy = busy_cores()
    if busy < BUSY_THRESHOLD:
        return default, "torch's default"
    idle = max(1, min(default, round((os.cpu_count() or 1) - busy)))
    if idle == default:  # nothing to change (torch already uses one thread, or no more than idle cores)
        return default, "torch's default"
    reason = (
        f"other programs keep {busy:.1f} of {os.cpu_count()} cores busy, so {count_threads(idle)} instead "
        f"of {default}: threads that share a busy core stall every op (--threads N to choose)"
    )
    return idle, reason


def count_threads(threads: int) -> str:
    """``"1 thread"``, ``"3 threads"``."""
    return f"{threads} thread" if threads == 1 else f"{threads} threads"
