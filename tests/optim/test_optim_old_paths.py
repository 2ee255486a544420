"""Every ``mixprec.master`` path of the last release still imports, as the moved object, with a warning."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys

import pytest

import mixprec
import mixprec.master

# where each old submodule went (written out here, not read from the alias, so that a wrong entry fails)
MOVED = {
    "casting": "mixprec.amp.casting",
    "compensated": "mixprec.optim.compensated",
    "fused_adam": "mixprec.optim.fused_adam",
    "guard": "mixprec.optim.guard",
    "lowbit_adam": "mixprec.optim.lowbit_adam",
    "lowp": "mixprec.optim.rounding",
    "optimizer": "mixprec.optim.masters",
    "recipes": "mixprec.amp.levels",
    "state": "mixprec.optim.state",
    "state_formats": "mixprec.optim.state_formats",
    "updates": "mixprec.optim.updates",
    "wrapper": "mixprec.optim.wrapper",
}


def _forget(monkeypatch: pytest.MonkeyPatch, old: str) -> None:
    """Make the next import of the old path a first one (restored after the test)."""
    monkeypatch.delitem(sys.modules, f"mixprec.master.{old}", raising=False)
    if old in vars(mixprec.master):  # hasattr would ask the alias, which warns
        monkeypatch.delattr(mixprec.master, old)


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_submodule_is_the_moved_module_and_warns(old: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _forget(monkeypatch, old)
    with pytest.warns(DeprecationWarning, match=re.escape(f"mixprec.master.{old} moved to {MOVED[old]};")):
        module = importlib.import_module(f"mixprec.master.{old}")
    assert module is importlib.import_module(MOVED[old])
    assert module.__name__ == MOVED[old] and module.__spec__.name == MOVED[old]  # it still names itself


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_submodule_as_an_attribute_warns(old: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _forget(monkeypatch, old)
    with pytest.warns(DeprecationWarning, match=re.escape(f"mixprec.master.{old} moved to {MOVED[old]};")):
        module = getattr(mixprec.master, old)
    assert module is importlib.import_module(MOVED[old])


def test_old_from_imports_give_the_public_objects(monkeypatch: pytest.MonkeyPatch) -> None:
    for old in ("recipes", "compensated", "optimizer"):
        _forget(monkeypatch, old)
    with pytest.warns(DeprecationWarning) as record:
        from mixprec.master.compensated import CompensatedOptimizer
        from mixprec.master.optimizer import MixedPrecisionOptimizer as FromOptimizer
        from mixprec.master.recipes import OPT_LEVELS, initialize

        from mixprec.master import MixedPrecisionOptimizer, resolve_scaler
    assert MixedPrecisionOptimizer is FromOptimizer is mixprec.MixedPrecisionOptimizer
    assert CompensatedOptimizer is mixprec.CompensatedOptimizer
    assert initialize is mixprec.initialize and OPT_LEVELS is mixprec.OPT_LEVELS
    assert resolve_scaler is mixprec.optim.resolve_scaler
    messages = {str(w.message).split(";")[0] for w in record}
    assert messages == {
        "mixprec.master.MixedPrecisionOptimizer moved to mixprec.optim.MixedPrecisionOptimizer",
        "mixprec.master.resolve_scaler moved to mixprec.optim.resolve_scaler",
        "mixprec.master.compensated moved to mixprec.optim.compensated",
        "mixprec.master.optimizer moved to mixprec.optim.masters",
        "mixprec.master.recipes moved to mixprec.amp.levels",
    }
    assert {w.filename for w in record} == {__file__}  # each warning points at the import that made it


def test_unknown_old_names_fail_as_usual() -> None:
    with pytest.raises(AttributeError, match="'mixprec.master' has no attribute 'initialize'"):
        mixprec.master.initialize  # noqa: B018 (never exported by mixprec.master)
    with pytest.raises(ModuleNotFoundError, match="mixprec.master.levels"):
        importlib.import_module("mixprec.master.levels")


def test_mixprec_itself_uses_no_old_path() -> None:
    code = "import mixprec, mixprec.apex, mixprec.optim, mixprec.amp, mixprec.integrations._common"
    result = subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", "-c", code], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
