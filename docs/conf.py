"""Sphinx configuration for mixprec's documentation site (built offline, warnings are errors in CI)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # document the working tree, not an installed copy
os.environ.setdefault("MPLBACKEND", "Agg")

import mixprec  # noqa: E402

project = "mixprec"
author = "mixprec contributors"
copyright = "mixprec contributors"
release = version = mixprec.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "README.md"]
html_theme = "furo"
html_title = f"mixprec {release}"
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3

# Broken references fail the build; only names from other packages are let through (below).
nitpicky = True
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": False, "show-inheritance": False}
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

# No intersphinx (the build runs without a network), so references into these packages cannot resolve;
# each pattern names a package other than mixprec, so a broken reference to a mixprec name still fails.
_EXTERNAL = (
    r"(torch|torchao|numpy|np|lightning|pytorch_lightning|transformers|accelerate|optimi|matplotlib"
    r"|sklearn|tqdm|collections|typing|typing_extensions|abc|contextlib|enum|dataclasses|pathlib|os|io"
    r"|json|types|builtins|threading|concurrent|argparse|logging|weakref|functools)"
)
nitpick_ignore_regex = [
    (r"py:.*", _EXTERNAL + r"(\..*)?"),
    # builtins and typing names that annotations render bare
    (
        r"py:.*",
        r"(None|int|float|str|bool|bytes|dict|list|tuple|set|frozenset|object|type|complex|slice|range"
        r"|Any|Callable|Iterable|Iterator|Sequence|Mapping|MutableMapping|Generator|Literal|Optional|Union"
        r"|Self|TypeAlias|ClassVar|Final|Protocol|NamedTuple|TypeVar|ParamSpec|Concatenate"
        r"|Exception|ValueError|TypeError|RuntimeError|KeyError|IndexError|NotImplementedError|OSError"
        r"|FileNotFoundError|AttributeError|UserWarning|Warning|RuntimeWarning|DeprecationWarning"
        r"|ArithmeticError|LookupError|StopIteration|ImportError|ModuleNotFoundError|AssertionError"
        r"|ellipsis|NoneType|PathLike|Path|Tensor|dtype|device|nn\.Module|Module|Parameter|Optimizer)",
    ),
]


def _data_doc(app, what, name, obj, options, lines) -> None:
    """A constant re-exported by a package face gets the ``#:`` comment where it is defined.

    autodoc reads ``#:`` comments only in the module named in the directive, and otherwise shows the
    docstring of the value's type (``dict``'s); look the value up in the mixprec module that binds it.
    """
    if what != "data":
        return
    from sphinx.pycode import ModuleAnalyzer

    for modname, module in sorted(sys.modules.items()):
        if not modname.startswith("mixprec") or module is None:
            continue
        for attr, value in vars(module).items():
            if value is not obj or attr != name.rsplit(".", 1)[1]:
                continue
            try:
                doc = ModuleAnalyzer.for_module(modname).find_attr_docs().get(("", attr))
            except Exception:  # a module without source (none today): fall through
                doc = None
            if doc:
                lines[:] = list(doc)
                return
    type_doc = type(obj).__doc__ or ""
    if lines and "\n".join(lines).strip() == type_doc.strip().expandtabs():
        lines[:] = []  # never show dict's or tuple's docstring as the constant's


def setup(app) -> None:
    app.connect("autodoc-process-docstring", _data_doc, priority=400)
