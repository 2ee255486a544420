"""The contract every module swap keeps (``convert_to_lowbit_training``, ``convert_to_float8_training``,
``Plan.apply``): one filter check, one answer to a second conversion, and a word when nothing converts.

- ``module_filter_fn(module, fqn)`` must be callable with two arguments and return a ``bool``: a truthy
  string or ``None`` is a bug in the filter, refused with a ``TypeError`` (torchao's float8 refuses it too),
  never coerced with ``bool()``.
- A layer already converted by another config, recipe or API is refused with a ``ValueError`` naming the
  layers and both settings; the same setting again leaves it as it is (a second call is a no-op).
- A conversion that converts nothing warns, naming what it found instead.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from torch import nn

__all__ = [
    "ModuleFilter",
    "NonDynamicallyQuantizable",
    "check_filter",
    "converted_as",
    "filter_says",
    "is_conv1d",
    "is_converted",
    "refuse_reconversion",
    "register_converted",
    "warn_if_unconverted",
]

#: ``module_filter_fn(module, fqn) -> bool``: True converts the module (torchao's contract).
ModuleFilter = Callable[[nn.Module, str], bool]

# nn.MultiheadAttention's out_proj: attention reads its weight directly and never calls its forward, so
# there is nothing to convert and nothing to warn about.
NonDynamicallyQuantizable = nn.modules.linear.NonDynamicallyQuantizableLinear

# Converted module types -> a one-line description of a module's setting; each swap registers its own,
# so a swap recognises the others' layers without importing them (float8 imports lowbit, not back).
# Each describe takes modules of its own key class (converted_as checks isinstance before calling it).
_CONVERTED: dict[type[nn.Module], Callable[[Any], str]] = {}
_M = TypeVar("_M", bound=nn.Module)


def register_converted(cls: type[_M], describe: Callable[[_M], str]) -> None:
    """Make modules of ``cls`` count as converted, ``describe(module)`` naming their setting."""
    _CONVERTED[cls] = describe


def is_converted(module: nn.Module) -> bool:
    """Whether ``module`` is a layer some mixprec swap made."""
    return isinstance(module, tuple(_CONVERTED))


def converted_as(module: nn.Module) -> str:
    """The registered description of a converted ``module`` (its type and setting)."""
    for cls, describe in _CONVERTED.items():
        if isinstance(module, cls):
            return describe(module)
    raise TypeError(f"{type(module).__name__} is not a converted module")


def is_conv1d(module: nn.Module) -> bool:
    """``transformers.pytorch_utils.Conv1D`` (GPT-2's linear layers), recognised without importing it."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "weight")


def check_filter(module_filter_fn: object) -> None:
    """Refuse a filter that is not callable as ``(module, fqn)``.

    Raises:
        TypeError: naming the filter and, where Python can read it, its signature.
    """
    if module_filter_fn is None:
        return
    if not callable(module_filter_fn):
        raise TypeError(f"module_filter_fn must be callable (module, fqn) -> bool, got {module_filter_fn!r}")
    try:
        signature = inspect.signature(module_filter_fn)
    except (TypeError, ValueError):  # a builtin without a signature: it is called as is
        return
    try:
        signature.bind(nn.Identity(), "")
    except TypeError:
        raise TypeError(
            f"module_filter_fn must take two arguments (module, fqn) and return a bool; "
            f"{getattr(module_filter_fn, '__name__', module_filter_fn)!r} takes {signature}"
        ) from None


def filter_says(module_filter_fn: ModuleFilter | None, module: nn.Module, fqn: str) -> bool:
    """The filter's answer for one module (True without a filter).

    Raises:
        TypeError: when it returns anything but a ``bool`` (value, type and the module's fqn named).
    """
    if module_filter_fn is None:
        return True
    chosen = module_filter_fn(module, fqn)
    if not isinstance(chosen, bool):
        raise TypeError(
            f"module_filter_fn must return True or False, got {type(chosen).__name__} {chosen!r:.40} "
            f"for {fqn or 'the model itself'!r}; nothing was converted"
        )
    return chosen


def refuse_reconversion(conflicts: Iterable[tuple[str, str]], api: str, new: str) -> None:
    """Raise when a swap meets layers converted with another setting.

    Args:
        conflicts: ``(fqn, what the layer is now)`` for each layer the swap would change.
        api: the calling function's name, for the message.
        new: the setting the call asks for.

    Raises:
        ValueError: naming up to 8 of the layers, their settings and ``new``; nothing was converted then.
    """
    conflicts = list(conflicts)
    if not conflicts:
        return
    shown = ", ".join(f"{fqn or 'the model itself'!r} ({now})" for fqn, now in conflicts[:8])
    more = f" and {len(conflicts) - 8} more" if len(conflicts) > 8 else ""
    raise ValueError(
        f"{api}: {len(conflicts)} layer(s) are already converted with another setting: {shown}{more}; "
        f"this call asks for {new}. Nothing was converted: convert a fresh model (or the plain nn.Linear "
        "modules) with the setting you want, or call again with the setting they have (a no-op)"
    )


def warn_if_unconverted(api: str, converted: int, model: nn.Module, linear_maps: dict[str, str]) -> None:
    """Warn when a swap left layers that compute a linear map, or converted nothing.

    Args:
        api: the calling function's name.
        converted: how many modules it converted (or found already converted as asked).
        model: the model, for the message when there is nothing linear in it.
        linear_maps: ``fqn -> why it was kept`` for each module that computes a linear map but was not
            converted (a subclass of ``nn.Linear``, a ``Conv1D`` the swap cannot take, ...).
    """
    if linear_maps:
        warnings.warn(
            f"{api} kept layers that compute a linear map as they are: "
            + "; ".join(f"{fqn or 'the model itself'!r}: {why}" for fqn, why in linear_maps.items()),
            UserWarning,
            stacklevel=3,
        )
    elif converted == 0:
        warnings.warn(
            f"{api} converted nothing: {type(model).__name__} has no nn.Linear the filter accepts",
            UserWarning,
            stacklevel=3,
        )
