"""Which devices a CUDA kernel takes its tensor arguments on: the rule table of the fake tier's device check.

``FakeTensorMode`` checks devices only where it wraps a new output, so an in-place op that returns nothing
(``torch._fused_adamw_``, the ``torch._foreach_*_`` family) runs there with a host tensor a GPU refuses.
:func:`mismatch` applies the real kernel's rule to one call instead. The rule of an aten op comes from
torch's own ``native_functions.yaml`` (shipped in ``torchgen``), as the dispatcher's code generator reads it:

- ``same``: an op declared without ``device_check: NoCheck`` and with a CUDA kernel gets the generated check
  ``check_and_update_common_device`` on its tensor arguments: every one on one device, a 0-dim CPU tensor
  included (the fused optimizers also read their keyword-only ``grad_scale`` / ``found_inf`` on the device,
  so every tensor argument is checked);
- ``iterator``: ``device_check: NoCheck  # TensorIterator``: ``TensorIteratorBase::compute_types`` takes a
  0-dim CPU tensor as an *input* beside device tensors (a CPU scalar); an output on the host, or a host
  input of more elements, is refused;
- ``foreach``: the ``_foreach_*`` ops (``NoCheck``: "foreach kernels fall back to slow path when tensors are
  on different devices"): on mixed devices the CUDA kernel loops over the per-tensor op, so index ``i`` of
  every list, with the op's single tensor arguments, follows ``iterator`` (the written list is the output);
- ``copy``: an explicit copy between devices (``copy_``, ``_to_copy``, ``_foreach_copy_``);
- ``index``: ``iterator``, with ``indices`` on any device (the kernel copies them over);
- ``unchecked``: not modelled (views and other ``NoCheck`` ops without a comment, ops without a CUDA kernel
  of their own, ops outside aten): the kernel decides.

:data:`OP_RULES` overrides the yaml where the kernel's own code says more, and :data:`HOST_ALLOWED` /
:data:`DEVICE_ONLY` / :data:`HOST_ONLY` name single arguments with their own rule, each with its source:
``lr`` of the fused optimizers' ``tensor_lr`` overloads may be a host tensor (``lr.item()``); the scalar
tensor of ``_foreach_mul`` / ``_foreach_div`` may be on the host, that of ``_foreach_add`` may not (its
fast route checks ``scalar.device() == tensors[0].device()``); the ``scalars`` of ``_foreach_addcmul`` /
``_foreach_addcdiv`` must be on the host ("Expected scalars to be on CPU").
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree

__all__ = ["DEVICE_ONLY", "HOST_ALLOWED", "HOST_ONLY", "OP_RULES", "RULES", "mismatch", "rule_of"]

RULES = ("same", "iterator", "foreach", "copy", "index", "unchecked")

#: Ops (``name.overload``) whose rule is not the one their native_functions.yaml entry implies.
OP_RULES: dict[str, str] = {
    "copy_.default": "copy",
    "_to_copy.default": "copy",
    "_foreach_copy_.default": "copy",  # NoCheck: the slow path is copy_ per tensor
    "_foreach_copy.default": "copy",
    "index.Tensor": "index",
    "_unsafe_index.Tensor": "index",
    "index_put.default": "index",
    "index_put_.default": "index",
    "_index_put_impl_.default": "index",
    "_unsafe_index_put.default": "index",
    # NoCheck in the yaml ("the Tensor LR can be on CPU"); the kernel then checks the rest by hand
    "_fused_adam_.tensor_lr": "same",
    "_fused_adamw_.tensor_lr": "same",
    "_fused_sgd_.tensor_lr": "same",
    "_fused_adagrad_.tensor_lr": "same",
}

#: Arguments that may be host tensors beside device tensors, by op.
HOST_ALLOWED: dict[str, frozenset[str]] = {
    **{f"_fused_{name}.tensor_lr": frozenset({"lr"}) for name in ("adam_", "adamw_", "sgd_", "adagrad_")},
    **{f"_foreach_{name}.Tensor": frozenset({"other"}) for name in ("mul", "mul_", "div", "div_")},
}

#: Arguments that must be on the device of the op's tensor lists, by op.
DEVICE_ONLY: dict[str, frozenset[str]] = {
    "_foreach_add.Tensor": frozenset({"other"}),
    "_foreach_add_.Tensor": frozenset({"other"}),
}

#: Arguments that must be host tensors, by op (the kernel reads them on the host).
HOST_ONLY: dict[str, frozenset[str]] = {
    f"_foreach_{name}.Tensor": frozenset({"scalars"})
    for name in ("addcmul", "addcmul_", "addcdiv", "addcdiv_")
}


def _yaml_path() -> Path:
    import torchgen

    return Path(torchgen.__file__).parent / "packaged" / "ATen" / "native" / "native_functions.yaml"


@functools.cache
def _native() -> dict[str, tuple[str, bool]]:
    """``name.overload`` -> (device_check line of native_functions.yaml, whether it has a CUDA kernel)."""
    text = _yaml_path().read_text()
    entries: dict[str, dict[str, Any]] = {}
    for block in text.split("\n- func: ")[1:]:
        name = block.split("(", 1)[0].strip()
        name = name if "." in name else f"{name}.default"
        entry: dict[str, Any] = {"check": "", "delegate": None, "cuda": False}
        in_dispatch = False
        for line in block.splitlines()[1:]:
            if line.startswith("    ") and in_dispatch:
                keys = line.split(":", 1)[0].split(",")
                entry["cuda"] |= any(k.strip() == "CUDA" for k in keys)
                continue
            in_dispatch = line.startswith("  dispatch:")
            if line.startswith("  device_check:"):
                entry["check"] = line.split(":", 1)[1].strip()
            elif line.startswith("  structured_delegate:"):
                delegate = line.split(":", 1)[1].strip()
                entry["delegate"] = delegate if "." in delegate else f"{delegate}.default"
        entries[name] = entry

    def cuda(name: str) -> bool:
        entry = entries.get(name)
        return bool(entry) and (entry["cuda"] or (entry["delegate"] is not None and cuda(entry["delegate"])))

    return {name: (entry["check"], cuda(name)) for name, entry in entries.items()}


def _key(func: Any) -> str:
    return f"{func.overloadpacket.__name__}.{func._overloadname}"


@functools.cache
def rule_of(func: Any) -> str:
    """The rule (one of :data:`RULES`) the CUDA kernel of aten op ``func`` applies to its arguments."""
    key = _key(func)
    if key in OP_RULES:
        return OP_RULES[key]
    if func.namespace != "aten":
        return "unchecked"
    check, has_cuda = _native().get(key, ("", False))
    if check.startswith("NoCheck"):
        if "TensorIterator" in check:
            return "iterator"
        return "foreach" if key.startswith("_foreach_") else "unchecked"
    return "same" if has_cuda else "unchecked"


def _device(t: torch.Tensor) -> str:
    return t.device.type


def _written(func: Any) -> set[str]:
    return {a.name for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write}


def mismatch(func: Any, bound: dict[str, Any]) -> str | None:
    """Why a GPU would refuse this call of ``func`` (arguments ``bound`` by schema name), or None.

    Calls mixing CPU and CUDA tensors are judged (and a CUDA tensor where :data:`HOST_ONLY` wants a host
    one); see the module doc for the rules.
    """
    tensors = {n: [t for t in pytree.tree_leaves(v) if isinstance(t, torch.Tensor)] for n, v in bound.items()}
    key = _key(func)
    for name in HOST_ONLY.get(key, ()):
        if any(_device(t) == "cuda" for t in tensors.get(name, [])):
            return f"{name} must be a host tensor (the kernel reads it on the host)"
    if not {"cpu", "cuda"} <= {_device(t) for ts in tensors.values() for t in ts}:
        return None
    for name in DEVICE_ONLY.get(key, ()):
        if any(_device(t) == "cpu" for t in tensors.get(name, [])):
            return f"{name} is on cpu, the tensor lists on cuda (the fast route checks they agree)"
    rule = rule_of(func)
    exempt = set().union(*(table.get(key, ()) for table in (HOST_ALLOWED, HOST_ONLY, DEVICE_ONLY)))
    exempt |= {"indices"} if rule == "index" else set()
    operands = {n: ts for n, ts in tensors.items() if n not in exempt}
    if rule == "same":
        host = [f"{n}{_at(ts, t)}" for n, ts in operands.items() for t in ts if _device(t) == "cpu"]
        if not host:
            return None
        return f"{', '.join(host)} on cpu beside cuda tensors: every tensor argument must be on one device"
    if rule == "foreach":
        return _foreach(operands, bound, _written(func) | {"out"})
    if rule in ("iterator", "index"):
        written = _written(func) | {"out"}
        return _iterator([(n, t, n in written) for n, ts in operands.items() for t in ts])
    return None  # copy, unchecked


def _at(ts: list[torch.Tensor], t: torch.Tensor) -> str:
    return f"[{next(i for i, u in enumerate(ts) if u is t)}]" if len(ts) > 1 else ""


def _iterator(operands: list[tuple[str, torch.Tensor, bool]]) -> str | None:
    """TensorIterator's rule over (name, tensor, written) operands mixing cpu and cuda."""
    if not any(_device(t) == "cuda" for _, t, _ in operands):
        return None
    for name, t, written in operands:
        if _device(t) != "cpu":
            continue
        if written:
            return f"{name} (written) is on cpu beside cuda operands: an output must be on the device"
        if t.dim() != 0:
            return (
                f"{name} of shape {tuple(t.shape)} is on cpu beside cuda operands: only a 0-dim CPU tensor "
                "may be an input (a CPU scalar)"
            )
    return None


def _foreach(operands: dict[str, list[torch.Tensor]], bound: dict[str, Any], written: set[str]) -> str | None:
    """Per index, the lists' i-th tensors with the single tensor arguments, under TensorIterator's rule."""
    lists = {n: ts for n, ts in operands.items() if isinstance(bound.get(n), (list, tuple))}
    single = [(n, t, n in written) for n, ts in operands.items() if n not in lists for t in ts]
    length = max((len(ts) for ts in lists.values()), default=0)
    for i in range(length):
        at = [(f"{n}[{i}]", ts[i], n in written) for n, ts in lists.items() if i < len(ts)]
        problem = _iterator(at + single)
        if problem:
            return problem
    return None
