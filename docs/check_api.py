"""Fail when a public mixprec name has no entry in the built API reference.

Reads the ``objects.inv`` of a finished build (offline, with Sphinx's own inventory reader) and checks
every name in ``__all__`` of ``mixprec``, of each public subpackage or module below it that defines
``__all__`` and of each ``mixprec.integrations`` module: a name is covered when the inventory lists it,
or lists the same object under another public path (a re-export documented once, where it is defined
for users). Exit status 1 lists the missing names, so a new public name without a reference fails CI.

    python docs/check_api.py [docs/_build/html/objects.inv]
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_INVENTORY = ROOT / "docs" / "_build" / "html" / "objects.inv"
_MISSING = object()


def public_faces() -> list[ModuleType]:
    """``mixprec``, each public child with an ``__all__``, and each public ``mixprec.integrations`` module."""
    import mixprec
    import mixprec.integrations

    faces = [mixprec]
    for parent in (mixprec, mixprec.integrations):
        for info in pkgutil.iter_modules(parent.__path__, parent.__name__ + "."):
            if info.name.rsplit(".", 1)[1].startswith("_"):
                continue
            module = importlib.import_module(info.name)  # the integrations import their frameworks here
            if hasattr(module, "__all__") and module not in faces:
                faces.append(module)
    return faces


def read_inventory(path: Path) -> dict[str, str]:
    """Python-domain name -> role (``py:class``, ``py:module``, ...) of a built ``objects.inv``."""
    from sphinx.util.inventory import InventoryFile

    with path.open("rb") as stream:
        inventory = InventoryFile.load(stream, "", lambda base, uri: uri)
    return {name: role for role, entries in inventory.items() if role.startswith("py:") for name in entries}


def resolve(name: str, role: str) -> Any:
    """The object an inventory name documents, or ``_MISSING`` when it does not import."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        if role == "py:module" and cut < len(parts):
            return _MISSING
        for attr in parts[cut:]:
            obj = inspect_attr(obj, attr)
            if obj is _MISSING:
                return _MISSING
        return obj
    return _MISSING


def inspect_attr(obj: Any, attr: str) -> Any:
    # a class's own __dict__ first, so a property is the property, not its value
    if isinstance(obj, type) and attr in vars(obj):
        return vars(obj)[attr]
    return getattr(obj, attr, _MISSING)


def missing_names(inventory: dict[str, str], faces: list[ModuleType]) -> tuple[list[str], int]:
    documented = {
        id(obj): obj
        for name, role in inventory.items()
        if name.startswith("mixprec")
        for obj in [resolve(name, role)]
        if obj is not _MISSING
    }
    missing, checked = [], 0
    for face in faces:
        if inventory.get(face.__name__) != "py:module":
            missing.append(f"{face.__name__} (the module itself)")
        for attr in face.__all__:
            checked += 1
            full = f"{face.__name__}.{attr}"
            obj = getattr(face, attr)
            if full in inventory:
                continue
            # an immutable scalar (a str such as lowbit.HP) is identified by its name only: another
            # constant may be the very same interned object
            by_identity = not isinstance(obj, (str, bytes, int, float, bool, type(None)))
            if not (by_identity and id(obj) in documented):
                missing.append(full)
    return missing, checked


def main(argv: list[str]) -> int:
    path = Path(argv[0]) if argv else DEFAULT_INVENTORY
    if not path.is_file():
        print(
            f"no inventory at {path}: build the docs first (python -m sphinx -b html docs docs/_build/html)"
        )
        return 2
    sys.path.insert(0, str(ROOT / "src"))
    faces = public_faces()
    missing, checked = missing_names(read_inventory(path), faces)
    if missing:
        print(f"{len(missing)} public names have no API reference entry (add them to docs/api/*.rst):")
        for name in missing:
            print(f"  {name}")
        return 1
    print(f"API reference complete: {checked} public names in {len(faces)} modules, all in {path.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
