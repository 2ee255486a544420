"""`Policy`: which ops run in which precision, as a small immutable value.

A policy is data. It names three dtypes (parameters, compute, outputs), a device family whose
default op lists it starts from, the ops moved away from those defaults, and per-module overrides.
Everything the engine needs is derived by :meth:`Policy.resolve`; nothing here runs an op.

String form (round-trips through :meth:`Policy.parse` and ``str``)::

    params=float32,compute=bfloat16,output=float32
    p=f32,c=bf16,o=f32,device=cuda,fp32+=gelu|softmax,lower+=einsum

Presets: ``"bf16-mixed"``, ``"fp16-mixed"``, ``"conservative"`` (softmax, log_softmax,
layer_norm, group_norm and sum kept in fp32 on every device).
"""

from __future__ import annotations

import difflib
import fnmatch
import functools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property

import torch
from torch import nn

from mixprec.policy import ops as _ops
from mixprec.policy.conditions import CONDITIONS, Condition

__all__ = ["BANNED", "DEFAULT_DTYPES", "PASSTHROUGH", "Policy", "ResolvedPolicy", "known_op_names"]

#: Category for ops that run in whatever dtype their inputs arrive in (not cast at all).
PASSTHROUGH = "none"
#: Category for ops torch refuses to autocast (CUDA binary_cross_entropy); the engine raises.
BANNED = "banned"

#: Low-precision dtype used when neither ``dtype`` nor the policy names one (as torch.autocast).
DEFAULT_DTYPES: dict[str, torch.dtype] = {"cpu": torch.bfloat16, "cuda": torch.float16}

#: Compute dtypes each device family accepts. float32 makes "lower" ops run in fp32: a pin, used by
#: module overrides (torch.autocast would instead disable itself with a warning on CPU).
SUPPORTED_DTYPES: dict[str, tuple[torch.dtype, ...]] = {
    "cpu": (torch.bfloat16, torch.float16, torch.float32),
    "cuda": (torch.float16, torch.bfloat16, torch.float32),
}

_FAMILY_OPS: dict[str, Mapping[str, frozenset[str]]] = {"cpu": _ops.CPU_OPS, "cuda": _ops.CUDA_OPS}

_EDITABLE = (_ops.LOWER, _ops.FP32, _ops.PROMOTE, PASSTHROUGH)
_ALL_CATEGORIES = (*_ops.CATEGORIES, PASSTHROUGH)

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "f32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "f16": torch.float16,
    "half": torch.float16,
}
_KEY_NAMES = {
    "params": "param_dtype",
    "param": "param_dtype",
    "p": "param_dtype",
    "compute": "compute_dtype",
    "c": "compute_dtype",
    "output": "output_dtype",
    "out": "output_dtype",
    "o": "output_dtype",
    "device": "device_type",
    "d": "device_type",
}
_CONSERVATIVE_FP32 = ("softmax", "log_softmax", "layer_norm", "group_norm", "sum")

OpKey = str | Callable
ModuleKey = str | type | Callable


def _suggest(name: str, candidates: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=3, cutoff=0.6)
    return f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""


def _dtype(value: torch.dtype | str, what: str) -> torch.dtype:
    if isinstance(value, torch.dtype):
        if not value.is_floating_point or value == torch.float64:
            raise ValueError(f"{what} must be float32, bfloat16 or float16, got {value}")
        return value
    if isinstance(value, str):
        key = value.strip().lower().removeprefix("torch.")
        if key in _DTYPE_NAMES:
            return _DTYPE_NAMES[key]
        raise ValueError(
            f"unknown dtype {value!r} for {what}{_suggest(key, _DTYPE_NAMES)}; accepted: "
            f"{sorted(_DTYPE_NAMES)}"
        )
    raise TypeError(f"{what} must be a torch.dtype or str, got {type(value).__name__}: {value!r}")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@functools.cache
def known_op_names() -> frozenset[str]:
    """Every name an op can be given by: the catalogue plus the torch functions and Tensor methods
    that reach ``__torch_function__`` under the name the engine looks up (``func.__name__``)."""
    names = set(_ops.ALL_OP_NAMES) | set(_ops.ALIASES)
    namespaces = (
        torch,
        torch.nn.functional,
        torch.Tensor,
        torch.linalg,
        torch.fft,
        torch.special,
        torch._C._nn,
    )
    for namespace in namespaces:
        for attr in dir(namespace):
            if attr.startswith("__") and namespace is not torch.Tensor:
                continue
            value = getattr(namespace, attr, None)
            if callable(value) and not isinstance(value, type):
                names.add(getattr(value, "__name__", attr) or attr)
    return frozenset(n for n in names if isinstance(n, str) and n.isidentifier())


def canonical_op(op: OpKey) -> OpKey:
    """Return the catalogue name for ``op`` (aliases resolved), or the callable itself.

    Raises:
        ValueError: for a name that is not in the op catalogue, with the close names.
        TypeError: for something that is neither a name nor a callable.
    """
    if isinstance(op, str):
        name = _ops.ALIASES.get(op, op)
        if name not in known_op_names():
            raise ValueError(
                f"unknown op {op!r}{_suggest(op, known_op_names())}; ops are named by their "
                "ATen/functional name (e.g. 'softmax', 'linear', 'matmul') or given as callables"
            )
        return name
    if callable(op):
        return op
    raise TypeError(f"an op is a name or a callable, got {type(op).__name__}: {op!r}")


def _op_sort_key(item: tuple[OpKey, str]) -> tuple[int, str]:
    op = item[0]
    if isinstance(op, str):
        return (0, op)
    return (1, f"{getattr(op, '__module__', '')}.{getattr(op, '__qualname__', repr(op))}")


def _module_value(value: object, key: object) -> torch.dtype | Policy:
    if isinstance(value, Policy):
        return value
    if isinstance(value, str) and value.strip().lower().removeprefix("torch.") not in _DTYPE_NAMES:
        return Policy.parse(value)
    if isinstance(value, (torch.dtype, str)):
        return _dtype(value, f"module override for {key!r}")
    raise TypeError(f"module override for {key!r} must be a dtype or a Policy, got {type(value).__name__}")


def _module_key(key: object) -> ModuleKey:
    if isinstance(key, str):
        return key
    if isinstance(key, type):
        if not issubclass(key, nn.Module):
            raise TypeError(f"module override key {key.__name__} is a class but not an nn.Module subclass")
        return key
    if callable(key):
        return key
    raise TypeError(
        f"module override keys are qualified names/globs, nn.Module classes or "
        f"(module, name) -> bool filters; got {type(key).__name__}: {key!r}"
    )


@dataclass(frozen=True)
class Policy:
    """Which precision each op runs in under :func:`mixprec.autocast`, plus model dtypes.

    Args:
        compute_dtype: the low-precision dtype of "lower" ops; None means the device's default
            (bfloat16 on CPU, float16 on CUDA), as with ``torch.autocast``.
        param_dtype: dtype of the model's parameters (used by :func:`mixprec.initialize`).
        output_dtype: dtype module outputs are cast to where a policy owns a module boundary (module
            overrides, O2 models). Ops inside a plain region keep the dtype the rules give them.
        device_type: the op-list family ("cpu" or "cuda") this policy starts from; None means the
            family of whatever device the autocast region runs on.
        op_overrides: ``(op, category)`` pairs moved away from the family's defaults; built by
            :meth:`with_ops`. Categories: "lower", "fp32", "promote", "none" (run as given).
        module_overrides: ``(key, dtype | Policy)`` pairs; built by :meth:`with_modules`.
    """

    compute_dtype: torch.dtype | None = None
    param_dtype: torch.dtype = torch.float32
    output_dtype: torch.dtype = torch.float32
    device_type: str | None = None
    op_overrides: tuple[tuple[OpKey, str], ...] = ()
    module_overrides: tuple[tuple[ModuleKey, torch.dtype | Policy], ...] = field(default=())

    def __post_init__(self) -> None:
        if self.compute_dtype is not None:
            _dtype(self.compute_dtype, "compute_dtype")
        _dtype(self.param_dtype, "param_dtype")
        _dtype(self.output_dtype, "output_dtype")
        if self.device_type is not None and self.device_type not in _FAMILY_OPS:
            raise ValueError(
                f"device_type must be one of {sorted(_FAMILY_OPS)} or None, got {self.device_type!r}"
            )
        for op, category in self.op_overrides:
            if category not in _ALL_CATEGORIES:
                raise ValueError(
                    f"unknown op category {category!r} for {op!r}; accepted: {list(_ALL_CATEGORIES)}"
                )

    # ----------------------------------------------------------------- constructors
    @classmethod
    def for_device(cls, device_type: str, dtype: torch.dtype | str | None = None) -> Policy:
        """The default policy: exactly ``torch.autocast(device_type, dtype)``'s op lists."""
        family = _family(device_type)
        compute = None if dtype is None else _dtype(dtype, "dtype")
        _check_supported(family, compute)
        return cls(compute_dtype=compute, device_type=family)

    @classmethod
    def preset(cls, name: str, device_type: str | None = None) -> Policy:
        """A named preset: "bf16-mixed", "fp16-mixed" or "conservative".

        Raises:
            ValueError: for an unknown name, listing the presets.
        """
        key = name.strip().lower()
        family = None if device_type is None else _family(device_type)
        if key in ("bf16-mixed", "bf16"):
            return cls(compute_dtype=torch.bfloat16, device_type=family)
        if key in ("fp16-mixed", "16-mixed", "fp16"):
            return cls(compute_dtype=torch.float16, device_type=family)
        if key == "conservative":
            return cls(device_type=family).with_ops(fp32=_CONSERVATIVE_FP32)
        raise ValueError(f"unknown policy preset {name!r}{_suggest(key, PRESETS)}; accepted: {list(PRESETS)}")

    @classmethod
    def parse(cls, spec: str, device_type: str | None = None) -> Policy:
        """Parse a preset name or a ``key=value,...`` string (see the module docstring).

        Raises:
            ValueError: naming the bad key, dtype or op and the accepted ones.
        """
        if not isinstance(spec, str):
            raise TypeError(f"Policy.parse expects a str, got {type(spec).__name__}")
        text = spec.strip()
        if "=" not in text:
            return cls.preset(text, device_type)
        fields: dict[str, object] = {}
        edits: list[tuple[str, list[str]]] = []
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            key, value = key.strip().lower(), value.strip()
            if not sep or not value:
                raise ValueError(f"policy item {part!r} is not key=value")
            if key.endswith("+"):
                category = key[:-1]
                if category not in _EDITABLE:
                    raise ValueError(f"unknown op list {category!r} in {part!r}; accepted: {list(_EDITABLE)}")
                edits.append((category, [v.strip() for v in value.split("|") if v.strip()]))
            elif key in _KEY_NAMES:
                name = _KEY_NAMES[key]
                fields[name] = _family(value) if name == "device_type" else _dtype(value, name)
            else:
                raise ValueError(
                    f"unknown policy key {key!r}{_suggest(key, _KEY_NAMES)}; accepted: "
                    f"{sorted(_KEY_NAMES)} and <list>+= for lists {list(_EDITABLE)}"
                )
        if device_type is not None and "device_type" not in fields:
            fields["device_type"] = _family(device_type)
        policy = cls(**fields)  # type: ignore[arg-type]
        for category, names in edits:
            policy = policy._moved(names, category)
        return policy

    # ----------------------------------------------------------------- edits
    def with_ops(
        self,
        *,
        lower: Iterable[OpKey] = (),
        fp32: Iterable[OpKey] = (),
        promote: Iterable[OpKey] = (),
        none: Iterable[OpKey] = (),
    ) -> Policy:
        """A new policy with these ops moved to the given lists.

        Args:
            lower: ops to run in the compute dtype.
            fp32: ops to run in float32.
            promote: ops whose floating inputs are cast to the widest among them.
            none: ops taken off every list (run in whatever dtype their inputs have).

        Raises:
            ValueError: for an unknown op name (with close names) or an op given to two lists.
        """
        policy = self
        seen: dict[OpKey, str] = {}
        for category, opnames in (
            ("lower", lower),
            ("fp32", fp32),
            ("promote", promote),
            (PASSTHROUGH, none),
        ):
            if isinstance(opnames, (str, bytes)) or callable(opnames):
                opnames = [opnames]  # a single op given bare
            for op in opnames:
                key = canonical_op(op)
                if key in seen and seen[key] != category:
                    raise ValueError(f"op {op!r} given to both {seen[key]!r} and {category!r}")
                seen[key] = category
        for category in _EDITABLE:
            names = [op for op, cat in seen.items() if cat == category]
            policy = policy._moved(names, category)
        return policy

    def _moved(self, opnames: Iterable[OpKey], category: str) -> Policy:
        rules = dict(self.op_overrides)
        for op in opnames:
            rules[canonical_op(op)] = category
        return replace(self, op_overrides=tuple(sorted(rules.items(), key=_op_sort_key)))

    def with_modules(self, overrides: Mapping[ModuleKey, torch.dtype | Policy | str]) -> Policy:
        """A new policy with per-module overrides (later entries win over earlier ones for one module).

        Keys: a qualified name or glob as in ``model.named_modules()`` (``"encoder.*.norm"``, ``"1"``),
        an ``nn.Module`` subclass, or a filter ``(module, qualified_name) -> bool``. Values: a dtype
        (``torch.float32`` runs that module's ops, and its submodules', in fp32) or a Policy.
        """
        if not isinstance(overrides, Mapping):
            raise TypeError(f"with_modules expects a mapping, got {type(overrides).__name__}")
        added = tuple((_module_key(k), _module_value(v, k)) for k, v in overrides.items())
        return replace(self, module_overrides=self.module_overrides + added)

    def with_dtypes(
        self,
        *,
        compute: torch.dtype | str | None = None,
        params: torch.dtype | str | None = None,
        output: torch.dtype | str | None = None,
    ) -> Policy:
        """A new policy with some of its dtypes replaced."""
        changes: dict[str, torch.dtype] = {}
        for name, value in (("compute_dtype", compute), ("param_dtype", params), ("output_dtype", output)):
            if value is not None:
                changes[name] = _dtype(value, name)
        return replace(self, **changes)

    # ----------------------------------------------------------------- queries
    def ops(self, device_type: str | None = None) -> dict[str, frozenset[OpKey]]:
        """The op lists this policy gives on ``device_type`` (default: its own family), by category."""
        return self.resolve(device_type or self.device_type or "cpu").lists

    def category(self, op: OpKey, device_type: str | None = None) -> str:
        """The list ``op`` is on ("lower", "fp32", "promote", ... or "none")."""
        return self.resolve(device_type or self.device_type or "cpu").category(canonical_op(op))

    def module_override(self, module: nn.Module, name: str) -> torch.dtype | Policy | None:
        """The override for a module with qualified ``name``, or None; the last matching entry wins."""
        found = None
        for key, value in self.module_overrides:
            if isinstance(key, str):
                hit = name == key or fnmatch.fnmatchcase(name, key)
            elif isinstance(key, type):
                hit = isinstance(module, key)
            else:
                hit = bool(key(module, name))
            if hit:
                found = value
        return found

    def resolve(self, device_type: str, dtype: torch.dtype | None = None) -> ResolvedPolicy:
        """The concrete rules on ``device_type``; ``dtype`` (autocast's argument) overrides compute_dtype."""
        return _resolve(self, _family(device_type), dtype)

    def __str__(self) -> str:
        parts = [f"params={_dtype_name(self.param_dtype)}"]
        if self.compute_dtype is not None:
            parts.append(f"compute={_dtype_name(self.compute_dtype)}")
        parts.append(f"output={_dtype_name(self.output_dtype)}")
        if self.device_type is not None:
            parts.append(f"device={self.device_type}")
        for category in _EDITABLE:
            names = [_op_label(op) for op, cat in self.op_overrides if cat == category]
            if names:
                parts.append(f"{category}+={'|'.join(names)}")
        return ",".join(parts)


def _op_label(op: OpKey) -> str:
    return op if isinstance(op, str) else f"<{getattr(op, '__qualname__', repr(op))}>"


PRESETS = ("bf16-mixed", "fp16-mixed", "conservative")


def _family(device_type: object) -> str:
    if isinstance(device_type, torch.device):
        device_type = device_type.type
    if not isinstance(device_type, str):
        raise TypeError(
            f"device_type must be a str such as 'cpu' or 'cuda', got {type(device_type).__name__}"
        )
    family = device_type.split(":")[0].strip().lower()
    if family not in _FAMILY_OPS:
        raise ValueError(
            f"unsupported device_type {device_type!r}; mixprec autocast supports {sorted(_FAMILY_OPS)}"
        )
    return family


def _check_supported(family: str, dtype: torch.dtype | None) -> None:
    if dtype is not None and dtype not in SUPPORTED_DTYPES[family]:
        accepted = ", ".join(_dtype_name(d) for d in SUPPORTED_DTYPES[family])
        raise ValueError(f"autocast on {family!r} supports dtype {accepted}; got {dtype}")


@dataclass(frozen=True, eq=False)
class ResolvedPolicy:
    """A policy made concrete for one device family and compute dtype: what the engine reads."""

    policy: Policy
    device_type: str
    compute_dtype: torch.dtype
    by_name: Mapping[str, str]
    by_callable: Mapping[Callable, str]
    conditions: Mapping[str, Condition]

    def category(self, op: OpKey) -> str:
        if isinstance(op, str):
            return self.by_name.get(op, PASSTHROUGH)
        return self.by_callable.get(op, PASSTHROUGH)

    @cached_property
    def lists(self) -> dict[str, frozenset[OpKey]]:
        out: dict[str, set[OpKey]] = {c: set() for c in _ops.CATEGORIES}
        for table in (self.by_name, self.by_callable):
            for op, category in table.items():
                if category in out:
                    out[category].add(op)
        return {c: frozenset(v) for c, v in out.items()}


_RESOLVED: dict[tuple[Policy, str, torch.dtype | None], ResolvedPolicy] = {}


def _resolve(policy: Policy, family: str, dtype: torch.dtype | None) -> ResolvedPolicy:
    key = (policy, family, dtype)
    hit = _RESOLVED.get(key)
    if hit is not None:
        return hit
    compute = dtype or policy.compute_dtype or DEFAULT_DTYPES[family]
    _check_supported(family, compute)
    base = policy.device_type or family
    by_name: dict[str, str] = {}
    for category, names in _FAMILY_OPS[base].items():
        for name in names:
            by_name[name] = category
    by_name.update(_ops.COMPOSITES.get(base, {}))
    by_name.update(dict.fromkeys(_ops.BANNED.get(base, ()), BANNED))
    by_callable: dict[Callable, str] = {}
    for op, category in policy.op_overrides:
        (by_name if isinstance(op, str) else by_callable)[op] = category
    edited = {op for op, _ in policy.op_overrides}
    conditions = {name: rule for name, rule in CONDITIONS.get(base, {}).items() if name not in edited}
    resolved = ResolvedPolicy(policy, family, compute, by_name, by_callable, conditions)
    if len(_RESOLVED) < 256:  # a memo of immutable values; bounded so odd callers cannot grow it forever
        _RESOLVED[key] = resolved
    return resolved
