"""Low-bit optimizer states: bytes per parameter beside the peers, and what they cost in held-out loss.

``OMP_NUM_THREADS=1 python benchmarks/optimizer_state_bytes.py --json benchmarks/optimizer_state_bytes.json``

Part 1 builds one char-level transformer (the bench's ``lm`` workload model, CharGPT) per optimizer, takes
one step and counts the bytes of every tensor in the optimizer's state (a torchao state subclass counted by
its inner codes and scales), divided by the parameter count: mixprec's ``state_format`` on
``MixedPrecisionOptimizer`` (fp32 masters) and on ``CompensatedOptimizer`` (bf16 weights; its Kahan buffer,
2 bytes per weight, is listed apart), torch's AdamW, torchao's ``AdamW8bit`` / ``AdamW4bit`` / ``AdamWFp8``
and torch-optimi's ``AdamW`` (bf16 weights, Kahan summation).

Part 2 trains the ``lm`` workload (its data, model, schedule and held-out evaluation, at the small size set
below) for ``--steps`` steps and the ``teacher`` task (``benchmarks/lowbit_lm.py``'s noisy-teacher
classification: a 64-256-256-256-10 MLP, 8192 held-out rows, lr 1e-3) for ``--teacher-steps`` steps, both
with fp32 weights and seeds 0..``--seeds``-1, once per optimizer: torch's AdamW
(fp32 state), torchao's AdamW8bit and ``MixedPrecisionOptimizer(state_format=...)`` for each format. Each
format's held-out loss minus fp32-state AdamW's and minus AdamW8bit's, paired by seed (same data order and
initialization), is reported as a mean with a 95% t-interval.

torchao's optimizers ``torch.compile`` their per-parameter step; compiling takes minutes on a 2-core CPU, so
this script makes ``torch.compile`` return the function itself and they run the same step eagerly (their
arithmetic, not their speed, is compared here).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from mixprec.bench.workloads import WORKLOADS, Preset
from mixprec.optim import STATE_FORMATS, CompensatedOptimizer, MixedPrecisionOptimizer

LM = {"context": 64, "width": 96, "layers": 2, "heads": 2, "lr": 2e-3}
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def _tensor_bytes(value: Any) -> int:
    """Bytes a state value holds: a plain tensor's, or a tensor subclass's inner tensors (torchao's)."""
    if not torch.is_tensor(value):
        return 0
    flatten = getattr(value, "__tensor_flatten__", None)
    if flatten is not None and type(value) is not torch.Tensor and not isinstance(value, torch.nn.Parameter):
        names, _ = flatten()
        return sum(_tensor_bytes(getattr(value, name)) for name in names)
    return value.numel() * value.element_size()


def _state_bytes(optimizer: Any) -> int:
    inner = optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer
    return sum(_tensor_bytes(v) for state in inner.state.values() for v in state.values())


def _peers() -> dict[str, Callable[[list[torch.nn.Parameter]], Any]]:
    """The peer optimizers available here (each imported only if installed)."""
    out: dict[str, Callable[[list[torch.nn.Parameter]], Any]] = {}
    try:
        from torchao.optim import AdamW4bit, AdamW8bit, AdamWFp8

        out["torchao AdamW8bit"] = lambda ps: AdamW8bit(ps, lr=LM["lr"], betas=(0.9, 0.99), weight_decay=0.01)
        out["torchao AdamW4bit"] = lambda ps: AdamW4bit(ps, lr=LM["lr"], betas=(0.9, 0.99), weight_decay=0.01)
        out["torchao AdamWFp8"] = lambda ps: AdamWFp8(ps, lr=LM["lr"], betas=(0.9, 0.99), weight_decay=0.01)
    except ImportError:
        pass
    return out


def _lm(seed: int, steps: int, corpus: Any):
    spec = WORKLOADS["lm"]
    preset = Preset(steps, 0, steps, {**LM, "batch": 8, "corpus_bytes": 300_000, "eval_windows": 48})
    return spec.build(corpus, preset, seed, steps, torch.device("cpu"))


def _adamw(params: Any, lr: float = LM["lr"]) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.99), weight_decay=0.01)


def _one_step(model: torch.nn.Module, opt: Any, batch: Any, loss_fn: Any) -> None:
    x, y = batch
    dtype = next(model.parameters()).dtype
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        loss = loss_fn(model(x), y)
    (opt.backward(loss) if isinstance(opt, MixedPrecisionOptimizer) else loss.backward())
    opt.step()
    opt.zero_grad()


def bytes_table(corpus: Any) -> list[dict[str, Any]]:
    makers: dict[str, tuple[torch.dtype, Callable[[Any], Any]]] = {
        "torch AdamW (fp32 state)": (torch.float32, lambda m: _adamw(m.parameters()))
    }
    for fmt in [None, *STATE_FORMATS]:
        makers[f"mixprec masters state_format={fmt}"] = (
            torch.bfloat16,
            lambda m, f=fmt: MixedPrecisionOptimizer(_adamw(m.parameters()), scaler=None, state_format=f),
        )
        makers[f"mixprec Compensated(kahan) state_format={fmt}"] = (
            torch.bfloat16,
            lambda m, f=fmt: CompensatedOptimizer(_adamw(m.parameters()), "kahan", state_format=f),
        )
    for name, make in _peers().items():
        makers[name] = (torch.float32, lambda m, mk=make: mk(list(m.parameters())))
    try:
        import optimi

        makers["optimi AdamW (bf16, its Kahan buffer in state)"] = (
            torch.bfloat16,
            lambda m: optimi.AdamW(m.parameters(), lr=LM["lr"], betas=(0.9, 0.99), weight_decay=0.01),
        )
    except ImportError:
        pass
    rows = []
    for name, (dtype, make) in makers.items():
        wl = _lm(0, 1, corpus)
        model = wl.model.to(dtype)
        opt = make(model)
        _one_step(model, opt, next(wl.batches), wl.loss_fn)
        numel = sum(p.numel() for p in model.parameters())
        kahan = sum(c.numel() * c.element_size() for c in getattr(opt, "compensation", []))
        rows.append({"optimizer": name, "params": numel, "state_bytes_per_param": _state_bytes(opt) / numel,
                     "kahan_bytes_per_param": kahan / numel})  # fmt: skip
    return rows


def _teacher(seed: int, steps: int):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import lowbit_lm  # a sibling script, not a package

    return lowbit_lm._classify(seed, steps, torch.device("cpu"), teacher=True)


LR = {"lm": LM["lr"], "teacher": 1e-3}


def _train(task: str, seed: int, steps: int, corpus: Any, make: Callable[[Any, float], Any]) -> float:
    wl = _lm(seed, steps, corpus) if task == "lm" else _teacher(seed, steps)
    opt = make(wl.model, LR[task])
    scheduler = wl.make_scheduler(opt) if wl.make_scheduler else None
    for _ in range(steps):
        _one_step(wl.model, opt, next(wl.batches), wl.loss_fn)
        if scheduler is not None:
            scheduler.step()
    wl.model.eval()
    with torch.no_grad():
        loss, _ = wl.evaluate(wl.model)
    return loss


def _interval(diffs: list[float]) -> tuple[float, float]:
    mean = statistics.fmean(diffs)
    half = (
        T975.get(len(diffs) - 1, 1.96) * statistics.stdev(diffs) / math.sqrt(len(diffs))
        if len(diffs) > 1
        else 0.0
    )
    return mean, half


def loss_table(task: str, seeds: int, steps: int, corpus: Any) -> dict[str, Any]:
    makers: dict[str, Callable[[Any, float], Any]] = {"fp32": lambda m, lr: _adamw(m.parameters(), lr)}
    try:
        from torchao.optim import AdamW8bit

        makers["torchao8bit"] = lambda m, lr: AdamW8bit(
            list(m.parameters()), lr=lr, betas=(0.9, 0.99), weight_decay=0.01
        )
    except ImportError:
        pass
    for fmt in STATE_FORMATS:
        makers[fmt] = lambda m, lr, f=fmt: MixedPrecisionOptimizer(
            _adamw(m.parameters(), lr), scaler=None, state_format=f
        )
    losses: dict[str, list[float]] = {name: [] for name in makers}
    for seed in range(seeds):  # interleaved: every optimizer once per seed before the next seed
        for name, make in makers.items():
            losses[name].append(_train(task, seed, steps, corpus, make))
    rows = {}
    for fmt in STATE_FORMATS:
        row = {"loss": losses[fmt]}
        for base in ("fp32", "torchao8bit"):
            if base in losses:
                mean, half = _interval([a - b for a, b in zip(losses[fmt], losses[base], strict=True)])
                row[f"minus_{base}"] = {"mean": mean, "ci95": half}
        rows[fmt] = row
    return {"losses": losses, "formats": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=120, help="lm steps")
    parser.add_argument("--teacher-steps", type=int, default=300)
    parser.add_argument("--tasks", default="lm,teacher", help="comma-separated: lm, teacher")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.compile = lambda fn=None, **_: fn  # type: ignore[assignment]  # torchao's step eagerly (docstring)
    start = time.perf_counter()
    corpus = WORKLOADS["lm"].load(_lm_preset(), _Job())
    table = bytes_table(corpus)
    print(f"{'optimizer':48} {'state B/param':>14} {'kahan B/param':>14}")
    for row in table:
        print(
            f"{row['optimizer']:48} {row['state_bytes_per_param']:14.3f} {row['kahan_bytes_per_param']:14.3f}"
        )
    results = {}
    for task in args.tasks.split(","):
        if task not in LR:
            parser.error(f"--tasks: unknown task {task!r}; accepted: {', '.join(LR)}")
        steps = args.steps if task == "lm" else args.teacher_steps
        result = results[task] = loss_table(task, args.seeds, steps, corpus)
        print(f"\nheld-out loss, {task} ({steps} steps, seeds 0..{args.seeds - 1}), paired differences:")
        base = {k: statistics.fmean(v) for k, v in result["losses"].items()}
        print("  means: " + ", ".join(f"{k} {v:.4f}" for k, v in base.items()))
        for fmt, row in result["formats"].items():
            parts = [
                f"{k[6:]}: {v['mean']:+.4f} +- {v['ci95']:.4f}"
                for k, v in row.items()
                if k.startswith("minus_")
            ]
            print(f"  {fmt:5} minus " + "; ".join(parts))
    seconds = time.perf_counter() - start
    print(f"\n{seconds:.0f} s")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"bytes": table, "loss": results, "args": vars(args), "seconds": seconds, "lm": LM},
                      handle, indent=1)  # fmt: skip


class _Job:
    data = None  # the workload's default corpus (Python's stdlib sources)


def _lm_preset() -> Preset:
    return Preset(1, 0, 1, {**LM, "batch": 8, "corpus_bytes": 300_000, "eval_windows": 48})


if __name__ == "__main__":
    main()
