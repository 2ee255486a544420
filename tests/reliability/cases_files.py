"""Battery cases for files cut short: every reader refuses a truncated file with a message that says so.

Each kind of file mixprec writes (the bench's ``--json`` list and ``--log`` lines, a ``ScalerLog``, a
results folder) is written complete by mixprec's own writers, then cut at points spread over its
length (never at a line boundary: a log cut there is whole lines without the trailer, which the
readers call incomplete, see ``tests/test_files.py``). The reader must raise ``TruncatedFile`` (a
ValueError) naming "truncated", leaving the file as it was.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from mixprec._files import TruncatedFile
from mixprec.bench.report import write_json, write_log
from mixprec.bench.results import incomplete, load_bench_json, write_report
from mixprec.inspect import ScalerLog
from mixprec.inspect.report import load_log

from .battery import Case

CUTS = 8  # cut points per file kind


def _results() -> list[Any]:
    def run(mode: str, ms: float) -> SimpleNamespace:
        history = [
            {
                "step": i,
                "round": i // 2,
                "loss": 2.0 - 0.1 * i,
                "scale": None,
                "skipped": False,
                "step_time_ms": ms,
            }
            for i in range(8)
        ]
        return SimpleNamespace(
            workload="cnn",
            mode=mode,
            device="cpu",
            threads=1,
            dtype="bfloat16",
            steps=8,
            warmup=1,
            history=history,
            peak_memory_mb=20.0,
            memory_method="cpu-hwm",
            final_loss=0.06,
            final_metric=0.99,
            skipped_steps=0,
            final_scale=None,
            data_source="digits",
        )

    return [run("fp32", 15.0), run("torch-amp-bf16", 10.0)]


class _Scaler:
    def get_scale(self) -> float:
        return 65536.0


def _scaler_log(path: Path) -> None:
    with ScalerLog(_Scaler(), path) as log:
        for step in range(10):
            log.record(step, loss=1.0 / (step + 1))


WRITERS: dict[str, tuple[str, Callable[[Path], None]]] = {
    "bench --json": ("bench.json", lambda p: write_json(_results(), p) and None),
    "bench --log": ("steps.jsonl", lambda p: write_log(_results(), p) and None),
    "ScalerLog": ("scaler.jsonl", _scaler_log),
}
READERS: dict[str, Callable[[Path], Any]] = {
    "load_bench_json": load_bench_json,
    "load_log": load_log,
    "incomplete": incomplete,
    "write_report": lambda p: write_report(p, p.with_name("report")),
}
READS = {"bench --json": ("load_bench_json", "incomplete", "write_report")}


def _cut_points(data: bytes) -> list[int]:
    points = []
    for index in range(1, CUTS + 1):
        cut = len(data) * index // (CUTS + 1)
        while data[cut - 1 : cut] == b"\n" or data[cut : cut + 1] in (b"\n", b""):
            cut -= 1  # not at a line boundary, and something is really lost
        points.append(cut)
    return sorted(set(points))


def _setup(kind: str, cut: int | None) -> Callable[[], dict[str, Any]]:
    def setup() -> dict[str, Any]:
        name, writer = WRITERS[kind]
        directory = Path(tempfile.mkdtemp(prefix="mixprec-cut-"))
        path = directory / name
        writer(path)
        data = path.read_bytes()
        path.write_bytes(data[:cut])
        return {"path": path}

    return setup


def _full_lengths() -> dict[str, int]:
    lengths = {}
    for kind, (name, writer) in WRITERS.items():
        path = Path(tempfile.mkdtemp(prefix="mixprec-len-")) / name
        writer(path)
        lengths[kind] = len(path.read_bytes())
        cuts = _cut_points(path.read_bytes())
        lengths[kind + " cuts"] = cuts  # type: ignore[assignment]
    return lengths


def cases() -> list[Case]:
    table = _full_lengths()
    out = []
    for kind in WRITERS:
        readers = READS.get(kind, ("load_log", "incomplete", "write_report"))
        for cut in table[kind + " cuts"]:  # type: ignore[union-attr]
            for reader in readers:
                out.append(
                    Case(
                        f"{reader}({kind} cut at {cut} of {table[kind]} bytes)",
                        lambda ctx, r=reader: READERS[r](ctx["path"]),
                        names=("truncated",),
                        setup=_setup(kind, cut),
                        raises=(TruncatedFile,),
                        target=lambda ctx: ctx["path"].read_bytes(),
                        owner="files",
                    )
                )
    return out
