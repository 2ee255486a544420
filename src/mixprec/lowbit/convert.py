"""`convert_to_lowbit_training`: swap a model's ``nn.Linear`` modules for :class:`LowbitLinear` in place."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mixprec._generators import DeviceGenerators, check_seed
from mixprec.lowbit.linear import LowbitConv1D, LowbitLinear, _check
from mixprec.lowbit.recipes import Recipe
from mixprec.lowbit.sr import check_layer_generator
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
    seed: int | None = None,
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
            on their weights' device. None (the default): torch's default generator of the device the
            modules run on, or, with ``seed``, one set of their own generators, each made on the device it
            first draws on (see :class:`LowbitLinear`). A recipe that draws nothing (``sr`` off) never
            uses or checks a generator.
        seed: the seed of those generators (default None: torch's default generator); only without
            ``generator``.

    Returns:
        ``model``, or a new :class:`LowbitLinear` / :class:`LowbitConv1D` when ``model`` itself is converted.

    Raises:
        TypeError: for a non-module ``model``, a non-callable filter, a bad recipe, generator or seed, or
            a ``linear_types`` entry that is not an ``nn.Linear`` subclass.
        TypeError: for a ``module_filter_fn`` that returns anything but a ``bool`` (as float8's swap).
        ValueError: for an unknown recipe, both a generator and a seed, a root ``nn.Linear`` with child
            modules (they would be lost), for a recipe that draws a ``generator`` on another device than a
            module to convert (both devices and its fqn named), or a
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
    recipe, generator, seed = _check(recipe, generator, seed)
    shared = None if seed is None else DeviceGenerators(seed)
    if not isinstance(linear_types, tuple) or not all(
        isinstance(t, type) and issubclass(t, nn.Linear) for t in linear_types
    ):
        raise TypeError(f"linear_types must be a tuple of nn.Linear subclasses, got {linear_types!r}")

    def kept_because(module: nn.Module) -> str | None:
        if type(module) in linear_types or is_conv1d(module):
            return None
        return f"{type(module).__name__} is a subclass of nn.Linear (name it in linear_types to convert)"

    def check(wanted: list[tuple[str, nn.Module]]) -> None:
        for fqn, module in wanted:
            weight = module.weight
            assert isinstance(weight, torch.Tensor), "swap_linears collects only layers with a weight"
            check_layer_generator(recipe, generator, weight.device, f"the weight of {fqn or 'the model'!r}")

    return swap_linears(
        model,
        "convert_to_lowbit_training",
        f"recipe {recipe}",
        module_filter_fn=module_filter_fn,
        own=(LowbitLinear, LowbitConv1D),
        same=lambda module: module.recipe == recipe,
        kept_because=kept_because,
        make=lambda module: _lowbit_module(module, recipe, generator, shared),
        check=check,
    )


def _lowbit_module(
    module: nn.Module, recipe: Recipe, generator: torch.Generator | None, shared: DeviceGenerators | None
) -> nn.Module:
    """The low-bit layer replacing ``module`` (a ``Conv1D`` keeps its (in, out) weight Parameter), drawing
    from ``generator`` or else from the generators the call's layers share."""
    if is_conv1d(module):
        new: LowbitLinear | LowbitConv1D = LowbitConv1D(module, recipe, generator)
    else:
        assert isinstance(module, nn.Linear), "the swap collects only Conv1D and nn.Linear modules"
        new = LowbitLinear.from_linear(module, recipe, generator)
    new.sr_generators = shared
    return new


def lowbit_linears(model: nn.Module) -> list[tuple[str, LowbitLinear | LowbitConv1D]]:
    """``(fqn, module)`` for each :class:`LowbitLinear` and :class:`LowbitConv1D` in ``model``, in
    ``named_modules`` order."""
    return [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, (LowbitLinear, LowbitConv1D))]


def sr_state_dict(model: nn.Module) -> dict[str, Any]:
    """The state of the stochastic-rounding generators of ``model``'s :class:`LowbitLinear` /
    :class:`LowbitConv1D` modules.

    Save it beside ``model.state_dict()`` and give it to :func:`load_sr_state_dict` on resume, and the
    resumed run draws the same rounding bits as an uninterrupted one. It is apart from the model's
    ``state_dict``, which stays ``nn.Linear``'s so a converted checkpoint loads into a plain model.

    Returns:
        fqn of the first module drawing from a source -> its state, one entry per distinct source
        (``convert_to_lowbit_training`` gives one to all the modules it converts): for a given
        ``generator``, ``generator.get_state()`` (a uint8 tensor); for the modules' own generators,
        ``{"seed": int, "generators": {device string: uint8 tensor}}``, one state per device drawn on.
        Every tensor is on the CPU, so the dict saves and loads anywhere: a generator state is
        device-specific, and a state of a device the loading model does not draw on is kept for it
        (see :func:`load_sr_state_dict`).
    """
    out: dict[str, Any] = {}
    seen: set[int] = set()
    for fqn, module in lowbit_linears(model):
        source = _source(module)
        if source is not None and id(source) not in seen:
            seen.add(id(source))
            out[fqn] = _state_of(source)
    return out


def load_sr_state_dict(model: nn.Module, state: dict[str, Any]) -> None:
    """Set the stochastic-rounding generators of ``model`` from :func:`sr_state_dict`'s output.

    A module's own generators take the saved seed and per-device states: a state saved on a device this
    model draws on is restored there, one of another device (a checkpoint from a GPU loaded for a CPU run)
    is kept for that device, and a device with no saved state starts afresh from the saved seed. A given
    ``generator`` takes a state of its own device only.

    Raises:
        TypeError: for a ``state`` that is not a dict, or an entry not of its module's kind (a uint8
            tensor for a given generator, ``{"seed", "generators"}`` for the modules' own).
        ValueError: when its keys are not those ``sr_state_dict(model)`` has (both lists in the message),
            or a state that does not fit its generator's device (both named). No generator is changed
            when it raises.
    """
    if not isinstance(state, dict):
        raise TypeError(
            f"state must be a dict fqn -> generator state, as sr_state_dict returns, got {state!r:.80}"
        )
    sources: dict[int, tuple[str, torch.Generator | DeviceGenerators]] = {}
    for fqn, module in lowbit_linears(model):
        source = _source(module)
        if source is not None:
            sources.setdefault(id(source), (fqn, source))
    expected = [fqn for fqn, _ in sources.values()]
    if sorted(state) != sorted(expected):
        raise ValueError(
            f"SR state for modules {sorted(state)}, but this model's generators are at {expected}"
        )
    checked = [(source, _checked(source, state[fqn], fqn)) for fqn, source in sources.values()]
    for source, value in checked:
        if isinstance(source, torch.Generator):
            source.set_state(value)
        else:
            source.load_state_dict(value["generators"])
            source.seed = value["seed"]


def _source(module: LowbitLinear | LowbitConv1D) -> torch.Generator | DeviceGenerators | None:
    """What ``module`` draws from: a given generator, its own generators, or None (torch's default)."""
    return module.generator if module.generator is not None else module.sr_generators


def _state_of(source: torch.Generator | DeviceGenerators) -> Any:
    if isinstance(source, torch.Generator):
        return source.get_state()
    return {"seed": source.seed, "generators": source.state_dict()}


def _checked(source: torch.Generator | DeviceGenerators, value: Any, fqn: str) -> Any:
    """``value`` validated as the state of ``source`` (module ``fqn``'s), on a scratch generator."""
    what = f"the SR state of {fqn!r}"
    if isinstance(source, torch.Generator):
        if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8:
            raise TypeError(f"{what} must be a uint8 tensor (its generator's state), got {value!r:.80}")
        DeviceGenerators.check_state({str(source.device): value}, what)
        return value
    if not isinstance(value, dict) or sorted(value) != ["generators", "seed"]:
        raise TypeError(
            f"{what} must be {{'seed': int, 'generators': {{device: uint8 tensor}}}} (the layer draws "
            f"from its own generators), got {value!r:.80}"
        )
    check_seed(value["seed"])
    DeviceGenerators.check_state(value["generators"], what)
    return value
