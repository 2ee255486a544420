"""`convert_to_lowbit_training`: swap a model's ``nn.Linear`` modules for :class:`LowbitLinear` in place."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from mixprec.lowbit.linear import LowbitLinear, _check
from mixprec.lowbit.recipes import Recipe

__all__ = ["ModuleFilter", "convert_to_lowbit_training", "lowbit_linears"]

#: ``module_filter_fn(module, fqn) -> bool``: True converts the module (torchao's contract).
ModuleFilter = Callable[[nn.Module, str], bool]


def convert_to_lowbit_training(
    model: nn.Module,
    recipe: Recipe | str,
    *,
    module_filter_fn: ModuleFilter | None = None,
    linear_types: tuple[type[nn.Module], ...] = (nn.Linear,),
    generator: torch.Generator | None = None,
) -> nn.Module:
    """Swap each exact ``nn.Linear`` of ``model`` (itself included) for a :class:`LowbitLinear`, in place.

    torchao's ``convert_to_float8_training`` contract: ``module_filter_fn(module, fqn) -> bool`` is called
    for each candidate with its qualified name (``""`` for ``model`` itself) and False keeps it as it is.
    Only modules whose type is exactly one of ``linear_types`` are candidates (a subclass of ``nn.Linear``
    may change what forward does, so it is converted only when named there). The new modules share the old
    ones' parameters, so an optimizer built before keeps working and ``state_dict`` keys are unchanged: a
    converted checkpoint loads into the plain model and back.

    Args:
        model: the model to convert.
        recipe: a :class:`Recipe` or recipe string (``"fp8_rowwise"``, ``"mxfp8"``, ``"nvfp4 rht=off"``, ...).
        module_filter_fn: see above (default: convert all).
        linear_types: the exact module types to convert, each a subclass of ``nn.Linear``.
        generator: the ``torch.Generator`` stochastic rounding draws from (shared by the converted modules).

    Returns:
        ``model``, or a new :class:`LowbitLinear` when ``model`` itself is converted.

    Raises:
        TypeError: for a non-module ``model``, a non-callable filter, a bad recipe or generator, or a
            ``linear_types`` entry that is not an ``nn.Linear`` subclass.
        ValueError: for an unknown recipe, or a root ``nn.Linear`` with child modules (they would be lost).
        Nothing is converted when it raises.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    recipe, generator = _check(recipe, generator)
    if module_filter_fn is not None and not callable(module_filter_fn):
        raise TypeError(f"module_filter_fn must be callable (module, fqn) -> bool, got {module_filter_fn!r}")
    if not isinstance(linear_types, tuple) or not all(
        isinstance(t, type) and issubclass(t, nn.Linear) for t in linear_types
    ):
        raise TypeError(f"linear_types must be a tuple of nn.Linear subclasses, got {linear_types!r}")
    wanted = [
        (fqn, m)
        for fqn, m in model.named_modules(remove_duplicate=False)
        if type(m) in linear_types and (module_filter_fn is None or bool(module_filter_fn(m, fqn)))
    ]
    if wanted and wanted[0][0] == "":
        children = [name for name, _ in model.named_children()]
        if children:
            raise ValueError(f"cannot convert a root {type(model).__name__} with child modules {children}")
        return LowbitLinear.from_linear(model, recipe, generator)
    replacements: dict[int, LowbitLinear] = {}
    for fqn, module in wanted:  # a module shared by several parents is swapped once, everywhere
        new = replacements.setdefault(id(module), LowbitLinear.from_linear(module, recipe, generator))
        parent_name, _, child = fqn.rpartition(".")
        setattr(model.get_submodule(parent_name), child, new)
    return model


def lowbit_linears(model: nn.Module) -> list[tuple[str, LowbitLinear]]:
    """``(fqn, module)`` for each :class:`LowbitLinear` in ``model``, in ``named_modules`` order."""
    return [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, LowbitLinear)]
