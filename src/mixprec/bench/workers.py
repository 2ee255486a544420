"""Where a run lives while the scheduler interleaves it with the other modes: a worker process or this one.

A :class:`ProcessWorker` is one ``spawn``-ed process per (workload, mode) run, alive for the whole run and
driven over a pipe: ``("steps", count, round)`` trains a round and answers its steps' history entries
(``Trainer.history``: step, round, loss, scale, skipped, step time), ``("finish",)``
answers the :class:`~mixprec.bench.runner.RunResult` and ends the process. All the workers of a workload
are alive at once but only one trains at a time (the others wait in ``recv``, using no CPU), so a change
in the machine's load between rounds lands on every mode alike, while each run's peak resident memory is
still its own process's. A :class:`LocalWorker` does the same in this process (``--in-process``: faster to
start, no CPU peak memory).
"""

from __future__ import annotations

import multiprocessing
import traceback
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from mixprec.bench.runner import Job, RunFailed, RunResult, Trainer

Waiting = Callable[[], None]
_POLL_S = 1.0


class LocalWorker:
    """A :class:`Trainer` in this process, behind the same calls as :class:`ProcessWorker`."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self._trainer: Trainer | None = None

    def start(self) -> None:
        """Nothing to launch: the trainer is built by :meth:`wait_ready`."""

    def wait_ready(self, on_wait: Waiting | None = None) -> None:
        self._trainer = self._guard(lambda: Trainer(self.job, fresh_process=False))

    def steps(self, count: int, round_index: int, on_wait: Waiting | None = None) -> list[dict[str, Any]]:
        return self._guard(lambda: _round(self._trainer, count, round_index))  # type: ignore[arg-type]

    def finish(self, on_wait: Waiting | None = None) -> RunResult:
        return self._guard(lambda: self._trainer.finish())  # type: ignore[union-attr]

    def close(self) -> None:
        self._trainer = None

    def _guard(self, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except Exception as exc:
            raise RunFailed(
                f"{self.job.workload}/{self.job.label} failed:\n{traceback.format_exc()}"
            ) from exc


def _round(trainer: Trainer, count: int, round_index: int) -> list[dict[str, Any]]:
    """Train a round; its steps' history entries (so the driver can log them as the rounds go)."""
    before = len(trainer.history)
    trainer.steps(count, round_index)
    return trainer.history[before:]


def _worker_main(job: Job, conn: Any) -> None:
    """The worker process: build the trainer, then answer ``steps`` and ``finish`` requests."""
    try:
        trainer = Trainer(job, fresh_process=True)
        conn.send(("ok", None))
        while True:
            request = conn.recv()
            if request[0] == "steps":
                conn.send(("ok", _round(trainer, request[1], request[2])))
            else:
                conn.send(("ok", asdict(trainer.finish())))
                return
    except (EOFError, KeyboardInterrupt):
        return  # the driver went away or was interrupted: nothing to answer
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


class ProcessWorker:
    """One fresh process per run, driven round by round over a pipe (see the module docstring)."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self._context = multiprocessing.get_context("spawn")
        self._conn: Any = None
        self._process: Any = None

    def start(self) -> None:
        """Launch the process; it builds the run while other workers start (see :meth:`wait_ready`)."""
        ours, theirs = self._context.Pipe(duplex=True)
        self._process = self._context.Process(target=_worker_main, args=(self.job, theirs), daemon=True)
        self._process.start()
        theirs.close()
        self._conn = ours

    def wait_ready(self, on_wait: Waiting | None = None) -> None:
        self._answer(on_wait)

    def steps(self, count: int, round_index: int, on_wait: Waiting | None = None) -> list[dict[str, Any]]:
        self._send(("steps", count, round_index))
        return self._answer(on_wait)

    def finish(self, on_wait: Waiting | None = None) -> RunResult:
        self._send(("finish",))
        payload = self._answer(on_wait)
        self._process.join(timeout=30)
        return RunResult(**payload)

    def close(self) -> None:
        """End the process if it is still running (after a failure elsewhere or an interrupt)."""
        if self._process is not None and self._process.is_alive():
            self._process.terminate()
            self._process.join(timeout=10)
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _send(self, request: tuple[Any, ...]) -> None:
        try:
            self._conn.send(request)
        except (BrokenPipeError, OSError):
            raise self._died() from None

    def _answer(self, on_wait: Waiting | None) -> Any:
        while not self._conn.poll(_POLL_S):
            if not self._process.is_alive() and not self._conn.poll(0):
                raise self._died()
            if on_wait is not None:
                on_wait()
        try:
            status, payload = self._conn.recv()
        except EOFError:
            raise self._died() from None
        if status != "ok":
            raise RunFailed(f"{self.job.workload}/{self.job.label} failed:\n{payload}")
        return payload

    def _died(self) -> RunFailed:
        self._process.join(timeout=5)
        code = self._process.exitcode
        why = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        hint = " (out of memory?)" if code == -9 else ""
        return RunFailed(
            f"{self.job.workload}/{self.job.label}: the run's process {why} without a result{hint}"
        )


def make_worker(job: Job, isolated: bool) -> LocalWorker | ProcessWorker:
    """A :class:`ProcessWorker` when ``isolated`` (the default of ``mixprec bench``), else a local one."""
    return ProcessWorker(job) if isolated else LocalWorker(job)
