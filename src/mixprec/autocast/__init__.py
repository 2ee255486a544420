"""The autocast engine: :class:`autocast` (a torch.autocast region driven by a Policy), its queries,
``custom_fwd``/``custom_bwd`` and :func:`mixprec.checkpoint`.

Files: ``region.py`` (the public region), ``engine.py`` (per-thread state, the deviation mode),
``pins.py`` (module pins, and ``pins.HOOKS``, the owner of the engine's only process-wide state),
``custom_function.py``, ``checkpoint.py``.
"""

from mixprec.autocast.region import autocast, get_autocast_dtype, is_autocast_enabled

__all__ = ["autocast", "get_autocast_dtype", "is_autocast_enabled"]
