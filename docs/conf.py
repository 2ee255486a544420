"""Sphinx configuration for mixprec's documentation site (built offline, warnings are errors in CI)."""

from __future__ import annotations

import os
import re
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
autodoc_typehints = "signature"  # "description" reads a class's hints unevaluated
autodoc_default_options: dict[str, object] = {}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

# No intersphinx (the build runs without a network), so references into these packages cannot resolve;
# each pattern names a package other than mixprec, so a broken reference to a mixprec name still fails.
_EXTERNAL = (
    r"(torch|torchao|numpy|np|lightning|pytorch_lightning|transformers|accelerate|optimi|matplotlib"
    r"|sklearn|tqdm|collections|typing|typing_extensions|abc|contextlib|enum|dataclasses|pathlib|os|io"
    r"|json|types|builtins|threading|concurrent|argparse|logging|weakref|functools|dist|nn)"
)
nitpick_ignore_regex = [
    (r"py:.*", _EXTERNAL + r"(\..*)?"),
]
# torch's nn.Module.forward docstring, which a forward without its own inherits, says :class:`Module`
nitpick_ignore = [
    ("py:class", "Module"),
    # The return type of ``scaler_guard()``, the hook one optimizer wrapper asks another; not public API.
    ("py:class", "mixprec.optim.guard.HugeGradientGuard"),
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


_RAW: dict[str, list[str]] = {}


def _keep_raw(app, what, name, obj, options, lines) -> None:
    if what in ("attribute", "property", "data"):
        _RAW[name] = list(lines)


def _restore_raw(app, what, name, obj, options, lines) -> None:
    """An attribute's "The exponent bias: ..." is prose; napoleon would read the text before the colon as
    its type, so attributes, properties and data keep the docstring as written (they hold no sections)."""
    if name in _RAW:
        lines[:] = _RAW.pop(name)


def _class_defaults(app, what, name, obj, options, signature, return_annotation):
    """Defaults printed as ``<class 'a.B'>`` or a dataclass's ``<factory>`` are not Python, and the
    signature parser would then split the annotations at every comma; write them as Python."""
    if signature:
        signature = re.sub(r"<class '([\w.]+)'>", r"\1", signature)
        signature = signature.replace("<factory>", "field(default_factory=...)")
    return signature, return_annotation


def setup(app) -> None:
    app.connect("autodoc-process-signature", _class_defaults)
    # napoleon runs at priority 500: the constant's text is found before it and kept from it
    app.connect("autodoc-process-docstring", _data_doc, priority=400)
    app.connect("autodoc-process-docstring", _keep_raw, priority=450)
    app.connect("autodoc-process-docstring", _restore_raw, priority=550)
