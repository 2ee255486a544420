"""Kernel launches and host syncs per optimizer step on fake CUDA: mixprec's fused Adam beside torch's.

Runs on a CUDA build of torch without a GPU (the fake-CUDA tier's harness, ``tests/fake_cuda``): bf16
parameters of a GPT's weight shapes (``benchmarks/optimizer_speed.py``'s; the default ``--width 2048
--layers 8`` is 403M parameters, which ``FakeTensorMode`` holds without allocating) are stepped
``--steps`` times by each config, and the harness's recorder counts, per step, the ops the host issues to
the device that run a kernel (views and bare allocations left out; a ``_foreach_*`` or fused op over a
long list may launch a few kernels on a GPU, torch's too) and the host syncs. Counts of dispatched ops,
not timings: they hold on any machine. Configs:

- ``torch-fused``: ``torch.optim.AdamW(fused=True)`` (bf16 moments, round to nearest);
- ``mixprec-kahan`` / ``mixprec-stochastic``: ``CompensatedOptimizer(AdamW, method)``;
- ``mixprec-int8``: ``CompensatedOptimizer(AdamW, "nearest", state_format="int8")``;

each mixprec config with ``skip_nonfinite=False`` (as torch: no check) and, in a ``+guard`` row, the default
``True`` (one read of the gradient norms per step).

FakeTensors never take mixprec's Triton paths (a kernel needs storage), so the counts above are the
chunked engine's. ``--interpreted`` counts the path a GPU takes instead: real bf16 CPU tensors of the same
shapes (at ``--width 64`` by default: one launch per tensor does not depend on its size) under Triton's
CPU interpreter, where CPU tensors take the Triton kernels; per step, the Triton launches plus the torch
ops that would run a kernel (the fake tier's rule: not a view, not a bare allocation; not the
interpreter's own copies of a launch's arguments). Two ops per tensor are the interpreter's alone: the
bias corrections ``1 - beta**step`` (``pow``, ``rsub``), which a GPU kernel computes itself with
libdevice's ``powf``; a GPU step is the count less two per tensor.

    PYTHONPATH=src .ci/.venv-cuda/bin/python benchmarks/fake_cuda_launches.py [--width 2048 --layers 8]
    PYTHONPATH=src .ci/.venv-cuda/bin/python benchmarks/fake_cuda_launches.py --interpreted
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from fake_cuda import loops
from fake_cuda.harness import _NO_KERNEL, fake_cuda
from torch.utils._python_dispatch import TorchDispatchMode

import mixprec

LR, BETAS, WD = 1e-4, (0.9, 0.95), 0.1  # benchmarks/optimizer_speed.py's


def _adamw(params: list[torch.Tensor], **flags: bool) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, betas=BETAS, weight_decay=WD, **flags)


def configs() -> dict[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer]]:
    """Each config's optimizer on the given params."""
    out: dict[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer]] = {
        "torch-fused": lambda ps: _adamw(ps, fused=True)
    }
    for name, method, fmt in (
        ("mixprec-kahan", "kahan", None),
        ("mixprec-stochastic", "stochastic", None),
        ("mixprec-int8", "nearest", "int8"),
    ):
        for guard in (False, True):
            out[name + ("+guard" if guard else "")] = lambda ps, m=method, f=fmt, g=guard: (
                mixprec.CompensatedOptimizer(_adamw(ps), m, state_format=f, skip_nonfinite=g)
            )
    return out


class _OpCount(TorchDispatchMode):
    """Counts the torch ops that would run a kernel (the fake tier's rule: not a view, not an allocation)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from triton_resources import _Recorder

        name = func.overloadpacket.__name__
        kernel = not (func.namespace in ("prim", "profiler") or func.is_view or name in _NO_KERNEL)
        if kernel and not _Recorder.inside:  # the interpreter's copies of a launch's arguments aside
            self.count += 1
        return func(*args, **(kwargs or {}))


def interpreted_launches(
    make: Callable[[list[torch.Tensor]], torch.optim.Optimizer], shapes: list[tuple[int, ...]], steps: int
) -> list[int]:
    """Torch ops plus Triton launches of each of ``steps`` steps on bf16 CPU params of ``shapes``, under
    Triton's interpreter (set by the caller), gradients set before the count."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from triton_resources import _loaders, _recording

    g = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(shape, generator=g).to(torch.bfloat16)) for shape in shapes]
    opt = make(ps)
    counts = []
    for _ in range(steps):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g).to(torch.bfloat16)
        with _recording(_loaders()) as launches, _OpCount() as ops:
            opt.step()
        counts.append(ops.count + sum(launch["count"] for launch in launches.values()))
    return counts


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=2048, help="model width (default 2048)")
    parser.add_argument("--layers", type=int, default=8, help="blocks (8 at width 2048: 403M parameters)")
    parser.add_argument(
        "--steps", type=int, default=3, help="steps per config (default 3); the first warms up"
    )
    parser.add_argument(
        "--configs", default=",".join(configs()), help="comma-separated configs (default all)"
    )
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument(
        "--interpreted", action="store_true",
        help="count the Triton path on CPU tensors under Triton's interpreter (default --width 64)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.interpreted and "--width" not in (argv if argv is not None else sys.argv):
        args.width = 64
    if torch.version.cuda is None:
        parser.error(f"needs a CUDA build of torch (this is {torch.__version__}): .ci/run's .ci/.venv-cuda")
    if args.steps < 2:
        parser.error(f"--steps must be at least 2 (the first step warms up); got {args.steps}")
    makers = configs()
    names = args.configs.split(",")
    unknown = [n for n in names if n not in makers]
    if unknown:
        parser.error(f"unknown configs {unknown}; known: {', '.join(makers)}")
    shapes = loops.gpt_shapes(args.width, args.layers)
    numel = sum(torch.Size(s).numel() for s in shapes)
    rows = []
    if args.interpreted:
        before = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1"
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for name in names:
                    counts = interpreted_launches(makers[name], shapes, args.steps)
                    rows.append({"config": name, "launches": counts})
        finally:
            if before is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = before
        print(f"per optimizer step under Triton's interpreter, {numel:,} bf16 parameters ({len(shapes)} "
              "tensors); first step (creates the state) / later steps")  # fmt: skip
        print("| config | torch ops + Triton launches / step |\n|---|---|")
        for row in rows:
            print(f"| {row['config']} | {row['launches'][0]} / {row['launches'][-1]} |")
        result = {"torch": torch.__version__, "numel": numel, "interpreted": True, "rows": rows}
        if args.json:
            args.json.write_text(json.dumps(result, indent=1) + "\n")
        return result
    with warnings.catch_warnings(), fake_cuda() as rec:
        warnings.simplefilter("ignore")
        for name in names:
            counts = loops.optimizer_launches(rec, makers[name], shapes, args.steps)
            rows.append({"config": name, "syncs": [s for s, _ in counts], "launches": [n for _, n in counts]})
    print(f"per optimizer step on fake CUDA, {numel:,} bf16 parameters ({len(shapes)} tensors), torch "
          f"{torch.__version__}; first step (creates the state) / later steps")  # fmt: skip
    print("| config | kernel launches / step | host syncs / step |\n|---|---|---|")
    for row in rows:
        launches, syncs = row["launches"], row["syncs"]
        print(f"| {row['config']} | {launches[0]} / {launches[-1]} | {syncs[0]} / {syncs[-1]} |")
    result = {"torch": torch.__version__, "numel": numel, "steps": args.steps, "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
