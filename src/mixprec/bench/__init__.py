"""The bench: side-by-side training runs of precision modes on real workloads (``mixprec bench``)."""

from mixprec.bench.modes import ALIASES, DEFAULT_MODES, MODES, ModeSpec, TrainMode
from mixprec.bench.plan import Plan, make_plan
from mixprec.bench.report import RECORD_KEYS, format_table, make_records, write_json, write_log, write_plots
from mixprec.bench.runner import Job, RunFailed, RunResult, run_isolated, run_job, run_jobs
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
    "TrainMode",
    "WorkloadSpec",
    "format_table",
    "make_plan",
    "make_records",
    "run_isolated",
    "run_job",
    "run_jobs",
    "write_json",
    "write_log",
    "write_plots",
]
