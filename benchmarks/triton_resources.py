"""Registers, spills and occupancy of every Triton kernel launch mixprec makes, compiled for a GPU on a CPU.

The launches are recorded, not listed: the fused quantizers (every fused format, with and without the
transposed copy), ``scaled_cast``, ``tensor_amax``, the rowwise post-scale and the one-pass Adam steps
(nearest, Kahan, stochastic; moments in torch's layout, int8 and fp8) run under Triton's CPU interpreter
on small CPU tensors, and each distinct launch (kernel, argument types, compile-time constants,
``num_warps``) is compiled for the target (``--arch``, default sm_90: Hopper) with Triton's compiler and
its bundled ``ptxas -v``, whose report gives the registers per thread and the bytes spilled to local
memory. From the registers: resident blocks per SM (65,536 registers and at most 64 warps per SM on
sm_80..sm_120) and the share of the SM's warp slots they fill (occupancy). A launch whose constants
depend on the device (the fp8 state's ``RECIPROCAL``, CUDA's division) is recorded with the CPU's.
Computed, not timed: a kernel that spills or fills few warp slots is a candidate
for a device measurement, not a measured loss.

Needs a CUDA build of torch (Triton and its ptxas ship with it; no GPU)::

    PYTHONPATH=src .ci/.venv-cuda/bin/python benchmarks/triton_resources.py [--arch 90] [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

REGISTERS_PER_SM, WARPS_PER_SM = 65536, 64
_TYPES = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.float64: "fp64",
    torch.int16: "i16",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.uint8: "u8",
    torch.int8: "i8",
    torch.float8_e4m3fn: "fp8e4nv",
    torch.float8_e5m2: "fp8e5",
}
_OPTIONS = ("num_warps", "num_stages")
#: Kernels mixprec never launches: they exist for the tests to run a device function alone.
TEST_ONLY = {("optim._triton_adam", "cast_e4m3")}


class _Recorder:
    """Stands in for a kernel of an interpreted kernel module: records each launch, then runs it."""

    #: Launches running now: the interpreter's own torch ops on the arguments are not the host's.
    inside = 0

    def __init__(self, module: str, name: str, fn: Any, launches: dict[tuple, dict[str, Any]]) -> None:
        self.module, self.name, self.fn, self.launches = module, name, fn, launches

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        def launch(*args: Any, **kwargs: Any) -> Any:
            signature = dict(zip(self.fn.arg_names, (_type(a) for a in args), strict=False))
            constexprs = {k: v for k, v in kwargs.items() if k not in _OPTIONS}
            options = {k: v for k, v in kwargs.items() if k in _OPTIONS}
            key = (self.module, self.name, tuple(signature.items()), repr(sorted(constexprs.items())),
                   tuple(sorted(options.items())))  # fmt: skip
            self.launches.setdefault(
                key,
                {"module": self.module, "kernel": self.name, "signature": signature,
                 "constexprs": constexprs, "options": options, "count": 0},
            )["count"] += 1  # fmt: skip
            _Recorder.inside += 1
            try:
                return self.fn[grid](*args, **kwargs)
            finally:
                _Recorder.inside -= 1

        return launch


def _type(arg: Any) -> str:
    if isinstance(arg, torch.Tensor):
        return "*" + _TYPES[arg.dtype]
    if isinstance(arg, bool):
        return "i1"
    if isinstance(arg, int):
        return "i32" if -(2**31) <= arg < 2**31 else "i64"
    if isinstance(arg, float):
        return "fp32"
    raise TypeError(f"no Triton type for a kernel argument of type {type(arg).__name__}")


@contextmanager
def _recording(loaders: dict[str, Callable[[bool], Any]]) -> Iterator[dict[tuple, dict[str, Any]]]:
    """Every ``@triton.jit`` kernel of each interpreted kernel module replaced by a :class:`_Recorder`."""
    launches: dict[tuple, dict[str, Any]] = {}
    saved: list[tuple[Any, str, Any]] = []
    interpret = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"  # CPU tensors take the kernels only under the interpreter
    for module_name, load in loaders.items():
        module = load(True)
        for name, fn in vars(module).items():
            if type(fn).__name__ == "InterpretedFunction" and not name.startswith("_"):
                saved.append((module, name, fn))
                setattr(module, name, _Recorder(module_name, name, fn, launches))
    try:
        yield launches
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)
        if interpret is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = interpret


def kernel_names(loaders: dict[str, Callable[[bool], Any]] | None = None) -> set[tuple[str, str]]:
    """``(module, kernel)`` of every public ``@triton.jit`` kernel in mixprec's kernel modules that mixprec
    launches (all but :data:`TEST_ONLY`)."""
    loaders = _loaders() if loaders is None else loaders
    return {
        (module_name, name)
        for module_name, load in loaders.items()
        for name, fn in vars(load(False)).items()
        if type(fn).__name__ == "JITFunction" and not name.startswith("_")
    } - TEST_ONLY


def _loaders() -> dict[str, Callable[[bool], Any]]:
    from mixprec.lowbit import triton_quantize
    from mixprec.optim import _triton_adam

    return {"lowbit.triton_quantize": triton_quantize._kernels, "optim._triton_adam": _triton_adam._kernels}


def _run_every_kernel() -> None:
    """Each kernel launch mixprec makes, at small sizes on CPU tensors (the interpreter runs them)."""
    from mixprec.lowbit import triton_quantize
    from mixprec.lowbit.formats import FORMATS
    from mixprec.optim import CompensatedOptimizer, MixedPrecisionOptimizer

    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 384, generator=g).to(torch.bfloat16)
    for name in sorted(FORMATS):
        if triton_quantize.format_supported(name):
            for transpose in (False, True):
                triton_quantize.quantize(x, name, transpose=transpose)
    triton_quantize.scaled_cast(x, torch.tensor(2.0), "fp8_tensorwise", transpose=True)
    stats = torch.zeros(2, 3)  # a dynamic per-tensor layer's cast: the scale and stats in the kernel
    triton_quantize.dynamic_cast(
        x, "fp8_tensorwise", transpose=True, amax_out=stats[0, 0], scale_out=stats[1, 0]
    )
    history = torch.ones(3, 16)  # a delayed layer's: the scale from the history, the push (one program)
    triton_quantize.delayed_cast(
        x, "fp8_tensorwise", history[0], transpose=True, amax_out=stats[0, 0], scale_out=stats[1, 0]
    )
    triton_quantize.tensor_amax(x)
    triton_quantize.post_scale_(x.clone(), torch.rand(256) + 0.5, torch.rand(384) + 0.5)
    for method, state_format in itertools.product(("nearest", "kahan", "stochastic"), (None, "int8", "fp8")):
        p = torch.nn.Parameter(torch.randn(300, generator=g).to(torch.bfloat16))
        inner = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.1)
        opt = CompensatedOptimizer(inner, method, state_format=state_format)
        for _ in range(2):  # the first step is the chunked engine's (see optim._triton_adam)
            p.grad = torch.randn(300, generator=g).to(torch.bfloat16)
            opt.step()
    for state_format in ("bf16", "int8", "fp8"):  # fp32 master weights: both kernels' fp32-weight variants
        p = torch.nn.Parameter(torch.randn(300, generator=g).to(torch.bfloat16))
        masters = MixedPrecisionOptimizer(
            torch.optim.AdamW([p], lr=1e-3), scaler=None, state_format=state_format
        )
        for _ in range(2):
            p.grad = torch.randn(300, generator=g).to(torch.bfloat16)
            masters.step()


def _ptxas(ptx: str, arch: int) -> dict[str, int]:
    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    suffix = "a" if arch == 90 else ""  # Triton targets sm_90a on Hopper
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        done = subprocess.run(
            [str(ptxas), f"-arch=sm_{arch}{suffix}", "-v", str(src), "-o", str(Path(tmp) / "k.cubin")],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
    report = done.stdout + done.stderr
    found = {
        "registers": re.search(r"Used (\d+) registers", report),
        "spill_stores": re.search(r"(\d+) bytes spill stores", report),
        "spill_loads": re.search(r"(\d+) bytes spill loads", report),
    }
    if found["registers"] is None:
        raise RuntimeError(f"ptxas reported no register count:\n{report}")
    return {k: int(m.group(1)) if m else 0 for k, m in found.items()}


def measure(arch: int) -> list[dict[str, Any]]:
    """One row per distinct launch: the kernel, its constants, warps, registers, spills and occupancy."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    loaders = _loaders()
    with _recording(loaders) as launches:
        _run_every_kernel()
    rows = []
    for launch in launches.values():
        fn = getattr(loaders[launch["module"]](False), launch["kernel"])
        signature = dict(launch["signature"])
        signature.update(dict.fromkeys(launch["constexprs"], "constexpr"))
        options = {"num_warps": 4, **launch["options"]}
        source = ASTSource(fn=fn, signature=signature, constexprs=launch["constexprs"])
        ptx = compile(source, target=GPUTarget("cuda", arch, 32), options=options).asm["ptx"]
        row = {k: v for k, v in launch.items() if k != "count"}
        row.update(num_warps=options["num_warps"], **_ptxas(ptx, arch))
        threads = 32 * row["num_warps"]
        blocks = min(REGISTERS_PER_SM // (row["registers"] * threads), WARPS_PER_SM // row["num_warps"])
        row.update(blocks_per_sm=blocks, occupancy=blocks * row["num_warps"] / WARPS_PER_SM)
        rows.append(row)
    return rows


def _constants(row: dict[str, Any]) -> str:
    return " ".join(f"{k}={getattr(v, 'name', v)}" for k, v in row["constexprs"].items() if k != "PRECISE")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability as major*10+minor (90)")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args(argv)
    if torch.version.cuda is None:
        sys.exit(f"needs a CUDA build of torch (Triton and ptxas ship with it); this is {torch.__version__}")
    rows = measure(args.arch)
    print(f"sm_{args.arch}: {len(rows)} distinct launches")
    print(
        f"{'kernel':10} {'warps':>5} {'regs':>4} {'spill st/ld B':>13} {'blocks/SM':>9} {'occ':>5}  constants"
    )
    for r in sorted(rows, key=lambda r: (r["module"], r["kernel"], _constants(r))):
        spill = f"{r['spill_stores']}/{r['spill_loads']}"
        print(f"{r['kernel']:10} {r['num_warps']:5} {r['registers']:4} {spill:>13} {r['blocks_per_sm']:9} "
              f"{r['occupancy']:5.2f}  {_constants(r)}")  # fmt: skip
    if args.json:
        data = [
            {**r, "constexprs": {k: getattr(v, "name", v) for k, v in r["constexprs"].items()}} for r in rows
        ]
        args.json.write_text(json.dumps({"arch": args.arch, "rows": data}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
