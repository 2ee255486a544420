"""The one module swap (:func:`swap_linears`, behind ``convert_to_lowbit_training`` and
``convert_to_float8_training``) and the contract every swap keeps (``Plan.apply`` too): one filter
check, one answer to a second conversion, and a word when nothing converts.

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
    "swap_linears",
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


def warn_if_unconverted(
    api: str, converted: int, model: nn.Module, linear_maps: dict[str, str], stacklevel: int = 3
) -> None:
    """Warn when a swap left layers that compute a linear map, or converted nothing.

    Args:
        api: the calling function's name.
        converted: how many modules it converted (or found already converted as asked).
        model: the model, for the message when there is nothing linear in it.
        linear_maps: ``fqn -> why it was kept`` for each module that computes a linear map but was not
            converted (a subclass of ``nn.Linear``, a ``Conv1D`` the swap cannot take, ...).
        stacklevel: ``warnings.warn``'s, so the warning points at the user's call.
    """
    if linear_maps:
        warnings.warn(
            f"{api} kept layers that compute a linear map as they are: "
            + "; ".join(f"{fqn or 'the model itself'!r}: {why}" for fqn, why in linear_maps.items()),
            UserWarning,
            stacklevel=stacklevel,
        )
    elif converted == 0:
        warnings.warn(
            f"{api} converted nothing: {type(model).__name__} has no nn.Linear the filter accepts",
            UserWarning,
            stacklevel=stacklevel,
        )


def swap_linears(
    model: nn.Module,
    api: str,
    setting: str,
    *,
    module_filter_fn: ModuleFilter | None,
    own: tuple[type[nn.Module], ...],
    same: Callable[[Any], bool],
    kept_because: Callable[[nn.Module], str | None],
    make: Callable[[nn.Module], nn.Module],
    check: Callable[[list[tuple[str, nn.Module]]], None] | None = None,
    prepare: Callable[[nn.Module], None] | None = None,
    root_error: type[Exception] = ValueError,
) -> nn.Module:
    """Swap, in place, each linear layer of ``model`` (itself included) the filter accepts for ``make(it)``.

    The candidates are ``nn.Linear`` modules (not attention's ``out_proj``), ``transformers`` ``Conv1D``
    modules and layers some swap already converted; the filter is asked about each (with its qualified name,
    ``""`` for ``model`` itself). Everything is checked before anything changes, in this order: layers of
    ``own`` type that are not ``same`` and layers converted by another swap are refused
    (:func:`refuse_reconversion`), then ``check(wanted)`` runs. A module shared by several parents is
    swapped once, everywhere.

    Args:
        model: the model to convert.
        api, setting: the caller's name and the setting it asks for, for messages.
        module_filter_fn: ``(module, fqn) -> bool`` (see :func:`check_filter`), or None for all.
        own: the caller's converted types; one of them that is ``same(module)`` is left as it is (a second
            call is a no-op).
        same: whether a module of ``own`` type already has the asked setting.
        kept_because: why a candidate is kept as it is (a string for the warning), or None to convert it.
        make: the new module for a candidate, sharing its parameter objects.
        check: called with the ``(fqn, module)`` list to convert, to refuse it before any swap.
        prepare: called with ``model`` just before the swaps (not when ``model`` itself is the one swapped).
        root_error: the error for a root ``nn.Linear`` with child modules (they would be dropped).

    Returns:
        ``model``, or ``make(model)`` when ``model`` itself is the one layer to convert.

    Raises:
        TypeError: for a filter that is not callable as ``(module, fqn)`` or returns a non-bool.
        ValueError: for a layer converted with another setting (layers and both settings named).
        root_error: for a root ``nn.Linear`` with children. Nothing is converted when it raises.

    Warns:
        UserWarning: naming the linear layers kept as they are, or saying that nothing was converted.
    """
    check_filter(module_filter_fn)
    wanted: list[tuple[str, nn.Module]] = []
    conflicts: list[tuple[str, str]] = []
    kept: dict[str, str] = {}
    same_count = 0
    for fqn, module in model.named_modules(remove_duplicate=False):
        linear = isinstance(module, nn.Linear) and not isinstance(module, NonDynamicallyQuantizable)
        if not (linear or is_conv1d(module) or is_converted(module)):
            continue
        if not filter_says(module_filter_fn, module, fqn):
            continue
        if isinstance(module, own) and same(module):
            same_count += 1
        elif is_converted(module):
            conflicts.append((fqn, converted_as(module)))
        elif (why := kept_because(module)) is not None:
            kept[fqn] = why
        else:
            wanted.append((fqn, module))
    refuse_reconversion(conflicts, api, setting)
    if check is not None:
        check(wanted)
    if wanted and wanted[0][0] == "":
        children = [name for name, _ in model.named_children()]
        if children:  # torchao refuses these too: the swapped module would lose them
            raise root_error(
                f"Does not support a root nn.Linear with children: cannot convert a root "
                f"{type(model).__name__} with child modules {children} (they would be dropped)"
            )
        return make(model)
    warn_if_unconverted(api, len(wanted) + same_count, model, kept, stacklevel=4)
    if prepare is not None:
        prepare(model)
    replacements: dict[int, nn.Module] = {}
    for fqn, module in wanted:
        new = replacements.setdefault(id(module), make(module))
        parent_name, _, child = fqn.rpartition(".")
        setattr(model.get_submodule(parent_name), child, new)
    return model
