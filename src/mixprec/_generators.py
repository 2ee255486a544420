"""The one store of stochastic-rounding generators: one ``torch.Generator`` per device, made where it draws.

``torch.rand(..., device="cuda", generator=g)`` needs ``g`` on that device (a CPU generator cannot feed
CUDA tensors), so every stochastic-rounding source in mixprec (the converted low-bit layers,
``CompensatedOptimizer``) keeps a :class:`DeviceGenerators`: ``on(device)`` makes the device's generator on
first use, seeded with the one seed, so a module or optimizer moved by ``.to()`` draws on its new device.

A generator's state is device-specific bytes (a CPU Mersenne-Twister state is 5056 bytes, a CUDA Philox
state 16), so no state moves between devices: the saved states are kept per device. Loading a state for a
device this process cannot make a generator on (a CUDA state on a CPU-only machine) keeps it as it is; it is
set when that device's generator is made and saved again unchanged, so a checkpoint passes through a
machine without the device intact. A device with no saved state starts afresh from the seed.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["DeviceGenerators", "check_seed"]


def check_seed(seed: object) -> int:
    """``seed`` as a generator seed.

    Raises:
        TypeError: for anything but an int (a bool included) in ``[-2**63, 2**64)``, which
            ``torch.Generator.manual_seed`` takes.
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or not -(2**63) <= seed < 2**64:
        raise TypeError(f"seed must be an int in [-2**63, 2**64) or None, got {seed!r}")
    return seed


class DeviceGenerators:
    """One ``torch.Generator`` per device, made on first use as ``Generator(device=d).manual_seed(seed)``.

    Args:
        seed: the seed of every device's generator (see :func:`check_seed`).

    ``state_dict()`` is ``{device string: uint8 state}`` for each generator made or state loaded and not yet
    set (see the module doc); ``load_state_dict`` restores exactly that, validating every state it can
    before anything changes. It round-trips ``deepcopy`` and pickle (torch generators do).
    """

    def __init__(self, seed: int) -> None:
        self.seed = check_seed(seed)
        self._made: dict[str, torch.Generator] = {}
        self._pending: dict[str, torch.Tensor] = {}  # loaded states of devices with no generator yet

    def on(self, device: torch.device | str) -> torch.Generator:
        """The generator of ``device`` (made now, from the seed or a loaded state, if it is the first use).

        Raises:
            ValueError: when a state loaded for this device does not fit its generator (e.g. a CPU state
                loaded under a CUDA device's name), naming the device and both sizes.
        """
        key = str(torch.device(device))
        generator = self._made.get(key)
        if generator is None:
            generator = torch.Generator(device=torch.device(key)).manual_seed(self.seed)
            if key in self._pending:
                _set(generator, self._pending[key], key)
                del self._pending[key]
            self._made[key] = generator
        return generator

    def state_dict(self) -> dict[str, torch.Tensor]:
        """``{device string: uint8 state tensor (on the CPU)}`` of every generator made or state kept."""
        out = {key: state.clone() for key, state in self._pending.items()}
        out.update({key: g.get_state() for key, g in self._made.items()})
        return dict(sorted(out.items()))

    def load_state_dict(self, state: Any, what: str = "state") -> None:
        """Restore :meth:`state_dict`'s output; devices not in it start afresh from the seed.

        Raises:
            TypeError: for a ``state`` that is not a dict of device strings to uint8 tensors.
            ValueError: for a state that does not fit the generator of its device (both sizes and the
                device named) where this process can make one. Nothing changes when it raises.
        """
        checked = self.check_state(state, what)
        self._made = {key: g for key, (_, g) in checked.items() if g is not None}
        self._pending = {key: value for key, (value, g) in checked.items() if g is None}

    @staticmethod
    def check_state(
        state: Any, what: str = "state"
    ) -> dict[str, tuple[torch.Tensor, torch.Generator | None]]:
        """Validate a :meth:`state_dict` output: ``{key: (state, a generator set to it, or None where this
        process cannot make a generator on that device)}``. Raises as :meth:`load_state_dict`."""
        if not isinstance(state, dict):
            raise TypeError(
                f"{what} must be a dict of device -> uint8 generator state, got {type(state).__name__}"
            )
        out: dict[str, tuple[torch.Tensor, torch.Generator | None]] = {}
        for key, value in state.items():
            try:
                device = torch.device(key)
            except (RuntimeError, TypeError) as error:
                raise TypeError(f"{what} has key {key!r}, not a device string: {error}") from None
            if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8 or value.dim() != 1:
                raise TypeError(
                    f"{what}[{key!r}] must be a 1-D uint8 tensor (a generator state), got {value!r:.80}"
                )
            if value.device.type != "cpu":  # set_state copies a host tensor itself; a uint8 one has no grad
                value = value.to("cpu")
            try:
                generator = torch.Generator(device=device)
            except RuntimeError:  # no such device in this process: kept, set when it is made
                out[str(device)] = (value, None)
                continue
            _set(generator, value, f"{what}[{key!r}]")
            out[str(device)] = (value, generator)
        return out

    def __repr__(self) -> str:
        return f"DeviceGenerators(seed={self.seed}, devices={sorted({*self._made, *self._pending})})"


def _set(generator: torch.Generator, state: torch.Tensor, what: str) -> None:
    """``generator.set_state(state)``, a misfit named (torch's own message gives both sizes)."""
    try:
        generator.set_state(state)
    except (RuntimeError, TypeError, ValueError) as error:
        raise ValueError(
            f"{what} is not a state of a {generator.device} generator ({state.numel()} bytes): {error}; "
            "a generator state is device-specific, it loads only into a generator of the device it came from"
        ) from None
