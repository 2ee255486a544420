"""The one loader of mixprec's Triton kernel modules, and the checks every Triton path shares.

A kernel module (``lowbit/_triton_kernels.py``, ``optim/_triton_adam_kernels.py``) imports Triton at its
top, so it is loaded by :func:`kernels` on first launch, not imported with mixprec, which imports without
Triton. ``triton.jit`` reads ``TRITON_INTERPRET`` when it decorates a function, so each interpreter
setting gets its own copy of the module, registered in ``sys.modules`` under its name with
``_interpreted`` appended for the interpreted one: under ``TRITON_INTERPRET=1`` the kernels run on CPU
tensors, which is how the tests check them. A leaf (stdlib and torch only).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import torch

__all__ = ["device_of", "interpreting", "kernels", "triton_available"]


@functools.cache
def triton_available() -> bool:
    """Whether Triton can be imported (it ships with torch's CUDA builds)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton's CPU interpreter is asked for (``TRITON_INTERPRET=1``), read at each call."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def device_of(x: torch.Tensor) -> contextlib.AbstractContextManager:
    """The tensor's CUDA device made current (Triton launches on the current device); a CPU one: nothing."""
    return torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext()


@functools.cache
def kernels(path: Path, name: str, interpret: bool) -> ModuleType:
    """The kernel module at ``path`` (a ``.py`` file) as ``name``, loaded on first use, once per
    interpreter setting (``name + "_interpreted"`` under the interpreter), with ``TRITON_INTERPRET`` set
    to ``interpret`` while it loads and restored after."""
    name = name + ("_interpreted" if interpret else "")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    try:
        sys.modules[name] = module
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]  # no half-made module for the next load to find
        raise
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before
    return module
