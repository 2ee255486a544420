"""The bench: side-by-side training runs of precision modes on real workloads (``mixprec bench``)."""

from mixprec.bench import lowbit_modes as _lowbit_modes  # noqa: F401  (registers the lowbit-<recipe> modes)
from mixprec.bench.jobs import Plan, make_plan
from mixprec.bench.modes import ALIASES, DEFAULT_MODES, MODES, ModeSpec, TrainMode, register
from mixprec.bench.report import RECORD_KEYS, format_table, make_records, write_json, write_log
from mixprec.bench.results import incomplete, write_report
from mixprec.bench.runner import Job, RunFailed, RunResult, Trainer, run_job
from mixprec.bench.schedule import run_plan
from mixprec.bench.stats import Timing, timings
from mixprec.bench.workloads import WORKLOADS, Preset, WorkloadSpec

__all__ = [
    "ALIASES",
    "DEFAULT_MODES",
    "MODES",
    "RECORD_KEYS",
    "WORKLOADS",
    "Job",
    "ModeSpec",
    "Plan",
    "Preset",
    "RunFailed",
    "RunResult",
    "Timing",
    "TrainMode",
    "Trainer",
    "WorkloadSpec",
    "format_table",
    "incomplete",
    "make_plan",
    "make_records",
    "register",
    "run_job",
    "run_plan",
    "timings",
    "write_json",
    "write_log",
    "write_report",
]
