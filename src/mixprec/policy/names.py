"""Names and vocabularies of the policy: dtypes, op names, device families, categories, with validation.

Every user-facing spelling is checked here, and errors name the bad value, the accepted ones and, for a
typo, the close names.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Callable, Iterable, Mapping

import torch

from mixprec.formats import as_dtype
from mixprec.policy import ops as _ops

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

OpKey = str | Callable
ModuleKey = str | type | Callable


def _suggest(name: str, candidates: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=3, cutoff=0.6)
    return f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""


def _dtype(value: torch.dtype | str, what: str) -> torch.dtype:
    """:func:`as_dtype`, limited to the dtypes a policy can hold (float32, bfloat16, float16)."""
    dtype = as_dtype(value, what)
    if not dtype.is_floating_point or dtype == torch.float64:
        raise ValueError(f"{what} must be float32, bfloat16 or float16, got {value}")
    return dtype


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


def _op_label(op: OpKey) -> str:
    return op if isinstance(op, str) else f"<{getattr(op, '__qualname__', repr(op))}>"


#: The names :meth:`mixprec.Policy.preset` accepts: Lightning's precision flags for the two autocast dtypes
#: (``mixprec.PRESETS`` names the same ones), and the fp32-safe op lists.
POLICY_PRESETS = ("bf16-mixed", "16-mixed", "conservative")


def _torch_autocasts(family: str) -> bool:
    """Whether torch.autocast accepts ``family`` (``torch.amp.is_autocast_available``)."""
    try:
        return bool(torch.amp.is_autocast_available(family))
    except RuntimeError:  # not a device type torch knows at all
        return False


def _family(device_type: object) -> str:
    """The device type of a region: "cpu" or "cuda" (which have op catalogues) or any other type
    torch.autocast accepts ("mps", "xpu", "hpu", "xla", ...), where a region is torch's state alone."""
    if isinstance(device_type, torch.device):
        device_type = device_type.type
    if not isinstance(device_type, str):
        raise TypeError(
            f"device_type must be a str such as 'cpu' or 'cuda', got {type(device_type).__name__}"
        )
    family = device_type.split(":")[0].strip().lower()
    if family not in _FAMILY_OPS and not _torch_autocasts(family):
        raise ValueError(
            f"unsupported device_type {device_type!r}: torch.amp.is_autocast_available({family!r}) is "
            f"not True; mixprec autocast takes what torch.autocast takes (op catalogues for "
            f"{sorted(_FAMILY_OPS)}, torch's own lists on 'mps', 'xpu', 'hpu', 'xla', ...)"
        )
    return family


def has_catalogue(family: str) -> bool:
    """Whether mixprec has op lists for ``family`` to edit a policy against ("cpu", "cuda")."""
    return family in _FAMILY_OPS


def _check_supported(family: str, dtype: torch.dtype | None) -> None:
    """Refuse a compute dtype the family has no rules for; elsewhere torch's own dtype rules apply."""
    if dtype is not None and family in SUPPORTED_DTYPES and dtype not in SUPPORTED_DTYPES[family]:
        accepted = ", ".join(_dtype_name(d) for d in SUPPORTED_DTYPES[family])
        raise ValueError(f"autocast on {family!r} supports dtype {accepted}; got {dtype}")
