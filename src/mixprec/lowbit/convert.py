"""`convert_to_lowbit_training`: swap a model's ``nn.Linear`` modules for :class:`LowbitLinear` in place."""

from __future__ import annotations

import torch
from torch import nn

from mixprec.lowbit.linear import LowbitConv1D, LowbitLinear, _check, check_generator_device
from mixprec.lowbit.recipes import Recipe
from mixprec.lowbit.swap import ModuleFilter, is_conv1d, swap_linears

__all__ = [
    "ModuleFilter",
    "convert_to_lowbit_training",
    "load_sr_state_dict",
    "lowbit_linears",
    "sr_state_dict",
]


def convert_to_lowbit_training(
    model: nn.Module,
    recipe: Recipe | str,
    *,
    module_filter_fn: ModuleFilter | None = None,
    linear_types: tuple[type[nn.Module], ...] = (nn.Linear,),
    generator: torch.Generator | None = None,
) -> nn.Module:
    """Swap each exact ``nn.Linear`` of ``model`` (itself included) for a :class:`LowbitLinear`, and each
    ``transformers`` ``Conv1D`` (GPT-2's linear layers) for a :class:`LowbitConv1D`, in place.

    torchao's ``convert_to_float8_training`` contract: ``module_filter_fn(module, fqn) -> bool`` is called
    for each candidate with its qualified name (``""`` for ``model`` itself) and False keeps it as it is.
    Only modules whose type is exactly one of ``linear_types`` are candidates (a subclass of ``nn.Linear``
    may change what forward does, so it is converted only when named there). The new modules share the old
    ones' parameters, so an optimizer built before keeps working and ``state_dict`` keys are unchanged: a
    converted checkpoint loads into the plain model and back. A ``Conv1D`` keeps its (in, out) weight
    Parameter and runs the GEMMs over ``weight.t()`` (its numerics are those of a LowbitLinear of that
    weight); to keep Conv1D layers in high precision, return False for them from ``module_filter_fn``
    (``type(module).__name__ == "Conv1D"``).

    Args:
        model: the model to convert.
        recipe: a :class:`Recipe` or recipe string (``"fp8_rowwise"``, ``"mxfp8"``, ``"nvfp4 rht=off"``, ...).
        module_filter_fn: see above (default: convert all).
        linear_types: the exact module types to convert, each a subclass of ``nn.Linear``.
        generator: the ``torch.Generator`` stochastic rounding draws from (shared by the converted modules),
            on their weights' device.

    Returns:
        ``model``, or a new :class:`LowbitLinear` / :class:`LowbitConv1D` when ``model`` itself is converted.

    Raises:
        TypeError: for a non-module ``model``, a non-callable filter, a bad recipe or generator, or a
            ``linear_types`` entry that is not an ``nn.Linear`` subclass.
        TypeError: for a ``module_filter_fn`` that returns anything but a ``bool`` (as float8's swap).
        ValueError: for an unknown recipe, a root ``nn.Linear`` with child modules (they would be lost), a
            ``generator`` on another device than a module to convert (both devices and its fqn named), or a
            layer the filter accepts that is already converted with another recipe, by
            :func:`mixprec.float8.convert_to_float8_training` or by a plan (layers and settings named;
            a :class:`LowbitLinear` of this same recipe is left as it is: converting twice is a no-op).
            Nothing is converted when it raises.

    Warns:
        UserWarning: naming the layers that compute a linear map but were kept as they are (subclasses
            of ``nn.Linear`` not in ``linear_types``), or saying that nothing was converted.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    recipe, generator = _check(recipe, generator)
    if not isinstance(linear_types, tuple) or not all(
        isinstance(t, type) and issubclass(t, nn.Linear) for t in linear_types
    ):
        raise TypeError(f"linear_types must be a tuple of nn.Linear subclasses, got {linear_types!r}")

    def kept_because(module: nn.Module) -> str | None:
        if type(module) in linear_types or is_conv1d(module):
            return None
        return f"{type(module).__name__} is a subclass of nn.Linear (name it in linear_types to convert)"

    def check(wanted: list[tuple[str, nn.Module]]) -> None:
        if generator is None:
            return
        for fqn, module in wanted:
            weight = module.weight
            assert isinstance(weight, torch.Tensor), "swap_linears collects only layers with a weight"
            check_generator_device(generator, weight.device, f"the weight of {fqn or 'the model'!r}")

    return swap_linears(
        model,
        "convert_to_lowbit_training",
        f"recipe {recipe}",
        module_filter_fn=module_filter_fn,
        own=(LowbitLinear, LowbitConv1D),
        same=lambda module: module.recipe == recipe,
        kept_because=kept_because,
        make=lambda module: _lowbit_module(module, recipe, generator),
        check=check,
    )


def _lowbit_module(module: nn.Module, recipe: Recipe, generator: torch.Generator | None) -> nn.Module:
    """The low-bit layer replacing ``module``: a ``Conv1D`` keeps its (in, out) weight Parameter."""
    if is_conv1d(module):
        return LowbitConv1D(module, recipe, generator)
    assert isinstance(module, nn.Linear), "the swap collects only Conv1D and nn.Linear modules"
    return LowbitLinear.from_linear(module, recipe, generator)


def lowbit_linears(model: nn.Module) -> list[tuple[str, LowbitLinear | LowbitConv1D]]:
    """``(fqn, module)`` for each :class:`LowbitLinear` and :class:`LowbitConv1D` in ``model``, in
    ``named_modules`` order."""
    return [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, (LowbitLinear, LowbitConv1D))]


def sr_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state of each stochastic-rounding generator of ``model``'s :class:`LowbitLinear` modules.

    Save it beside ``model.state_dict()`` and give it to :func:`load_sr_state_dict` on resume, and the
    resumed run draws the same rounding bits as an uninterrupted one. It is apart from the model's
    ``state_dict``, which stays ``nn.Linear``'s so a converted checkpoint loads into a plain model.

    Returns:
        fqn of the first module using a generator -> ``generator.get_state()`` (a uint8 tensor), one entry
        per distinct generator (``convert_to_lowbit_training`` gives one to all the modules it converts);
        modules drawing from torch's global generator (``generator=None``) are not in it: save
        ``torch.get_rng_state()`` for those.
    """
    seen: dict[int, str] = {}
    out: dict[str, torch.Tensor] = {}
    for fqn, module in lowbit_linears(model):
        generator = module.generator
        if generator is not None and id(generator) not in seen:
            seen[id(generator)] = fqn
            out[fqn] = generator.get_state()
    return out


def load_sr_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Set the stochastic-rounding generators of ``model`` from :func:`sr_state_dict`'s output.

    Raises:
        TypeError: for a ``state`` that is not a dict of uint8 tensors.
        ValueError: when its keys are not those ``sr_state_dict(model)`` has (both lists in the message).
            No generator is changed when it raises.
    """
    if not isinstance(state, dict) or not all(
        isinstance(v, torch.Tensor) and v.dtype == torch.uint8 for v in state.values()
    ):
        raise TypeError("state must be a dict fqn -> uint8 tensor, as sr_state_dict returns")
    modules = dict(lowbit_linears(model))
    expected = list(sr_state_dict(model))
    if sorted(state) != sorted(expected):
        raise ValueError(
            f"SR state for modules {sorted(state)}, but this model's generators are at {expected}"
        )
    for fqn in expected:
        generator = modules[fqn].generator
        assert generator is not None, "sr_state_dict lists only modules with a generator"
        generator.set_state(state[fqn])
