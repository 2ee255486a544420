"""The whole battery: every case table in one list, ids unique."""

from __future__ import annotations

from . import (
    cases_api,
    cases_edits,
    cases_files,
    cases_inputs,
    cases_master,
    cases_scaler_state,
    cases_scaling,
)
from .battery import Case


def all_cases() -> list[Case]:
    cases = cases_scaling.cases() + cases_scaler_state.cases() + cases_api.cases() + cases_master.cases()
    cases += cases_edits.cases() + cases_inputs.cases() + cases_files.cases()
    ids = [case.id for case in cases]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise AssertionError(f"duplicate battery ids: {duplicates}")
    return cases
