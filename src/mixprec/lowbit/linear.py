"""`LowbitLinear`: an ``nn.Linear`` whose three GEMMs run in the formats of a :class:`Recipe`;
`LowbitConv1D`: the same for ``transformers``' ``Conv1D`` (GPT-2's linear layers, weight stored (in, out))."""

from __future__ import annotations

import torch
from torch import nn

from mixprec._generators import DeviceGenerators, check_seed
from mixprec.formats import as_dtype
from mixprec.lowbit.gemm import LowbitLinearFunction
from mixprec.lowbit.quantize import hold_generator
from mixprec.lowbit.recipes import Recipe, get_recipe
from mixprec.lowbit.sr import check_layer_generator, sr_generator
from mixprec.lowbit.swap import register_converted

__all__ = ["LowbitConv1D", "LowbitLinear"]


class LowbitLinear(nn.Linear):
    """``nn.Linear`` with quantized GEMMs (forward, input-gradient, weight-gradient) as ``recipe`` says.

    Same parameters (``weight`` (out, in), ``bias`` (out,)), the same ``state_dict`` keys and the same call
    as ``nn.Linear``: input (..., in_features) of any float dtype, output (..., out_features) in the input's
    dtype, or in the autocast dtype inside a ``torch.autocast`` / ``mixprec.autocast`` region (the weight is
    cast to it before quantization, as torchao's ``Float8Linear`` does). The bias is added after the GEMM
    in the output dtype. No buffers: every scale is computed from the tensor being quantized.

    Args:
        in_features, out_features, bias, device, dtype: as ``nn.Linear`` (``dtype`` may be a name, "bf16").
        recipe: a :class:`Recipe` or a recipe string (default ``"fp8_rowwise"``).
        generator: the ``torch.Generator`` stochastic rounding draws from, on the layer's device
            (``torch.rand`` cannot draw CUDA noise from a CPU generator). None (the default): torch's
            default generator of the device the layer runs on (the RNG state trainers checkpoint), or,
            with ``seed``, the layer's own generators, one made on each device at its first draw there
            (``mixprec.lowbit.sr``). A recipe that draws nothing (``sr`` off) never uses or checks one.
        seed: the seed of the layer's own generators (default None: torch's default generator); only
            without ``generator``.

    Raises:
        ValueError, TypeError: for a bad recipe, generator or seed, both a generator and a seed, or,
            for a recipe that draws, a generator on another device than the layer's weight (nothing is
            built then; the message names both devices). A layer built on the "meta" device (deferred
            initialisation) takes any generator; forward refuses an input on another device than the
            generator with the same ValueError (a layer moved by ``.cuda()`` after construction too).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | str | None = None,
        *,
        recipe: Recipe | str = "fp8_rowwise",
        generator: torch.Generator | None = None,
        seed: int | None = None,
    ) -> None:
        recipe, generator, seed = _check(recipe, generator, seed)
        check_layer_generator(recipe, generator, torch.empty(0, device=device).device, "the layer's weight")
        dtype = None if dtype is None else as_dtype(dtype, "dtype")
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.recipe, self.generator = recipe, generator
        self.sr_generators = None if seed is None else DeviceGenerators(seed)

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        recipe: Recipe | str = "fp8_rowwise",
        generator: torch.Generator | None = None,
        *,
        seed: int | None = None,
    ) -> LowbitLinear:
        """A LowbitLinear sharing ``linear``'s parameter objects (an optimizer built before keeps working);
        ``recipe``, ``generator`` and ``seed`` as the constructor's.

        Raises:
            TypeError: if ``linear`` is not an ``nn.Linear``.
            ValueError, TypeError: as the constructor, the device being ``linear.weight``'s.
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be a torch.nn.Linear, got {type(linear).__name__}")
        recipe, generator, seed = _check(recipe, generator, seed)
        check_layer_generator(recipe, generator, linear.weight.device, "the layer's weight")
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=False, recipe=recipe, generator=generator)
        new.weight, new.bias = linear.weight, linear.bias
        new.sr_generators = None if seed is None else DeviceGenerators(seed)
        new.train(linear.training)
        return new

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        generator = sr_generator(self.recipe, self.generator, self.sr_generators, input.device)
        return _lowbit_linear(input, self.weight, self.bias, self.recipe, generator)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe}"


class Conv1DShape:
    """``in_features`` / ``out_features`` of a converted transformers ``Conv1D`` (weight ``(nx, nf)``)."""

    nx: int
    nf: int
    weight: nn.Parameter
    bias: torch.Tensor | None

    @staticmethod
    def parameters_of(conv1d: nn.Module) -> tuple[nn.Parameter, torch.Tensor | None]:
        """``conv1d``'s own ``weight`` (nx, nf) and ``bias`` objects, checked before a layer is built.

        Raises:
            TypeError: for a ``conv1d`` without a 2-D ``weight`` Parameter or with a ``bias`` that is not a
                tensor or None.
        """
        weight = getattr(conv1d, "weight", None)
        if not isinstance(weight, nn.Parameter) or weight.dim() != 2:
            raise TypeError(
                f"conv1d must be a transformers Conv1D (a 2-D weight Parameter), got {conv1d!r:.80}"
            )
        bias = getattr(conv1d, "bias", None)
        if bias is not None and not isinstance(bias, torch.Tensor):
            raise TypeError(f"conv1d.bias must be a tensor or None, got {type(bias).__name__}")
        return weight, bias

    def _hold(self, weight: nn.Parameter, bias: torch.Tensor | None) -> None:
        """Hold the Conv1D's own Parameter objects (registered by ``nn.Module``'s ``__setattr__``)."""
        self.nx, self.nf = weight.shape
        self.weight, self.bias = weight, bias

    @property
    def in_features(self) -> int:
        return self.nx

    @property
    def out_features(self) -> int:
        return self.nf


class LowbitConv1D(Conv1DShape, nn.Module):
    """``transformers``' ``Conv1D`` (``y = x @ weight + bias``, ``weight`` (in, out): GPT-2's linear layers)
    with :class:`LowbitLinear`'s GEMMs, run over ``weight.t()``.

    It holds the ``Conv1D``'s own ``weight`` and ``bias`` Parameter objects, so ``state_dict`` keys, an
    optimizer's param groups and tied weights are unchanged, and its numerics are those of a
    :class:`LowbitLinear` of weight ``weight.t()`` with the same recipe and generator, bit for bit.
    ``nf`` / ``nx`` are Conv1D's (``out_features`` / ``in_features`` too).

    Args:
        conv1d: the ``transformers.pytorch_utils.Conv1D`` to convert.
        recipe, generator, seed: as :class:`LowbitLinear`'s.

    Raises:
        TypeError: for a ``conv1d`` without a 2-D ``weight`` Parameter (nx, nf) or with a ``bias`` that
            is not a tensor or None; ValueError / TypeError
            for a bad recipe, generator or seed (as :meth:`LowbitLinear.from_linear`).
    """

    def __init__(
        self,
        conv1d: nn.Module,
        recipe: Recipe | str = "fp8_rowwise",
        generator: torch.Generator | None = None,
        *,
        seed: int | None = None,
    ) -> None:
        weight, bias = self.parameters_of(conv1d)
        recipe, generator, seed = _check(recipe, generator, seed)
        check_layer_generator(recipe, generator, weight.device, "the layer's weight")
        super().__init__()
        self.recipe, self.generator = recipe, generator
        self.sr_generators = None if seed is None else DeviceGenerators(seed)
        self._hold(weight, bias)
        self.train(conv1d.training)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        generator = sr_generator(self.recipe, self.generator, self.sr_generators, input.device)
        return _lowbit_linear(input, self.weight.t(), self.bias, self.recipe, generator)

    def extra_repr(self) -> str:
        return f"nf={self.nf}, nx={self.nx}, recipe={self.recipe}"


def _lowbit_linear(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    recipe: Recipe,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """``input @ weight.T + bias`` (weight (out, in)) with ``recipe``'s three GEMMs."""
    hold_generator(generator)  # where a compiled backward's stochastic rounding finds it
    device_type = input.device.type
    if torch.is_autocast_enabled(device_type):
        input = input.to(torch.get_autocast_dtype(device_type))
    out = LowbitLinearFunction.apply(input, weight, recipe, generator)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out


def _check(
    recipe: Recipe | str, generator: object, seed: object
) -> tuple[Recipe, torch.Generator | None, int | None]:
    """The recipe resolved, the generator checked and the seed of the layer's own generators (None:
    torch's default generator draws)."""
    resolved = get_recipe(recipe)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    if generator is not None and seed is not None:
        raise ValueError(
            f"give a generator or a seed, not both (got generator={generator!r} and seed={seed!r}): the seed "
            "seeds the generators a layer makes itself when it is given none"
        )
    return resolved, generator, None if seed is None else check_seed(seed)


register_converted(LowbitLinear, lambda m: f"LowbitLinear, recipe {m.recipe}")
register_converted(LowbitConv1D, lambda m: f"LowbitConv1D, recipe {m.recipe}")
