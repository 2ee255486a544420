"""Files mixprec writes are complete or absent, and its readers say when one is cut short.

The kill test runs ``mixprec bench --json --log`` (through a results folder) with the test hook
``MIXPREC_WRITE_PAUSE_S``, which pauses in the middle of every write and right after every rename. At
every pause it copies the folder (what a kill at that moment would leave: every byte written so far has
reached the kernel) and checks it; at a chosen pause it kills the process with SIGKILL and checks what
is really left. Cut-off files of every kind are the battery's ``cases_files``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mixprec import cli
from mixprec._files import PAUSE_ENV, TruncatedFile, jsonl_text, read_jsonl, write_atomic
from mixprec.bench.report import RECORD_KEYS
from mixprec.bench.results import incomplete

ROOT = Path(__file__).resolve().parents[1]
PNG_END = b"IEND\xaeB`\x82"
BENCH = ["bench", "--size", "tiny", "--steps", "3", "--device", "cpu", "--threads", "1"]
BENCH += ["--workload", "tabular-regression,cnn", "--modes", "fp32", "--in-process"]


def test_write_atomic_replaces_whole_and_leaves_nothing_on_failure(tmp_path: Path) -> None:
    path = tmp_path / "x.json"
    write_atomic(path, "old\n")
    write_atomic(path, b"new\n")
    assert path.read_bytes() == b"new\n" and sorted(p.name for p in tmp_path.iterdir()) == ["x.json"]
    with pytest.raises(FileNotFoundError):
        write_atomic(tmp_path / "missing" / "x.json", "data")  # never creates the parent
    assert not (tmp_path / "missing").exists()


def test_read_jsonl_tells_complete_incomplete_and_truncated(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    text = jsonl_text([{"step": 0}, {"step": 1}], runs=1)
    path.write_text(text)
    assert read_jsonl(path) == ([{"step": 0}, {"step": 1}], {"records": 2, "runs": 1})
    path.write_text(text.split("\n", 2)[0] + "\n" + text.split("\n", 2)[1] + "\n")  # trailer missing
    assert read_jsonl(path)[1] is None
    path.write_text(text[:-3])  # cut inside the trailer
    with pytest.raises(TruncatedFile, match="log.jsonl:3: truncated: the last line is cut off"):
        read_jsonl(path)
    path.write_text(text.replace('{"step": 1}\n', ""))  # a line lost before the trailer
    with pytest.raises(TruncatedFile, match="counts 2 records but 1 precede it"):
        read_jsonl(path)


def _complete(path: Path) -> bool:
    """Whether ``path`` is a whole file of its kind, as the bench writes it."""
    data = path.read_bytes()
    if path.suffix == ".json":
        records = json.loads(data)
        return bool(records) and all(tuple(r) == RECORD_KEYS for r in records)
    if path.suffix == ".jsonl":
        records, trailer = read_jsonl(path)  # raises TruncatedFile for a cut log
        return trailer is not None and trailer["records"] == len(records) > 0
    if path.suffix == ".png":
        return data.startswith(b"\x89PNG\r\n\x1a\n") and data.endswith(PNG_END)
    if path.suffix == ".md":
        return data.endswith(b"redraws the pictures and tables from them.\n")
    raise AssertionError(f"the bench wrote an unexpected file {path}")


def _check_folder(folder: Path, tmp: Path, capsys: pytest.CaptureFixture[str], cli_too: bool) -> str:
    """Every file complete or a ``.partial``; the readers' verdict (and with ``cli_too`` the report's
    exit code and message) fits what is there. Returns absent, incomplete or complete."""
    for path in folder.rglob("*"):
        if path.is_file() and not path.name.endswith(".partial"):
            assert _complete(path), path
    if not (folder / "bench.json").exists():
        verdict, code, words = "absent", 2, "is a directory without bench.json"
    else:
        done = len(json.loads((folder / "bench.json").read_text()))
        log = folder / "steps.jsonl"
        logged = read_jsonl(log)[1]["runs"] if log.exists() else 2
        if done < 2 or logged < 2:  # a workload saved, or the JSON replaced and the log not yet
            which = "bench.json" if done < 2 else "steps.jsonl"
            verdict, code, words = "incomplete", 1, f"{which}: incomplete: 1 of 2 planned runs"
        else:
            verdict, code, words = "complete", 0, ""
        assert (incomplete(folder) or "").find(words) >= 0 and bool(incomplete(folder)) == (code == 1)
    if cli_too:
        assert cli.main(["report", str(folder), "--out", str(tmp / "report")]) == code
        assert words in capsys.readouterr().err
    return verdict


# pauses: the step log after each of workload 1's three rounds 0-5 (half-written, replaced); after workload
# 1: bench.json 6-7, steps.jsonl 8-9; workload 2's rounds 10-15; after workload 2: 16-19 (the rewrites over
# complete files); at the end: bench.json 20-21, steps.jsonl 22-23, three PNGs 24-29, summary.md 30-31
@pytest.mark.parametrize("kill_at", [18, 20, 30], ids=["log-rewrite", "final-json-rewrite", "summary"])
def test_kill_9_anywhere_leaves_every_file_complete_or_absent(
    kill_at: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "results"
    env = {**os.environ, PAUSE_ENV: "0.3", "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "mixprec", *BENCH, "--out", str(folder)],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    seen, events = [], 0
    try:
        for line in proc.stderr:  # type: ignore[union-attr]
            if not line.startswith("mixprec-write "):
                continue
            event, path = line.split()[1:3]
            snapshot = tmp_path / f"snapshot{events}"
            shutil.copytree(folder, snapshot)  # what a kill right now would leave (checked below)
            seen.append((event, Path(path).name, snapshot))
            if events == kill_at:
                os.kill(proc.pid, signal.SIGKILL)
                break
            events += 1
    finally:
        proc.wait(timeout=120)
    assert proc.returncode == -signal.SIGKILL, seen
    seen = [(e, name, _check_folder(snap, tmp_path, capsys, False)) for e, name, snap in seen]
    outcome = _check_folder(folder, tmp_path, capsys, cli_too=True)
    assert outcome == seen[-1][2]
    assert seen[0][:2] == ("half-written", "steps.jsonl.partial") and seen[0][2] == "absent"  # round 1
    assert ("half-written", "steps.jsonl.partial", "incomplete") in seen  # the log being rewritten
    if kill_at >= 20:
        assert seen[-1][2] == "complete"  # both runs saved before the final rewrites


def test_report_refuses_a_cut_log_and_names_an_unfinished_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "steps.jsonl"
    records = [{"step": i, "workload": "cnn", "mode": "fp32", "loss": 1.0} for i in range(4)]
    text = jsonl_text(records, runs=1, runs_planned=3)
    log.write_text(text)
    assert cli.main(["report", str(log), "--out", str(tmp_path / "a")]) == 1
    assert "steps.jsonl: incomplete: 1 of 3 planned runs" in capsys.readouterr().err
    assert "incomplete: 1 of 3 planned runs" in (tmp_path / "a" / "summary.md").read_text()
    log.write_text(text[: len(text) // 2])
    assert cli.main(["report", str(log), "--out", str(tmp_path / "b")]) == 2
    assert "truncated: the last line is cut off" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()  # nothing written from a cut file


class _Scaler:
    def get_scale(self) -> float:
        return 1024.0


def test_scaler_log_is_append_only_with_a_trailer_and_reopens_cleanly(tmp_path: Path) -> None:
    from mixprec.inspect import ScalerLog

    path = tmp_path / "run.jsonl"
    log = ScalerLog(_Scaler(), path)
    log.record(loss=1.0)
    log.record(loss=0.5)
    assert read_jsonl(path) == (log.records, None)  # written as it goes: a reader sees it unfinished
    assert incomplete(path) and "no end-of-log record after 2 records" in incomplete(path)  # type: ignore[operator]
    log.close()
    assert read_jsonl(path) == (log.records, {"records": 2}) and incomplete(path) is None
    log.record(loss=0.25)  # reopened: the trailer is dropped, the lines kept
    assert read_jsonl(path) == (log.records, None)
    log.close()
    assert read_jsonl(path) == (log.records, {"records": 3})
