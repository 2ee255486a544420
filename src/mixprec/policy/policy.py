"""`Policy`: which ops run in which precision, as a small immutable value.

A policy is data. It names three dtypes (parameters, compute, outputs), a device family whose
default op lists it starts from, the ops moved away from those defaults, and per-module overrides.
Everything the engine needs is derived by :meth:`Policy.resolve`; nothing here runs an op.

String form (round-trips through :meth:`Policy.parse` and ``str``)::

    params=float32,compute=bfloat16,output=float32
    p=f32,c=bf16,o=f32,device=cuda,fp32+=gelu|softmax,lower+=einsum
    c=bf16,pins=encoder.*.norm:float32|nn.LayerNorm:float32

Module pins keyed by a qualified name or glob, or by a ``torch.nn`` class, with a dtype, print as
``pins=``; pins keyed by a filter function or another class, or valued by a Policy, have no text form:
``str`` counts them as ``unprintable=N`` and :meth:`Policy.parse` refuses that string.

Presets: ``"bf16-mixed"``, ``"16-mixed"`` (Lightning's names for bf16 and fp16 autocast, as in
``mixprec.PRESETS``), ``"conservative"`` (softmax, log_softmax, layer_norm, group_norm and sum kept in fp32 on
every device).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from mixprec.formats import _DTYPE_NAMES, as_dtype
from mixprec.policy.names import (
    _ALL_CATEGORIES,
    _EDITABLE,
    _FAMILY_OPS,
    _KEY_NAMES,
    BANNED,
    DEFAULT_DTYPES,
    PASSTHROUGH,
    POLICY_PRESETS,
    SUPPORTED_DTYPES,
    ModuleKey,
    OpKey,
    _check_supported,
    _dtype,
    _dtype_name,
    _family,
    _op_label,
    _op_sort_key,
    _suggest,
    canonical_op,
    has_catalogue,
    known_op_names,
)
from mixprec.policy.resolve import ResolvedPolicy, _resolve

__all__ = [
    "BANNED",
    "DEFAULT_DTYPES",
    "PASSTHROUGH",
    "POLICY_PRESETS",
    "SUPPORTED_DTYPES",
    "Policy",
    "ResolvedPolicy",
    "canonical_op",
    "check_policy",
    "known_op_names",
]

_CONSERVATIVE_FP32 = ("softmax", "log_softmax", "layer_norm", "group_norm", "sum")


def _lists_of(family: str) -> str | None:
    """The op-list family a policy for ``family`` starts from; None (the region's device) where mixprec
    has no catalogue, so the policy runs torch's own lists there."""
    return family if has_catalogue(family) else None


def _module_value(value: object, key: object) -> torch.dtype | Policy:
    if isinstance(value, Policy):
        return value
    if isinstance(value, str) and value.strip().lower().removeprefix("torch.") not in _DTYPE_NAMES:
        try:
            return Policy.parse(value)
        except ValueError as error:
            raise ValueError(
                f"module override for {key!r}: {value!r} is neither a dtype name {sorted(_DTYPE_NAMES)} "
                f"nor a policy ({error})"
            ) from None
    if isinstance(value, (torch.dtype, str)):
        return _dtype(value, f"module override for {key!r}")
    raise TypeError(f"module override for {key!r} must be a dtype or a Policy, got {type(value).__name__}")


def _pairs(name: str, value: object) -> tuple[tuple[object, object], ...]:
    """``value`` if it is a tuple of 2-tuples (what the ``with_*`` builders make); else a TypeError."""
    if not isinstance(value, tuple) or not all(isinstance(p, tuple) and len(p) == 2 for p in value):
        raise TypeError(f"{name} must be a tuple of (key, value) pairs, got {value!r:.80}")
    return value


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
        # Dtype names ("bf16", "torch.float16") become dtypes here, as in Policy.parse, so the value
        # prints, compares and hashes as the dtype it names; anything else is refused now, not in a region.
        dtypes = {"param_dtype": _dtype(self.param_dtype, "param_dtype")}
        dtypes["output_dtype"] = _dtype(self.output_dtype, "output_dtype")
        if self.compute_dtype is not None:
            dtypes["compute_dtype"] = _dtype(self.compute_dtype, "compute_dtype")
        if self.device_type is not None and self.device_type not in _FAMILY_OPS:
            raise ValueError(
                f"device_type must be one of {sorted(_FAMILY_OPS)} or None, got {self.device_type!r}"
            )
        for op, category in _pairs("op_overrides", self.op_overrides):
            if category not in _ALL_CATEGORIES:
                raise ValueError(
                    f"unknown op category {category!r} for {op!r}; accepted: {list(_ALL_CATEGORIES)}"
                )
            canonical_op(op)  # type: ignore[arg-type]  # checked here: raises for an unknown op name
        modules = []
        for key, value in _pairs("module_overrides", self.module_overrides):
            _module_key(key)
            if not isinstance(value, (torch.dtype, Policy, str)):
                raise TypeError(f"module override for {key!r} must be a dtype or a Policy, got {value!r}")
            modules.append((key, _module_value(value, key)))
        for name, value in dtypes.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "module_overrides", tuple(modules))

    # ----------------------------------------------------------------- constructors
    @classmethod
    def for_device(cls, device_type: str, dtype: torch.dtype | str | None = None) -> Policy:
        """The default policy: exactly ``torch.autocast(device_type, dtype)``'s op lists."""
        family = _family(device_type)
        compute = None if dtype is None else _dtype(dtype, "dtype")
        _check_supported(family, compute)
        return cls(compute_dtype=compute, device_type=_lists_of(family))

    @classmethod
    def preset(cls, name: str, device_type: str | None = None) -> Policy:
        """A named preset: "bf16-mixed", "16-mixed" (torch's op lists in bf16 / fp16) or "conservative".

        Args:
            name: one of :data:`~mixprec.policy.POLICY_PRESETS` (case and surrounding blanks ignored).
            device_type: the op-list family the policy starts from; None: the region's.

        Raises:
            TypeError: ``name`` is not a str.
            ValueError: for any other name (a dtype name such as "bf16" too: a preset names a precision
                recipe, a dtype goes to ``Policy(compute_dtype=...)``), listing the presets.
        """
        if not isinstance(name, str):
            raise TypeError(f"preset name must be a str, got {type(name).__name__}: {name!r}")
        key = name.strip().lower()
        family = None if device_type is None else _lists_of(_family(device_type))
        if key == "bf16-mixed":
            return cls(compute_dtype=torch.bfloat16, device_type=family)
        if key == "16-mixed":
            return cls(compute_dtype=torch.float16, device_type=family)
        if key == "conservative":
            return cls(device_type=family).with_ops(fp32=_CONSERVATIVE_FP32)
        dtype = _DTYPE_NAMES.get(key.removeprefix("torch.").removesuffix("-mixed"))
        if dtype in (torch.bfloat16, torch.float16):  # "16-mixed", "bf16", "half": the preset of that dtype
            preset = "bf16-mixed" if dtype == torch.bfloat16 else "16-mixed"
            hint = f" (did you mean {preset!r}? a preset takes Lightning's precision names)"
        else:
            hint = _suggest(key, POLICY_PRESETS)
        raise ValueError(f"unknown policy preset {name!r}{hint}; accepted: {list(POLICY_PRESETS)}")

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
        pins: dict[ModuleKey, torch.dtype] = {}
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
            elif key == "pins":
                pins.update(_parse_pins(value))
            elif key == "unprintable":
                raise ValueError(
                    f"{part!r}: the policy this string was printed from had {value} module override(s) "
                    "keyed by a filter function or a class outside torch.nn, or valued by a Policy; those "
                    "have no text form: add them with Policy.with_modules"
                )
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
        return policy.with_modules(pins) if pins else policy

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
            elif not isinstance(opnames, Iterable):
                raise TypeError(f"{category} must be an op or an iterable of ops, got {opnames!r}")
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
        changes: dict[str, Any] = {}
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

    def resolve(self, device_type: str, dtype: torch.dtype | str | None = None) -> ResolvedPolicy:
        """The concrete rules on ``device_type``; ``dtype`` (autocast's argument, a dtype or name) overrides
        compute_dtype."""
        return _resolve(self, _family(device_type), None if dtype is None else as_dtype(dtype, "dtype"))

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
        pins = [_pin_text(key, value) for key, value in self.module_overrides]
        if any(pins):
            parts.append(f"pins={'|'.join(p for p in pins if p)}")
        if not all(pins):
            parts.append(f"unprintable={pins.count(None)}")
        return ",".join(parts)


def _pin_text(key: ModuleKey, value: torch.dtype | Policy) -> str | None:
    """``name:dtype`` or ``nn.Class:dtype`` for a pin with a text form, else None."""
    if not isinstance(value, torch.dtype):
        return None
    if isinstance(key, str) and key and not set(key) & set(",|:= "):
        return f"{key}:{_dtype_name(value)}"
    if isinstance(key, type) and getattr(nn, key.__name__, None) is key:
        return f"nn.{key.__name__}:{_dtype_name(value)}"
    return None


def _parse_pins(text: str) -> dict[ModuleKey, torch.dtype]:
    """``encoder.*.norm:float32|nn.LayerNorm:fp32`` -> ``{"encoder.*.norm": float32, nn.LayerNorm: ...}``."""
    pins: dict[ModuleKey, torch.dtype] = {}
    for item in filter(None, (i.strip() for i in text.split("|"))):
        name, sep, dtype = item.rpartition(":")
        if not sep or not name.strip():
            raise ValueError(f"pin {item!r} is not NAME:DTYPE (a qualified name or glob, or nn.Class)")
        name = name.strip()
        key: ModuleKey = name
        if name.startswith("nn."):
            cls = getattr(nn, name[3:], None)
            if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
                raise ValueError(f"pin {item!r}: torch.nn has no module class {name[3:]!r}")
            key = cls
        pins[key] = _dtype(dtype.strip(), f"pin {name!r}")
    return pins


def check_policy(policy: object) -> Policy | None:
    """``policy`` as a :class:`Policy`: a Policy or None as it is, a preset name or policy string parsed.

    The one check for every public ``policy=`` argument (``mixprec.autocast``, the trainer integrations).

    Raises:
        TypeError: for anything but a Policy, a str or None, naming its type.
        ValueError: for a string :meth:`Policy.parse` refuses (an unknown preset or op, a bad dtype).
    """
    if policy is None or isinstance(policy, Policy):
        return policy
    if isinstance(policy, str):
        return Policy.parse(policy)
    raise TypeError(
        "policy must be a mixprec.Policy, a preset name, a policy string or None, got "
        f"{type(policy).__name__}: {policy!r:.80}"
    )
