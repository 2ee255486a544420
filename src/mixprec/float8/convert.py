"""`convert_to_float8_training`: swap a model's ``nn.Linear`` modules for :class:`Float8Linear` in place."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from torch import nn

from mixprec.float8.config import Float8Config
from mixprec.float8.linear import Float8Linear, _check_config

__all__ = ["ModuleFilter", "convert_to_float8_training", "float8_linears", "skip_fqns"]

#: ``module_filter_fn(module, fqn) -> bool``: True converts the module (torchao's contract).
ModuleFilter = Callable[[nn.Module, str], bool]


def convert_to_float8_training(
    model: nn.Module, *, config: Float8Config | None = None, module_filter_fn: ModuleFilter | None = None
) -> nn.Module:
    """Swap every ``nn.Linear`` of ``model`` (itself included) for a :class:`Float8Linear`, in place.

    The same name and filter contract as ``torchao.float8.convert_to_float8_training``, so code can
    switch between them. The new modules share the old ones' parameter objects, so an optimizer built
    before conversion keeps working; ``state_dict`` keys stay the same (delayed scaling adds
    ``<fqn>.amax_history``). Modules that already are :class:`Float8Linear` are left alone.

    Args:
        model: the model to convert.
        config: the scaling recipe, a :class:`Float8Config` (default: dynamic).
        module_filter_fn: ``(module, fqn) -> bool``, called for each ``nn.Linear`` with its qualified name
            (``""`` for ``model`` itself); False keeps that module as it is (e.g. in bf16 under autocast).
            Default: convert all.

    Returns:
        ``model`` (or a new :class:`Float8Linear` when ``model`` itself is an ``nn.Linear``).

    Raises:
        TypeError: if ``model`` is not an ``nn.Module``, ``config`` not a :class:`Float8Config` or
            ``module_filter_fn`` not callable; nothing is converted then.
        ValueError: if ``model`` is an ``nn.Linear`` with child modules (they would be dropped).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    config = _check_config(config)
    if module_filter_fn is not None and not callable(module_filter_fn):
        raise TypeError(f"module_filter_fn must be callable (module, fqn) -> bool, got {module_filter_fn!r}")
    if _wanted(model, "", module_filter_fn):
        children = [name for name, _ in model.named_children()]
        if children:  # torchao refuses these too: the swapped module would lose them
            raise ValueError(f"cannot convert a root {type(model).__name__} with child modules {children}")
        return Float8Linear.from_linear(model, config)
    swaps = [
        (fqn, module)
        for fqn, module in model.named_modules(remove_duplicate=False)
        if fqn and _wanted(module, fqn, module_filter_fn)
    ]
    replacements: dict[int, Float8Linear] = {}
    for fqn, module in swaps:  # a module shared by several parents is swapped once, everywhere
        new = replacements.setdefault(id(module), Float8Linear.from_linear(module, config))
        parent_name, _, child = fqn.rpartition(".")
        setattr(model.get_submodule(parent_name), child, new)
    return model


def _wanted(module: nn.Module, fqn: str, module_filter_fn: ModuleFilter | None) -> bool:
    if not isinstance(module, nn.Linear) or isinstance(module, Float8Linear):
        return False
    return module_filter_fn is None or bool(module_filter_fn(module, fqn))


def float8_linears(model: nn.Module) -> list[tuple[str, Float8Linear]]:
    """``(fqn, module)`` for each :class:`Float8Linear` in ``model``, in ``named_modules`` order."""
    return [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, Float8Linear)]


def skip_fqns(fqns: Iterable[str]) -> ModuleFilter:
    """A ``module_filter_fn`` that keeps the modules named in ``fqns`` out of fp8 and converts the rest.

    Raises:
        TypeError: if ``fqns`` is a single string (pass a list) or holds a non-string.
    """
    if isinstance(fqns, str):
        raise TypeError(f"fqns must be an iterable of module names, not one string: {fqns!r}")
    names = frozenset(fqns)
    bad = [n for n in names if not isinstance(n, str)]
    if bad:
        raise TypeError(f"fqns must hold module names (str), got {bad[0]!r}")

    def module_filter_fn(module: nn.Module, fqn: str) -> bool:
        return fqn not in names

    module_filter_fn.skipped = names  # type: ignore[attr-defined]
    return module_filter_fn
