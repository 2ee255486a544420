"""Deprecated: ``mixprec.master`` split into :mod:`mixprec.optim` (the optimizer wrappers) and
:mod:`mixprec.amp` (O0-O3, presets and the model cast).

Every old path stays importable for one release and warns with its new location: ``mixprec.master.<name>``
for the names this package exported, and each old submodule (``mixprec.master.compensated``, ``.optimizer``,
``.recipes``, ...), which is the moved module itself. The submodules resolve through a finder rather than
files at the old paths, so that edits made elsewhere to the old files still merge into the moved ones by
rename detection.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType
from typing import Any

__all__: list[str] = []  # the moved names resolve through __getattr__, with the warning

MOVED_MODULES = {
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
MOVED_NAMES = {
    "LOW_PRECISION_DTYPES": "mixprec.optim",
    "MixedPrecisionOptimizer": "mixprec.optim",
    "OptimizerWrapper": "mixprec.optim",
    "resolve_scaler": "mixprec.optim",
}


def _warn(old: str, new: str) -> None:
    warnings.warn(
        f"{old} moved to {new}; import it from there (this alias goes in the next release)",
        DeprecationWarning,
        stacklevel=3,
    )


def __getattr__(name: str) -> Any:
    if name in MOVED_NAMES:
        _warn(f"{__name__}.{name}", f"{MOVED_NAMES[name]}.{name}")
        return getattr(importlib.import_module(MOVED_NAMES[name]), name)
    if name in MOVED_MODULES:  # ``from mixprec.master import compensated``, ``mixprec.master.compensated``
        _warn(f"{__name__}.{name}", MOVED_MODULES[name])
        return importlib.import_module(MOVED_MODULES[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _MovedModule(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``mixprec.master.<old>`` and loads it as the module it moved to, after the warning."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        package, _, name = fullname.rpartition(".")
        if package != __name__ or name not in MOVED_MODULES:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = MOVED_MODULES[spec.name.rpartition(".")[2]]
        warnings.warn(
            f"{spec.name} moved to {new}; import it from there (this alias goes in the next release)",
            DeprecationWarning,
            stacklevel=2,
        )
        module = importlib.import_module(new)
        spec.loader_state = (
            module.__spec__
        )  # the import system overwrites ``__spec__``; exec_module puts it back
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: only the moved module's own spec goes back, so that it still names itself."""
        assert module.__spec__ is not None
        module.__spec__ = module.__spec__.loader_state


if not any(type(finder).__qualname__ == "_MovedModule" for finder in sys.meta_path):  # once, even if reloaded
    sys.meta_path.append(_MovedModule())
