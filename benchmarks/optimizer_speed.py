"""Optimizer step time on bf16 weights: mixprec's CompensatedOptimizer against its peers, in one process.

Configs (each on its own copy of the same bf16 parameters, all fed the same gradients):

- ``torch-fused``: ``torch.optim.AdamW(fused=True)`` (``foreach=True`` on a CPU): the baseline, no
  compensation (bf16 moments, round to nearest);
- ``mixprec-kahan`` / ``mixprec-stochastic``: ``mixprec.CompensatedOptimizer(AdamW, method)``;
- ``optimi-kahan``: torch-optimi's ``AdamW(kahan_sum=True)``, the Kahan peer;
- ``mixprec-int8``: ``CompensatedOptimizer(AdamW, "nearest", state_format="int8")``: 8-bit moments,
  round to nearest as the peer does by default;
- ``torchao-adamw8bit``: ``torchao.optim.AdamW8bit`` (its step is ``torch.compile``-d on the first call,
  which the warm-up pays; it is warmed up after the others' first round, so a time limit during the
  compile keeps their rounds, and its rows have one round fewer, paired with the same rounds of
  ``torch-fused``);
- opt-in with ``--configs``: ``mixprec-int8-fp32`` and ``torchao-adamw8bit-fp32``, the two 8-bit ones on
  fp32 copies of the weights and gradients (8-bit Adam's common use; ``MixedPrecisionOptimizer``'s masters
  with ``state_format`` step the same way). Their ratio is still to bf16 ``torch-fused``.

A config whose package does not import is skipped with the reason; one that fails to build or step gets its
error in the JSON and the others go on. The parameters are a GPT's weight shapes (per block a ``(3d, d)``,
``(d, d)``, ``(4d, d)`` and ``(d, 4d)`` matrix and two ``(d,)`` norms): the default ``--width 2048 --layers
8`` is 403M parameters. After ``--warmup`` untimed steps per config, ``--rounds`` rounds each time
``--steps`` steps of every config in turn (interleaved, so drift on the machine hits all alike; wall clock
between two synchronizes, per step). Reported per config: the median of the rounds' per-step times, their
min/max and quartiles, and the ratio to ``torch-fused`` paired round by round (median, min, max). The JSON
is rewritten after the warm-up and every round (and on SIGTERM), so a run cut short keeps its rounds
(``partial`` says why); ``--budget-s`` stops starting rounds that would not fit. First (unless
``--no-bitwise``), :func:`bitwise_check` compares ``mixprec-kahan``'s steps on the first block's shapes with
torch's fused kernel on fp32 copies, bit for bit (``bitwise_vs_torch_fused`` in the JSON), and
:func:`coded_check` the int8 / fp8 one-pass kernel against the chunked engine (mismatch counts per kind,
``coded_vs_chunked_engine``, on width 256's block and a tensor whose last block is short;
``int8-nearest-fp32`` on fp32 weights).

    python benchmarks/optimizer_speed.py --device cuda --json optim.json           # 403M on a GPU
    python benchmarks/optimizer_speed.py --device cpu --width 64 --layers 2 --configs torch-fused,optimi-kahan
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

CONFIGS = (
    "torch-fused",
    "mixprec-kahan",
    "mixprec-stochastic",
    "optimi-kahan",
    "mixprec-int8",
    "torchao-adamw8bit",
)
#: Opt-in (``--configs``): the 8-bit peers on fp32 weights and gradients (a copy of the same start), as
#: 8-bit Adam is most often run, and as ``MixedPrecisionOptimizer``'s fp32 masters with ``state_format``
#: step
FP32_CONFIGS = ("mixprec-int8-fp32", "torchao-adamw8bit-fp32")
#: Configs whose first step compiles (seconds): warmed up after the first round, so that a time limit
#: during the compile still leaves the others' rounds
COMPILES = ("torchao-adamw8bit", "torchao-adamw8bit-fp32")
LR, BETAS, WD = 1e-4, (0.9, 0.95), 0.1


def shapes(width: int, layers: int) -> list[tuple[int, ...]]:
    """A GPT's weight shapes: per block qkv, proj, the MLP's two and two norms."""
    d = width
    block = [(3 * d, d), (d, d), (4 * d, d), (d, 4 * d), (d,), (d,)]
    return block * layers


def build(config: str, params: list[torch.Tensor], device: torch.device) -> Any:
    """The optimizer of ``config`` on ``params``; ImportError when its package is missing."""
    config = config.removesuffix("-fp32")  # the same optimizer; Run gave it fp32 params
    adamw: Callable[..., torch.optim.Optimizer] = torch.optim.AdamW
    kwargs: dict[str, Any] = {"lr": LR, "betas": BETAS, "weight_decay": WD}
    if config == "torch-fused":
        flag = {"fused": True} if device.type == "cuda" else {"foreach": True}
        return adamw(params, **kwargs, **flag)
    if config.startswith("mixprec-"):
        from mixprec import CompensatedOptimizer

        if config == "mixprec-int8":
            return CompensatedOptimizer(adamw(params, **kwargs), "nearest", state_format="int8")
        return CompensatedOptimizer(adamw(params, **kwargs), config.removeprefix("mixprec-"))
    if config == "optimi-kahan":
        import optimi

        return optimi.AdamW(params, **kwargs, kahan_sum=True)
    if config == "torchao-adamw8bit":
        from torchao.optim import AdamW8bit

        return AdamW8bit(params, **kwargs)
    raise ValueError(f"unknown config {config!r}; known: {', '.join(CONFIGS + FP32_CONFIGS)}")


def bitwise_check(device: torch.device, dims: list[tuple[int, ...]], steps: int = 3) -> dict[str, Any]:
    """``CompensatedOptimizer``'s Kahan Adam/AdamW step against torch's own fused kernel (``_fused_adam_`` /
    ``_fused_adamw_``) on fp32 copies, step by step: before each step the reference takes ``fp32(w) +
    fp32(c)`` and the stored moments widened to fp32, after it rounds as the wrapper does (``w = rn(t)``,
    ``c = rn(t - w)``, the moments to their stored dtypes). Per case: values compared and how many differ
    (weights, buffers and both moments over all steps); on CUDA the step is the one-pass Triton kernel
    (``mixprec.optim._triton_adam``), elsewhere the chunked engine."""
    from mixprec import CompensatedOptimizer

    out: dict[str, Any] = {}
    cases = {
        "adamw-bf16-moments": (torch.optim.AdamW, BETAS, True),
        "adamw-fp32-second-moment": (torch.optim.AdamW, (0.9, 0.999), True),
        "adam-l2-decay": (torch.optim.Adam, BETAS, False),
    }
    for name, (cls, betas, decoupled) in cases.items():
        gen = torch.Generator(device=device).manual_seed(1)
        params = [torch.nn.Parameter(torch.randn(s, generator=gen, device=device).to(torch.bfloat16) * 0.02)
                  for s in dims]  # fmt: skip
        opt = CompensatedOptimizer(cls(params, lr=LR, betas=betas, weight_decay=WD), "kahan")
        kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
        mismatched = compared = 0
        for step in range(1, steps + 1):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen, device=device).to(torch.bfloat16) * 1e-3
            comps = list(opt.compensation)
            states = [opt.optimizer.state.get(p, {}) for p in params]
            t = [p.float() + c.float() for p, c in zip(params, comps, strict=True)]
            m = [
                s["exp_avg"].to(torch.float32, copy=True) if s else torch.zeros_like(x)
                for s, x in zip(states, t, strict=True)
            ]
            v = [
                s["exp_avg_sq"].to(torch.float32, copy=True) if s else torch.zeros_like(x)
                for s, x in zip(states, t, strict=True)
            ]
            counters = [torch.tensor(float(step), device=device) for _ in params]
            kernel(t, [p.grad.float() for p in params], m, v, [], counters, lr=LR, beta1=betas[0],
                   beta2=betas[1], eps=1e-8, weight_decay=WD, amsgrad=False, maximize=False)  # fmt: skip
            opt.step()
            for p, c, x, mx, vx in zip(params, comps, t, m, v, strict=True):
                state = opt.optimizer.state[p]
                w_ref = x.to(torch.bfloat16)
                pairs = [(p, w_ref), (c, (x - w_ref.float()).to(torch.bfloat16))]
                pairs += [(state["exp_avg"], mx.to(state["exp_avg"].dtype))]
                pairs += [(state["exp_avg_sq"], vx.to(state["exp_avg_sq"].dtype))]
                for got, want in pairs:
                    mismatched += int((got.detach() != want).sum())
                    compared += got.numel()
        out[name] = {"steps": steps, "values": compared, "mismatched": mismatched}
    return out


def coded_check(device: torch.device, dims: list[tuple[int, ...]], steps: int = 3) -> dict[str, Any]:
    """``CompensatedOptimizer``'s one-pass step with ``state_format`` int8 / fp8 (the Triton kernel on CUDA,
    ``mixprec.optim._triton_adam``) against the chunked engine (``MIXPREC_FUSED_OPTIM=0``: decode, torch's
    fused kernel on fp32 copies, encode) on copies of the same params and gradients, step by step. Per case:
    values compared and how many differ, per kind (weights, Kahan buffers, codes, scales) over all steps,
    and whether the kernel ran (False off CUDA or without Triton: then both sides are the engine)."""
    import os

    from mixprec import CompensatedOptimizer
    from mixprec.optim import _triton_adam

    out: dict[str, Any] = {}
    kinds = ("weights", "kahan", "codes", "scales")
    ran: list[int] = []
    real = _triton_adam.step_unit

    def counted(unit: Any, *args: Any) -> None:
        ran.append(1)
        real(unit, *args)

    cases = [
        ("int8", "kahan", torch.bfloat16),
        ("int8", "nearest", torch.bfloat16),
        ("fp8", "kahan", torch.bfloat16),
    ]
    cases.append(("int8", "nearest", torch.float32))  # fp32 weights (masters): the kernel's W_F32 variant
    for fmt, method, dtype in cases:
        gen = torch.Generator(device=device).manual_seed(2)
        start = [torch.randn(s, generator=gen, device=device).to(dtype) * 0.02 for s in dims]
        sides: list[tuple[list[torch.nn.Parameter], Any]] = []
        ran.clear()
        _triton_adam.step_unit = counted  # type: ignore[assignment]
        before = os.environ.get(_triton_adam.ENV_SWITCH)
        try:
            for switch in ("1", "0"):
                os.environ[_triton_adam.ENV_SWITCH] = switch
                params = [torch.nn.Parameter(p.clone()) for p in start]
                inner = torch.optim.AdamW(params, lr=LR, betas=BETAS, weight_decay=WD)
                sides.append((params, CompensatedOptimizer(inner, method, state_format=fmt)))
            counts = dict.fromkeys(kinds, 0)
            compared = dict.fromkeys(kinds, 0)
            for _ in range(steps):
                grads = [torch.randn(p.shape, generator=gen, device=device).to(dtype) * 1e-3
                         for p in start]  # fmt: skip
                for switch, (params, opt) in zip(("1", "0"), sides, strict=True):
                    os.environ[_triton_adam.ENV_SWITCH] = switch
                    for p, g in zip(params, grads, strict=True):
                        p.grad = g
                    opt.step()
                (fast, fast_opt), (slow, slow_opt) = sides
                pairs = [("weights", a, b) for a, b in zip(fast, slow, strict=True)]
                pairs += [
                    ("kahan", a, b) for a, b in zip(fast_opt.compensation, slow_opt.compensation, strict=True)
                ]
                for a, b in zip(fast, slow, strict=True):
                    sa, sb = fast_opt.optimizer.state[a], slow_opt.optimizer.state[b]
                    pairs += [
                        ("scales" if k.endswith("_scale") else "codes", sa[k], sb[k])
                        for k in sa
                        if k != "step"
                    ]
                for kind, a, b in pairs:
                    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
                    counts[kind] += int((a.detach().view(bits) != b.detach().view(bits)).sum())
                    compared[kind] += a.numel()
        finally:
            _triton_adam.step_unit = real  # type: ignore[assignment]
            if before is None:
                os.environ.pop(_triton_adam.ENV_SWITCH, None)
            else:
                os.environ[_triton_adam.ENV_SWITCH] = before
        out[f"{fmt}-{method}" + ("-fp32" if dtype == torch.float32 else "")] = {
            "steps": steps,
            "kernel_ran": bool(ran),
            "values": compared,
            "mismatched": counts,
        }
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Run:
    """One config: its parameters (a copy of the shared start), their shared gradients, its optimizer."""

    def __init__(
        self, config: str, start: list[torch.Tensor], grads: list[torch.Tensor], device: torch.device
    ):
        self.config, self.device = config, device
        dtype = torch.float32 if config.endswith("-fp32") else start[0].dtype
        self.params = [p.to(dtype, copy=True).requires_grad_(True) for p in start]
        for p, g in zip(self.params, grads, strict=True):
            p.grad = g.to(dtype)  # read only by the step: every config steps the same gradients
        self.optimizer = build(config, self.params, device)
        self.times_ms: dict[int, float] = {}  # round index -> the mean step time of that round

    def step(self, count: int) -> float:
        _sync(self.device)
        begin = time.perf_counter()
        for _ in range(count):
            self.optimizer.step()
        _sync(self.device)
        return (time.perf_counter() - begin) * 1e3 / count


def _quantiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"median_ms": None, "min_ms": None, "max_ms": None, "q25_ms": None, "q75_ms": None}
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
    return {
        "median_ms": statistics.median(values),
        "min_ms": min(values),
        "max_ms": max(values),
        "q25_ms": q[0],
        "q75_ms": q[2],
    }


def summary(
    runs: dict[str, Run], meta: dict[str, Any], errors: dict[str, str], skipped: dict[str, str]
) -> dict:
    """The JSON: meta, and per config its round times, quantiles and paired ratio to torch-fused."""
    base = runs.get("torch-fused")
    rows = []
    for name, run in runs.items():
        times = list(run.times_ms.values())
        row: dict[str, Any] = {"config": name, "rounds_ms": run.times_ms, **_quantiles(times)}
        paired = [i for i in run.times_ms if base is not None and i in base.times_ms]
        if base is not None and paired:
            ratios = [run.times_ms[i] / base.times_ms[i] for i in paired]
            row.update(vs_torch_fused=statistics.median(ratios), vs_low=min(ratios), vs_high=max(ratios))
        else:
            row.update(vs_torch_fused=None, vs_low=None, vs_high=None)
        rows.append(row)
    return {"meta": meta, "rows": rows, "errors": errors, "skipped": skipped}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8, help="blocks (8 at width 2048: 403M parameters)")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5, help="steps per config per round")
    parser.add_argument("--budget-s", type=float, default=None, help="start no round past this many seconds")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--no-bitwise", dest="bitwise_shapes", action="store_false",
        help="skip the bitwise checks (mixprec-kahan against torch's fused kernel on fp32 copies, the "
        "int8/fp8 kernel against the chunked engine)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    started = time.perf_counter()
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS + FP32_CONFIGS]
    if unknown or not configs:
        parser.error(f"--configs: unknown {unknown or configs!r}; known: {', '.join(CONFIGS + FP32_CONFIGS)}")
    for name in ("width", "layers", "rounds", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    device = torch.device(args.device)
    gen = torch.Generator(device=device).manual_seed(0)
    dims = shapes(args.width, args.layers)
    start = [torch.randn(s, generator=gen, device=device, dtype=torch.bfloat16) * 0.02 for s in dims]
    grads = [torch.randn(s, generator=gen, device=device, dtype=torch.bfloat16) * 1e-3 for s in dims]
    meta: dict[str, Any] = {
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "torch": torch.__version__,
        "params": sum(p.numel() for p in start),
        "dtype": "bfloat16",
        "width": args.width,
        "layers": args.layers,
        "warmup": args.warmup,
        "rounds_planned": args.rounds,
        "steps_per_round": args.steps,
    }
    if args.bitwise_shapes:  # the first block's shapes: every kind of tensor, a few seconds
        try:
            meta["bitwise_vs_torch_fused"] = bitwise_check(device, dims[:6])
        except Exception as exc:  # the timing still runs
            meta["bitwise_vs_torch_fused"] = {"error": f"{type(exc).__name__}: {exc}"}
        print(
            f"optimizer_speed: bitwise vs torch's fused kernel: {meta['bitwise_vs_torch_fused']}",
            file=sys.stderr,
        )
        try:
            meta["coded_vs_chunked_engine"] = coded_check(device, [*shapes(256, 1), (1000, 3)])
        except Exception as exc:  # the timing still runs
            meta["coded_vs_chunked_engine"] = {"error": f"{type(exc).__name__}: {exc}"}
        print(
            f"optimizer_speed: int8/fp8 kernel vs the chunked engine: {meta['coded_vs_chunked_engine']}",
            file=sys.stderr,
        )
    runs: dict[str, Run] = {}
    errors: dict[str, str] = {}
    skipped: dict[str, str] = {}
    state: dict[str, str | None] = {"partial": "stopped before the first round"}

    def write() -> None:
        done = max((len(r.times_ms) for r in runs.values()), default=0)
        out = summary(runs, {**meta, "rounds_done": done}, errors, skipped)
        out["partial"] = state["partial"]
        if args.json is not None:
            args.json.write_text(json.dumps(out, indent=1))

    def on_term(signum: int, frame: object) -> None:
        state["partial"] = (
            f"stopped by SIGTERM (its time limit): {state['partial'] or 'after the last round'}"
        )
        write()
        sys.exit(124)

    with contextlib.suppress(ValueError):  # not the main thread: no handler
        signal.signal(signal.SIGTERM, on_term)

    def warm(config: str) -> None:
        try:
            run = Run(config, start, grads, device)
            for _ in range(args.warmup):
                run.step(1)
            runs[config] = run
        except ImportError as exc:
            skipped[config] = f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # one failing config must not stop the others
            errors[config] = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[-1]}"
        outcome = "ready" if config in runs else skipped.get(config) or errors[config]
        print(f"optimizer_speed: {config}: {outcome}", file=sys.stderr)
        write()

    late = [c for c in configs if c in COMPILES]
    for config in configs:
        if config not in late:
            warm(config)
    round_s = None
    for index in range(args.rounds):
        if index == 1 or not runs or args.rounds == 1:  # after the others' first round, if there is one
            for config in late:
                warm(config)
            late = []
        elapsed = time.perf_counter() - started
        if args.budget_s is not None and round_s is not None and elapsed + round_s > args.budget_s:
            state["partial"] = f"--budget-s {args.budget_s:g}: {index} of {args.rounds} rounds fit"
            break
        begin = time.perf_counter()
        order = list(runs.values())
        order = order[index % len(order) :] + order[: index % len(order)] if order else order
        for run in order:  # a rotating order: no config always follows the same one
            try:
                run.times_ms[index] = run.step(args.steps)
            except Exception as exc:
                errors[run.config] = f"{type(exc).__name__}: {exc}"
                del runs[run.config]
        round_s = time.perf_counter() - begin
        state["partial"] = None if index + 1 == args.rounds else f"{index + 1} of {args.rounds} rounds so far"
        write()
    write()
    for row in summary(runs, meta, errors, skipped)["rows"]:
        ratio = "" if row["vs_torch_fused"] is None else f"  {row['vs_torch_fused']:.2f}x torch-fused"
        median = "-" if row["median_ms"] is None else f"{row['median_ms']:.3f} ms"
        print(f"{row['config']:<20} {median}{ratio}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
