"""Where a converted layer's stochastic rounding draws its random bits.

Only a recipe with stochastic rounding on a quantized gradient operand draws (:func:`draws`: ``nvfp4``,
``... sr=on``); every other recipe never looks at a generator, so none is checked or made for it.

A layer that draws takes the generator it was given (``generator=``), which must be on its weight's
device: a CUDA layer's noise cannot come from a CPU generator (``torch.rand`` refuses it), so one on another
device is refused, at construction and at a forward after ``.to()``, with a ``ValueError`` naming both
devices (:func:`check_generator_device`). Without one it draws from torch's default generator of the
device it runs on (so it follows ``.to()`` / ``.cuda()``, and trainers that checkpoint torch's RNG states
resume it bitwise); with a ``seed`` instead, from its own :class:`~mixprec._generators.DeviceGenerators`:
on each device a generator made at its first draw there from that seed.

Under ``torch.compile`` a layer with a ``seed`` draws from torch's default generator of its device
(Dynamo cannot make a ``torch.Generator`` in a graph): compiled and eager runs of such a layer round the
same way in distribution, not bit for bit.
"""

from __future__ import annotations

import torch

from mixprec._generators import DeviceGenerators
from mixprec.lowbit.recipes import HP, Recipe

__all__ = ["check_generator_device", "check_layer_generator", "draws", "sr_generator"]


def draws(recipe: Recipe) -> bool:
    """Whether ``recipe`` draws random bits: stochastic rounding of a quantized gradient operand."""
    return recipe.sr and (recipe.dgrad_go != HP or recipe.wgrad_go != HP)


def check_generator_device(generator: torch.Generator, device: torch.device, what: str) -> None:
    """Refuse a stochastic-rounding ``generator`` that cannot draw on ``device``.

    The same device type and, where both name one, the same index (``cuda`` and ``cuda:0`` agree). A
    generator's device is ``generator.device`` (``torch.Generator()`` is a CPU one). A ``device`` of type
    "meta" (a layer not placed yet, a shape-only forward) takes any generator: meta tensors draw nothing.

    Raises:
        ValueError: naming both devices (``what`` says whose ``device`` is) and what is accepted, when they
            differ.
    """
    have, want = generator.device, torch.device(device)
    same_index = have.index is None or want.index is None or have.index == want.index
    if want.type == "meta" or (have.type == want.type and same_index):
        return
    raise ValueError(
        f"the stochastic-rounding generator is on {have}, {what} on {want}: torch.rand cannot draw {want} "
        f"noise from a {have} generator; pass torch.Generator(device={str(want)!r}) (seeded as you need), "
        "or no generator (the layer then draws from one it makes on its weight's device, from seed=)"
    )


def check_layer_generator(
    recipe: Recipe, generator: torch.Generator | None, device: torch.device, what: str
) -> None:
    """At construction: refuse a ``generator`` on another device than ``device`` where ``recipe`` draws.

    Raises:
        ValueError: as :func:`check_generator_device`.
    """
    if generator is not None and draws(recipe):
        check_generator_device(generator, device, what)


def sr_generator(
    recipe: Recipe,
    generator: torch.Generator | None,
    generators: DeviceGenerators | None,
    device: torch.device,
) -> torch.Generator | None:
    """The generator a forward on ``device`` hands to the GEMMs (None where nothing is drawn).

    Raises:
        ValueError: for a given ``generator`` on another device than ``device`` (a layer moved by
            ``.to()`` after construction), as :func:`check_generator_device`.
    """
    if not draws(recipe) or device.type == "meta":
        return None
    if generator is not None:
        check_generator_device(generator, device, "the input")
        return generator
    if generators is None or torch.compiler.is_compiling():
        return None  # torch's default generator of the device (see the module doc)
    return generators.on(device)
