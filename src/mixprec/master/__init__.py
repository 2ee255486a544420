"""Deprecated: ``mixprec.master`` split into :mod:`mixprec.optim` (the optimizer wrappers) and
:mod:`mixprec.amp` (O0-O3, presets and the model cast).

Every old path stays importable for one release and warns with its new location: ``mixprec.master.<name>``
for the names this package exported, and each old submodule (``mixprec.master.compensated``, ``.optimizer``,
``.recipes``, ...), which is the moved module itself. The submodules resolve through
``mixprec._moved``'s finder rather than files at the old paths, so that edits made elsewhere to the old
files still merge into the moved ones by rename detection.
"""

from __future__ import annotations

from mixprec._moved import install

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


__getattr__ = install(__name__, MOVED_MODULES, MOVED_NAMES)
