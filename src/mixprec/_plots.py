"""The one figure helper: a matplotlib ``Figure`` through its object API, saved as a PNG complete or absent.

matplotlib is imported when a figure is made, never at import time, and only as ``Figure`` +
``FigureCanvasAgg``: no pyplot, no global figure state, no display needed. A leaf (besides ``_files``), so
that bench's and inspect's pictures share it without importing each other.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from mixprec._files import write_atomic

__all__ = ["new_figure", "save_png"]


def new_figure(**kwargs: Any) -> Any:
    """``matplotlib.figure.Figure(**kwargs)``.

    Raises:
        ImportError: when matplotlib is missing, naming the extra that installs it.
    """
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError("mixprec's plots need matplotlib: pip install 'mixprec[plot]'") from exc
    return Figure(**kwargs)


def save_png(
    fig: Any, path: str | Path, rect: tuple[float, float, float, float] = (0.0, 0.0, 1.0, 1.0)
) -> Path:
    """Lay ``fig`` out within ``rect`` (figure fractions: left, bottom, right, top) and write it to ``path``
    as a PNG, creating the folder; the file is complete or absent (see :mod:`mixprec._files`)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout(rect=rect)
    buffer = io.BytesIO()
    FigureCanvasAgg(fig).print_png(buffer)
    return write_atomic(path, buffer.getvalue())
