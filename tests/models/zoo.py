"""Third-party model zoo: tiny, randomly initialised models nobody here wrote, and the oracle harness.

Every case is built from a fixed seed, so two builds are identical. :func:`run_case` runs one forward
(+ loss + backward in train mode, a ``no_grad`` forward in eval mode) inside a region and returns every
tensor the comparison needs: the loss, the logits and every parameter gradient (None where the
parameter got no gradient). :func:`reference` gives the same under ``torch.autocast``: in this process,
or, when the installed engine says it registers process-wide kernels
(``mixprec.autocast_engine_registers_kernels``), from one child process that computes every case once
and never imports mixprec (in this process torch.autocast would run mixprec's kernels, and the
comparison would be mixprec against itself).

Nothing is downloaded: ``HF_HUB_OFFLINE=1`` is set before transformers is imported.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch

ROOT = Path(__file__).resolve().parents[2]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

Batch = dict[str, Any]
Step = Callable[[torch.nn.Module, Batch], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Case:
    """A model, its inputs and its step: ``step(model, batch) -> (loss, logits)``."""

    build: Callable[[], torch.nn.Module]
    batch: Callable[[torch.Generator], Batch]
    step: Step


def hf_step(model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """A transformers model called with its batch as keywords (labels included): (loss, logits)."""
    out = model(**batch)
    return out.loss, out.logits


def oracle_in_subprocess() -> bool:
    """True when the installed engine registers process-wide kernels (torch.autocast would run them)."""
    import mixprec  # not at module level: the oracle child process must never import the engine

    return bool(getattr(mixprec, "autocast_engine_registers_kernels", False))


def case(name: str) -> Case:
    """The case called ``name``: torch's modules first, then transformers (imported only if needed)."""
    from tests.models import zoo_torch

    if name in zoo_torch.CASES:
        return zoo_torch.CASES[name]
    from tests.models import zoo_hf

    return zoo_hf.CASES[name]


def run_case(name: str, region: Any, train: bool, seed: int = 0) -> dict[str, torch.Tensor | None]:
    """Build case ``name`` from ``seed`` and run one step in ``region``.

    Returns ``{"loss": ..., "logits": ..., "grad.<param>": ... or None}`` plus ``"grad.input.<i>"``
    for the inputs that require grad (no grads in eval mode, where the step runs under ``no_grad``).
    """
    spec = case(name)
    torch.manual_seed(seed)
    model = spec.build()
    model.train(train)
    batch = spec.batch(torch.Generator().manual_seed(seed))
    torch.manual_seed(seed)  # any sampling in the step (none with dropout 0) starts from the same state
    if not train:
        with torch.no_grad(), region:
            loss, logits = spec.step(model, batch)
        return {"loss": loss, "logits": logits}
    with region:
        loss, logits = spec.step(model, batch)
    loss.backward()
    result: dict[str, torch.Tensor | None] = {"loss": loss.detach(), "logits": logits.detach()}
    for pname, p in model.named_parameters():
        result[f"grad.{pname}"] = p.grad
    inputs = [t for v in batch.values() for t in (v if isinstance(v, tuple) else (v,))]
    for i, t in enumerate(t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad):
        result[f"grad.input.{i}"] = t.grad
    return result


def reference(name: str, dtype: torch.dtype, train: bool) -> dict[str, torch.Tensor | None]:
    """:func:`run_case` under ``torch.autocast("cpu", dtype)``: from a child process if needed."""
    if not oracle_in_subprocess():
        return run_case(name, torch.autocast("cpu", dtype=dtype), train)
    value = _all_references()[_key(name, dtype, train)]
    if isinstance(value, str):
        raise RuntimeError(
            f"torch.autocast raised on {_key(name, dtype, train)} in the oracle process: {value}"
        )
    return value


def references_in_subprocess(keys: list[str]) -> dict[str, dict | str]:
    """``key -> run_case result`` (or the error torch.autocast raised, as text) from one fresh
    interpreter that never imports mixprec. Keys are ``"name/bf16/1"`` (train) or ``"all"``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "references.pt"
        cmd = [sys.executable, "-m", "tests.models.zoo", str(out), *keys]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"the oracle process failed:\n{proc.stderr[-4000:]}")
        return torch.load(out)


@functools.cache
def _all_references() -> dict[str, dict | str]:
    # One child for every case: a child per test would cost an interpreter and imports each time.
    return references_in_subprocess(["all"])


def _key(name: str, dtype: torch.dtype, train: bool) -> str:
    dtype_name = next(k for k, v in DTYPES.items() if v == dtype)
    return f"{name}/{dtype_name}/{int(train)}"


def assert_bitwise(expected: dict, actual: dict) -> None:
    """Every entry identical: same keys, dtype, shape, strides and bits (None only where None).

    Bits, not ``torch.equal``: NaN matches NaN at the same place and -0.0 does not match 0.0.
    """
    assert expected.keys() == actual.keys()
    problems = []
    for key, e in expected.items():
        a = actual[key]
        if e is None or a is None:
            if (e is None) != (a is None):
                problems.append(f"{key}: expected {_kind(e)}, got {_kind(a)}")
            continue
        if e.dtype != a.dtype or e.shape != a.shape:
            problems.append(f"{key}: expected {e.dtype}{list(e.shape)}, got {a.dtype}{list(a.shape)}")
        elif not _same_bits(e, a):
            diff = (e.double() - a.double()).abs().nan_to_num(float("inf")).max().item()
            problems.append(f"{key}: {e.dtype} values differ, max |diff| {diff:.3g}")
        elif e.stride() != a.stride():
            problems.append(f"{key}: expected strides {e.stride()}, got {a.stride()}")
    assert not problems, f"{len(problems)} of {len(expected)} differ:\n" + "\n".join(problems[:20])


_SAME_WIDTH_INT = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


def _same_bits(e: torch.Tensor, a: torch.Tensor) -> bool:
    if not e.is_floating_point():
        return torch.equal(e, a)
    width = _SAME_WIDTH_INT[e.element_size()]
    return torch.equal(e.view(width), a.view(width))


def _kind(t: torch.Tensor | None) -> str:
    return "None" if t is None else f"a {t.dtype} tensor"


def _child_main(argv: list[str]) -> None:
    # The child never imports mixprec: whatever the engine registers, torch.autocast here is torch's own.
    from tests.models import zoo_hf, zoo_torch

    torch.set_num_threads(1)
    out, keys = argv[0], argv[1:]
    if keys == ["all"]:
        names = [*zoo_torch.CASES, *zoo_hf.CASES]
        keys = [f"{n}/{d}/{t}" for n in names for d in DTYPES for t in (0, 1)]
    results: dict[str, dict | str] = {}
    for key in keys:
        name, dtype_name, train = key.split("/")
        try:
            results[key] = run_case(name, torch.autocast("cpu", dtype=DTYPES[dtype_name]), train == "1")
        except Exception as e:  # recorded: the parent raises it for the test that asks for this case
            results[key] = f"{type(e).__name__}: {e}"
    assert "mixprec" not in sys.modules, "the oracle process imported mixprec"
    torch.save(results, out)


if __name__ == "__main__":
    _child_main(sys.argv[1:])
