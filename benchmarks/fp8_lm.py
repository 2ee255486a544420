"""fp8 training on the bench's lm workload: bf16 autocast against mixprec.float8 (dynamic and delayed).

Trains the bench's character-level GPT (``mixprec.bench`` workload ``lm``: Python stdlib sources, AdamW,
warm-up + cosine) once per mode from the same seed, the modes interleaved step by step (each step the
order rotates) so machine noise falls on all of them alike. Reports the validation loss (the acceptance:
fp8 within 2% of bf16 autocast), the relative gap to bf16, and the step time (median, quartiles).

Modes: ``fp32``; ``bf16`` (torch.autocast bf16); ``fp8-dynamic`` / ``fp8-delayed`` (every nn.Linear
converted by ``mixprec.float8.convert_to_float8_training``, the rest under bf16 autocast);
``torchao`` (``torchao.float8`` dynamic, emulated on CPU). On a CPU the fp8 matmuls run in
``torch._scaled_mm``'s reference kernel (or torchao's float32 emulation): they are exact but slower than
bf16, so the loss is the figure that counts there; on a Hopper GPU the matmuls are real.

Usage::

    python benchmarks/fp8_lm.py                                   # size small, 300 steps, ~10 min on 2 cores
    python benchmarks/fp8_lm.py --size default --steps 180 --json fp8.json
    python benchmarks/fp8_lm.py --device cuda --size large --modes bf16,fp8-dynamic,fp8-delayed,torchao
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
import warnings
from dataclasses import replace
from types import SimpleNamespace

import torch

from mixprec.bench.workloads import WORKLOADS
from mixprec.float8 import Float8Config, convert_to_float8_training

# "small": the bench's GPT at a size a busy 2-core CPU trains in minutes per mode (same code, same data).
SMALL = {"context": 64, "width": 128, "layers": 2, "heads": 4, "lr": 2e-3, "batch": 16}
SMALL.update(corpus_bytes=1_000_000, eval_windows=64)
MODES = ("fp32", "bf16", "fp8-dynamic", "fp8-delayed", "torchao")


def _convert(mode: str, model: torch.nn.Module) -> None:
    if mode == "fp8-dynamic":
        convert_to_float8_training(model, config=Float8Config(scaling="dynamic"))
    elif mode == "fp8-delayed":
        convert_to_float8_training(model, config=Float8Config(scaling="delayed"))
    elif mode == "torchao":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torchao.float8 import Float8LinearConfig
            from torchao.float8 import convert_to_float8_training as ao_convert
        ao_convert(model, config=Float8LinearConfig(emulate=next(model.parameters()).device.type != "cuda"))


def _context(mode: str, device: torch.device):
    if mode == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


class Run:
    """One mode's workload, trained a step at a time."""

    def __init__(self, mode: str, spec, corpus, preset, seed: int, steps: int, device: torch.device) -> None:
        self.mode, self.device = mode, device
        self.work = spec.build(corpus, preset, seed, steps, device)
        _convert(mode, self.work.model)
        self.scheduler = self.work.make_scheduler(self.work.optimizer) if self.work.make_scheduler else None
        self.times: list[float] = []
        self.losses: list[float] = []

    def step(self) -> None:
        x, y = (t.to(self.device) for t in next(self.work.batches))
        _sync(self.device)
        start = time.perf_counter()
        with _context(self.mode, self.device):
            loss = self.work.loss_fn(self.work.model(x), y)
        loss.backward()
        self.work.optimizer.step()
        self.work.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()
        _sync(self.device)
        self.times.append(time.perf_counter() - start)
        self.losses.append(loss.item())

    def evaluate(self) -> float:
        model = self.work.model
        model.eval()

        def forward(idx: torch.Tensor) -> torch.Tensor:
            with torch.no_grad(), _context(self.mode, self.device):
                return model(idx)

        loss, _ = self.work.evaluate(forward)
        model.train()
        return loss


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
    return q[0], statistics.median(values), q[2]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="small", choices=["small", "tiny", "quick", "default", "large"])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--modes", default="bf16,fp8-dynamic,fp8-delayed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        parser.error(f"--modes: unknown {unknown}; accepted: {', '.join(MODES)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    spec = WORKLOADS["lm"]
    preset = spec.presets["quick" if args.size == "small" else args.size]
    if args.size == "small":
        preset = replace(preset, params=SMALL)
    corpus = spec.load(preset, SimpleNamespace(seed=args.seed, data=None))  # a job with no data file
    runs = [Run(m, spec, corpus, preset, args.seed, args.steps, device) for m in modes]
    start = time.perf_counter()
    for step in range(args.steps):
        for i in range(len(runs)):
            runs[(step + i) % len(runs)].step()
        if (step + 1) % 25 == 0:
            losses = ", ".join(f"{r.mode} {statistics.fmean(r.losses[-25:]):.3f}" for r in runs)
            print(
                f"step {step + 1}/{args.steps} ({time.perf_counter() - start:.0f} s): {losses}",
                file=sys.stderr,
            )
    results = {"size": args.size, "steps": args.steps, "seed": args.seed, "device": str(device)}
    results.update(torch=torch.__version__, params=dict(preset.params), modes={})
    for run in runs:
        p25, median, p75 = _quartiles(run.times[min(5, len(run.times) - 1) :])
        results["modes"][run.mode] = {
            "val_loss": run.evaluate(),
            "train_loss_last10": statistics.fmean(run.losses[-10:]),
            "step_s_median": median,
            "step_s_p25": p25,
            "step_s_p75": p75,
        }
    _print(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


def _print(results: dict) -> None:
    modes = results["modes"]
    base = modes.get("bf16", {}).get("val_loss")
    print(
        f"lm {results['size']}, {results['steps']} steps, seed {results['seed']}, {results['device']}, "
        f"torch {results['torch']}"
    )
    print(f"{'mode':<12} {'val loss':>9} {'vs bf16':>8} {'train loss':>10} {'step s (p25-p75)':>22}")
    for mode, r in modes.items():
        gap = f"{(r['val_loss'] / base - 1):+.2%}" if base else "-"
        spread = f"{r['step_s_median']:.3f} ({r['step_s_p25']:.3f}-{r['step_s_p75']:.3f})"
        print(f"{mode:<12} {r['val_loss']:>9.4f} {gap:>8} {r['train_loss_last10']:>10.4f} {spread:>22}")
    if results["device"].startswith("cpu"):
        print(
            "CPU: fp8 matmuls are emulated (torch._scaled_mm reference kernel), slower than bf16 by design;"
        )
        print("the validation loss is the figure that counts here.")


if __name__ == "__main__":
    main()
