"""`convert_to_float8_training`: swap a model's ``nn.Linear`` modules for :class:`Float8Linear` in place;
`sync_float8_amax_history`: the model's delayed amaxes agreed across data-parallel ranks.

Transformer Engine reduces the amaxes of all fp8 tensors of a step in one flat buffer (``MAX``) so every
rank computes the same scales next step. :func:`sync_float8_amax_history` does the same for mixprec: it
gathers the newest entry of every ``amax_history`` row of every delayed :class:`Float8Linear` of a model
into one float32 tensor, all-reduces it once with ``MAX`` and writes the results back.

Call it after ``backward()`` (the grad_output amaxes are pushed there) and before the next forward, every
step, on every rank. Histories start equal (zeros) and each step adds the same agreed entry, so all ranks
hold the same histories and compute the same scales (the first step, with an empty history, scales
each rank's tensors by its own amax). Dynamic scaling needs no agreement.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from mixprec.float8.config import Float8Config, Float8UsageError
from mixprec.float8.linear import (
    Float8Conv1D,
    Float8Layer,
    Float8Linear,
    _check_config,
    check_float8_state,
    describe_config,
)
from mixprec.lowbit.swap import ModuleFilter, is_conv1d, swap_linears

__all__ = [
    "ModuleFilter",
    "convert_to_float8_training",
    "float8_linears",
    "skip_fqns",
    "sync_float8_amax_history",
]


def convert_to_float8_training(
    model: nn.Module, *, config: Float8Config | None = None, module_filter_fn: ModuleFilter | None = None
) -> nn.Module:
    """Swap every exact ``nn.Linear`` of ``model`` (itself included) for a :class:`Float8Linear`, and every
    ``transformers`` ``Conv1D`` (GPT-2's linear layers) for a :class:`Float8Conv1D`, in place.

    The same name and filter contract as ``torchao.float8.convert_to_float8_training``, so code can
    switch between them. The new modules share the old ones' parameter objects, so an optimizer built
    before conversion keeps working; ``state_dict`` keys stay the same (delayed scaling adds
    ``<fqn>.amax_history``), and ``model.load_state_dict`` checks every amax history before any tensor
    loads. Modules that already are :class:`Float8Linear` with this ``config`` are left alone (converting
    twice is a no-op); with another config, or converted by another API, they are refused. A ``Conv1D``
    keeps its (in, out) weight Parameter and runs the GEMMs over ``weight.t()`` (its numerics are those of a
    Float8Linear of that weight); to keep Conv1D layers in high precision, return False for them from
    ``module_filter_fn`` (``type(module).__name__ == "Conv1D"``).

    Args:
        model: the model to convert.
        config: the scaling recipe, a :class:`Float8Config` (default: dynamic).
        module_filter_fn: ``(module, fqn) -> bool``, called for each ``nn.Linear`` and ``Conv1D`` with its
            qualified name (``""`` for ``model`` itself); False keeps that module as it is (e.g. in bf16
            under autocast). Default: convert all.

    Returns:
        ``model`` (or a new :class:`Float8Linear` / :class:`Float8Conv1D` when ``model`` itself is one to
        convert).

    Raises:
        TypeError: if ``model`` is not an ``nn.Module``, ``config`` not a :class:`Float8Config`,
            ``module_filter_fn`` not callable with ``(module, fqn)`` or returning a non-bool; nothing is
            converted then.
        Float8UsageError: (a ValueError, and the AssertionError torchao raises) if ``model`` is an
            ``nn.Linear`` with child modules (they would be dropped).
        ValueError: if a layer the filter accepts is already converted with another config, or by
            :func:`mixprec.lowbit.convert_to_lowbit_training` or a plan (the layers and both settings
            named; nothing is converted then).

    Warns:
        UserWarning: naming the layers that compute a linear map but were kept as they are (subclasses of
            ``nn.Linear``, whose own parameters and forward would be lost; ``Conv1D`` under
            ``enable_fsdp_float8_all_gather``), or saying that nothing was converted.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    config = _check_config(config)

    def kept_because(module: nn.Module) -> str | None:
        if is_conv1d(module) and config.enable_fsdp_float8_all_gather:
            return "transformers Conv1D is not converted with enable_fsdp_float8_all_gather=True"
        if is_conv1d(module) or type(module) is nn.Linear:
            return None
        # a subclass's own parameters, buffers and forward would be lost in a Float8Linear
        return f"{type(module).__name__} is a subclass of nn.Linear (exact nn.Linear only convert)"

    def prepare(model: nn.Module) -> None:
        if not any(hook is check_float8_state_hook for hook in _load_pre_hooks(model)):
            model.register_load_state_dict_pre_hook(check_float8_state_hook)

    return swap_linears(
        model,
        "convert_to_float8_training",
        describe_config(config),
        module_filter_fn=module_filter_fn,
        own=(Float8Layer,),
        same=lambda module: module.config == config,
        kept_because=kept_because,
        make=lambda module: _float8_module(module, config),
        prepare=prepare,
        root_error=Float8UsageError,
    )


def _float8_module(module: nn.Module, config: Float8Config) -> Float8Layer:
    """The fp8 layer replacing ``module``: a ``Conv1D`` keeps its (in, out) weight Parameter."""
    if is_conv1d(module):
        return Float8Conv1D(module, config)
    assert isinstance(module, nn.Linear), "the swap collects only Conv1D and nn.Linear modules"
    return Float8Linear.from_linear(module, config)


def _load_pre_hooks(model: nn.Module) -> list[object]:
    return [getattr(hook, "hook", hook) for hook in model._load_state_dict_pre_hooks.values()]


def check_float8_state_hook(module: nn.Module, state_dict: dict, prefix: str, *args: object) -> None:
    """``load_state_dict`` pre-hook of a converted model: every amax history is checked before the model's
    own tensors load, so a refused checkpoint leaves every weight as it was."""
    check_float8_state(module, state_dict, prefix)


def float8_linears(model: nn.Module) -> list[tuple[str, Float8Layer]]:
    """``(fqn, module)`` for each :class:`Float8Linear` and :class:`Float8Conv1D` in ``model``, in
    ``named_modules`` order."""
    return [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, Float8Layer)]


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


@torch.no_grad()
def sync_float8_amax_history(model: nn.Module, group: dist.ProcessGroup | None = None) -> int:
    """All-reduce (MAX) the newest amax of every delayed history in ``model``, in one collective.

    Args:
        model: a model converted with delayed scaling (DDP-wrapped or not).
        group: the process group (default: the world).

    Returns:
        The number of amax values reduced (3 per delayed Float8Linear or Float8Conv1D); 0, and no
        collective, when the model has no delayed history or ``torch.distributed`` is not initialised.
    """
    histories = [m.amax_history for _, m in float8_linears(model) if m.amax_history is not None]
    if not histories or not (dist.is_available() and dist.is_initialized()):
        return 0
    newest = torch.cat([h[:, 0] for h in histories])
    dist.all_reduce(newest, op=dist.ReduceOp.MAX, group=group)
    for history, agreed in zip(histories, newest.split([h.shape[0] for h in histories]), strict=True):
        history[:, 0].copy_(agreed)
    return newest.numel()
