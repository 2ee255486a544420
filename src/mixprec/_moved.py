"""Names and modules that moved, still importable from their old place for one release, with a warning.

A package lists what moved out of it (``old submodule -> new module``, ``old name -> new module``) and calls
:func:`install`; its module ``__getattr__`` then returns a moved name (``from mixprec.inspect import
plan_precision``) and ``import mixprec.inspect.plan_cost`` gives the new module, each with a
``DeprecationWarning`` naming the new place. The new modules are imported only when an old name is used,
so the old package does not import the new one (the import graph keeps its direction).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any


def _warn(old: str, new: str) -> None:
    warnings.warn(
        f"{old} moved to {new}; the old name is deprecated and will be removed in the next release",
        DeprecationWarning,
        stacklevel=3,
    )


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old module name and loads the new module in its place (the same module object)."""

    def __init__(self, modules: Mapping[str, str]) -> None:
        self.modules = dict(modules)

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.modules:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        _warn(spec.name, self.modules[spec.name])
        module = importlib.import_module(self.modules[spec.name])
        spec.loader_state = module.__spec__  # the import system overwrites ``__spec__``; put back below
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run (the new module ran when it was imported): only its own spec goes back, so that
        it still names itself."""
        assert module.__spec__ is not None
        module.__spec__ = module.__spec__.loader_state


def install(package: str, modules: Mapping[str, str], names: Mapping[str, str]) -> Callable[[str], Any]:
    """Make ``package.<old>`` importable for each of ``modules`` (old submodule -> new module) and return the
    ``__getattr__`` that serves ``names`` (old attribute -> module now holding it) and those submodules."""
    full = {f"{package}.{old}": new for old, new in modules.items()}
    if not any(isinstance(f, _MovedModules) and f.modules == full for f in sys.meta_path):
        sys.meta_path.append(_MovedModules(full))

    def __getattr__(name: str) -> Any:
        if name in names:
            _warn(f"{package}.{name}", f"{names[name]}.{name}")
            value = getattr(importlib.import_module(names[name]), name)
            setattr(sys.modules[package], name, value)  # warned once: ``from x import y`` looks twice
            return value
        if name in modules:
            return importlib.import_module(f"{package}.{name}")  # warns in the finder
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
