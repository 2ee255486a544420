"""Low-bit training recipes against bf16: the bench's lm workload and a held-out classification task.

Each mode trains the same model from the same seed on the same batches; the modes are interleaved step
by step (the order rotates each step). Every mode but ``fp32`` (no autocast: the distance between fp32 and
bf16 shows the run-to-run noise the gaps sit in) runs under bf16 autocast; a recipe mode converts the
model's ``nn.Linear`` layers with ``mixprec.lowbit.convert_to_lowbit_training``. For the 4-bit recipes
(mxfp4, nvfp4) the first and the last Linear stay in bf16, as in NVIDIA's NVFP4 recipe. The figure is the
held-out loss relative to bf16 (the issue's acceptance: fp8 rowwise, blockwise, mxfp8 within 2%, nvfp4
within 8%). On a CPU every quantized GEMM is emulated (quantize, dequantize, float32 matmul): the steps
are slower than bf16 by design and the step time here says nothing about a GPU. On CUDA (``--device
cuda``, run by ``benchmarks/gpu.sh``) the fp8 tensorwise/rowwise GEMMs run in ``torch._scaled_mm`` and
the step time (wall clock after a synchronize, not CPU time) against bf16 is the figure; the block-scaled
recipes are still emulated there (one warning says which kernel is missing). A mode that raises (while
it is built, trained or evaluated) is dropped and its error kept under ``errors`` in the JSON, so one
broken recipe does not lose the others' results; the exit code is then 1. ``--json`` is rewritten every
``--save-every`` steps with the step times so far (``"partial"`` says how far, the held-out losses are
None until the end), and on SIGTERM (a time limit) with what was measured, so a run cut short keeps
its step times (``benchmarks/checkpoint.py``).

Tasks:
  lm        the bench's character-level GPT (``mixprec.bench`` workload ``lm``: Python stdlib sources,
            AdamW, warm-up + cosine), at a CPU-sized width; validation cross-entropy.
  classify  scikit-learn's bundled 8x8 digits (80/20 split fixed by the seed), a 4-layer MLP
            (64-256-256-256-10), AdamW; held-out cross-entropy and accuracy. Small (360 held-out images):
            once the model fits, the held-out loss rests on a few images and varies a lot between seeds.
  teacher   a classification task with a large held-out set: 64 input channels of lognormal scale (a few
            are outliers, as LLM activations have), labels sampled from a fixed random teacher MLP's
            softmax (so they are noisy and the task cannot be memorised), 32768 train / 8192 held-out
            examples drawn from the seed; the same 4-layer MLP; held-out cross-entropy and accuracy.

Usage::

    python benchmarks/lowbit_lm.py --task teacher --steps 400 --seeds 0,1,2 --json teacher.json
    python benchmarks/lowbit_lm.py --task classify --steps 400 --seeds 0,1 --json classify.json
    python benchmarks/lowbit_lm.py --task lm --steps 300 --seeds 0 --threads 1 --json lm.json
    python benchmarks/lowbit_lm.py --task lm --device cuda --steps 100 --json lowbit_gpu.json
    python benchmarks/lowbit_lm.py --combine lm_s0_a.json lm_s0_b.json lm_s1_a.json ... --json lm.json

``--combine`` joins runs made in separate processes (one seed or a few modes each, to use several cores)
into one table. Each run is deterministic given its seed, so the bf16 reference every run includes must
agree bitwise across the runs of a seed; it refuses runs that disagree or differ in task or steps. Its
step time is the median of the runs' medians, with their range.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from mixprec.bench import data as datasets
from mixprec.bench.workloads import WORKLOADS, Workload, _shuffled_batches
from mixprec.lowbit import convert_to_lowbit_training, get_recipe

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoint import STOPPED, stop_on_sigterm, write_json  # a sibling script, not a package

LM_SMALL = {"context": 64, "width": 128, "layers": 2, "heads": 4, "lr": 2e-3, "batch": 16}
LM_SMALL.update(corpus_bytes=1_000_000, eval_windows=64)
MODES = (
    "bf16", "fp8_tensorwise", "fp8_rowwise", "fp8_rowwise_gw_hp", "fp8_blockwise", "mxfp8", "mxfp4",
    "nvfp4", "nvfp4 sr=off", "nvfp4 rht=off", "nvfp4 sr=off rht=off",
)  # fmt: skip
FOUR_BIT = ("mxfp4", "nvfp4")


def _convert(mode: str, model: nn.Module, seed: int) -> None:
    if mode in ("bf16", "fp32"):
        return
    linears = [fqn for fqn, m in model.named_modules() if type(m) is nn.Linear]
    keep = {linears[0], linears[-1]} if mode.split()[0] in FOUR_BIT else set()
    # stochastic rounding draws from generators the layers make on the model's device, seeded by the seed
    convert_to_lowbit_training(
        model, get_recipe(mode), module_filter_fn=lambda m, fqn: fqn not in keep, seed=seed
    )


def _teacher_split(seed: int) -> datasets.Split:
    g = torch.Generator().manual_seed(1000 + seed)
    scales = torch.exp(torch.randn(64, generator=g))  # lognormal channel magnitudes: a few outliers
    teacher = [torch.randn(64, 128, generator=g) / 8, torch.randn(128, 10, generator=g) / 4]
    x = torch.randn(40960, 64, generator=g) * scales
    logits = torch.tanh((x / scales) @ teacher[0]) @ teacher[1] * 3
    y = torch.multinomial(torch.softmax(logits, 1), 1, generator=g).squeeze(1)
    return datasets.Split(x[:32768], y[:32768], x[32768:], y[32768:], source="random teacher MLP")


def _classify(seed: int, steps: int, device: torch.device, teacher: bool = False) -> Workload:
    split = _teacher_split(seed) if teacher else datasets.sklearn_digits(seed)
    torch.manual_seed(seed)
    widths = (64, 256, 256, 256, 10)
    layers: list[nn.Module] = [nn.Flatten()]
    for i, (a, b) in enumerate(itertools.pairwise(widths)):
        layers += [nn.Linear(a, b)] + ([nn.GELU()] if i < len(widths) - 2 else [])
    model = nn.Sequential(*layers).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)

    x_test, y_test = split.x_test.to(device), split.y_test.to(device)

    def evaluate(forward) -> tuple[float, float]:
        logits = forward(x_test).float()
        loss = nn.functional.cross_entropy(logits, y_test).item()
        return loss, (logits.argmax(1) == y_test).float().mean().item()

    batches = _shuffled_batches(split.x_train.to(device), split.y_train.to(device), 64, seed)
    return Workload(
        model, optimizer, batches, lambda out, y: nn.functional.cross_entropy(out.float(), y), evaluate
    )


def _lm(seed: int, steps: int, device: torch.device) -> Workload:
    spec = WORKLOADS["lm"]
    preset = replace(spec.presets["quick"], params=LM_SMALL)
    corpus = datasets.text_corpus(LM_SMALL["corpus_bytes"], None)
    return spec.build(corpus, preset, seed, steps, device)


class Run:
    """One mode of one seed, trained a step at a time."""

    def __init__(self, task: str, mode: str, seed: int, steps: int, device: torch.device) -> None:
        self.mode, self.seed, self.device = mode, seed, device
        if task == "lm":
            self.work = _lm(seed, steps, device)
        else:
            self.work = _classify(seed, steps, device, teacher=task == "teacher")
        _convert(mode, self.work.model, seed)
        make = self.work.make_scheduler
        self.scheduler = make(self.work.optimizer) if make else None
        self.cpu_s: list[float] = []
        self.losses: list[float] = []

    def step(self) -> None:
        x, y = (t.to(self.device) for t in next(self.work.batches))
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
        start = time.perf_counter() if cuda else time.process_time()
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.mode != "fp32"):
            loss = self.work.loss_fn(self.work.model(x), y)
        loss.backward()
        self.work.optimizer.step()
        self.work.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()
        if cuda:
            torch.cuda.synchronize(self.device)
        self.cpu_s.append((time.perf_counter() if cuda else time.process_time()) - start)
        self.losses.append(loss.item())

    def evaluate(self) -> tuple[float, float]:
        model = self.work.model
        model.eval()

        def forward(inp: torch.Tensor) -> torch.Tensor:
            autocast = torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.mode != "fp32")
            with torch.no_grad(), autocast:
                return model(inp)

        result = self.work.evaluate(forward)
        model.train()
        return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", default="classify", choices=["lm", "classify", "teacher"])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated recipe strings, bf16, fp32")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--save-every", type=int, default=10, help="steps between --json rewrites")
    parser.add_argument("--combine", nargs="+", metavar="JSON", help="join these runs' JSON, train nothing")
    args = parser.parse_args(argv)
    if args.combine:
        results = combine([json.loads(open(path).read()) for path in args.combine])
        return _finish(results, args.json)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if "bf16" not in modes:
        modes.insert(0, "bf16")
    for mode in modes:
        if mode not in ("bf16", "fp32"):
            get_recipe(mode)  # a bad recipe string fails here, before any training
    seeds = [int(s) for s in args.seeds.split(",")]
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    stop_on_sigterm()
    errors: dict[str, str] = {}
    runs: list[Run] = []
    step = 0
    try:
        runs = [
            run
            for s in seeds
            for m in modes
            if (run := _guarded(errors, m, Run, args.task, m, s, args.steps, device))
        ]
        start = time.perf_counter()
        for step in range(1, args.steps + 1):
            runs = [r for r in runs if r.mode not in errors]  # a mode that raised is out, on every seed
            for i in range(len(runs)):
                run = runs[(step - 1 + i) % len(runs)]
                if run.mode not in errors:
                    _guarded(errors, run.mode, run.step)
            if step % 50 == 0:
                print(f"step {step}/{args.steps} ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
            if step % args.save_every == 0 and step < args.steps:
                _save_partial(args, seeds, modes, runs, errors, f"running: {step} of {args.steps} steps")
    except KeyboardInterrupt as exc:
        why = STOPPED if str(exc) == STOPPED else "interrupted"
        _save_partial(args, seeds, modes, runs, errors, f"{why} during step {step} of {args.steps}")
        raise SystemExit(124) from None
    results = _header(args, seeds, device)
    for m in modes:
        summary = m not in errors and _guarded(errors, m, _summarise, [r for r in runs if r.mode == m])
        if summary:
            results["modes"][m] = summary
    if errors:
        results["errors"] = errors
    return _finish(results, args.json)


def _header(args: argparse.Namespace, seeds: list[int], device: torch.device) -> dict:
    results = {"task": args.task, "steps": args.steps, "seeds": seeds, "torch": torch.__version__}
    results.update(device=str(device), time="wall s (synchronized)" if device.type == "cuda" else "CPU s")
    results["modes"] = {}
    return results


def _save_partial(args, seeds: list[int], modes: list[str], runs: list, errors: dict, why: str) -> None:
    """``--json`` with each mode's step times so far and no held-out loss (not evaluated yet)."""
    results = _header(args, seeds, torch.device(args.device))
    for m in modes:
        mine = [r for r in runs if r.mode == m and len(r.cpu_s) > 1]
        if m not in errors and mine:
            results["modes"][m] = {**_step_times(mine), "val_loss": None, "val_metric": None}
            results["modes"][m]["steps_done"] = min(len(r.cpu_s) for r in mine)
    if errors:
        results["errors"] = dict(errors)
    write_json(args.json, results, why)


def _guarded(errors: dict[str, str], mode: str, call, *args):
    """``call(*args)``, or None with the error kept under ``mode``: one failing recipe loses only itself."""
    try:
        return call(*args)
    except Exception as exc:
        errors[mode] = f"{type(exc).__name__}: {exc}"
        print(f"lowbit_lm: mode {mode!r} failed, going on without it: {errors[mode]}", file=sys.stderr)
        return None


def _finish(results: dict, path: str | None) -> dict:
    _print(results)
    write_json(path, results, None)
    return results


def combine(runs: list[dict]) -> dict:
    """One result from runs of the same task and steps made in separate processes (see the module doc).

    Raises:
        ValueError: for runs of different tasks, steps or devices, two runs of one mode and seed, or bf16
            references of one seed that differ between runs.
    """
    keys = {(r["task"], r["steps"], r["device"]) for r in runs}
    if len(keys) != 1:
        raise ValueError(f"--combine needs runs of one task, steps and device, got {sorted(keys)}")
    losses: dict[str, dict[int, tuple[float, float]]] = {}
    medians: dict[str, list[float]] = {}
    for run in runs:
        for mode, r in run["modes"].items():
            for seed, loss, metric in zip(run["seeds"], r["val_loss"], r["val_metric"], strict=True):
                earlier = losses.setdefault(mode, {}).get(seed)
                if earlier is not None and (mode != "bf16" or earlier != (loss, metric)):
                    what = "bf16 references differ" if mode == "bf16" else "two runs of it"
                    raise ValueError(f"--combine: mode {mode!r}, seed {seed}: {what}")
                losses[mode][seed] = (loss, metric)
            medians.setdefault(mode, []).append(r["step_s_median"])
    seeds = sorted(losses["bf16"])
    first = runs[0]
    results = {k: first[k] for k in ("task", "steps", "torch", "device", "time")}
    results.update(seeds=seeds, combined=len(runs), modes={})
    errors = {mode: error for run in runs for mode, error in run.get("errors", {}).items()}
    if errors:
        results["errors"] = errors
    for mode, by_seed in losses.items():
        if sorted(by_seed) != seeds:
            raise ValueError(f"--combine: mode {mode!r} ran seeds {sorted(by_seed)}, bf16 ran {seeds}")
        spread = sorted(medians[mode])
        results["modes"][mode] = {
            "val_loss": [by_seed[s][0] for s in seeds],
            "val_metric": [by_seed[s][1] for s in seeds],
            "step_s_median": statistics.median(spread),
            "step_s_p25": spread[0],
            "step_s_p75": spread[-1],
        }
    return results


def _step_times(runs: list[Run]) -> dict:
    """Median and quartiles of the step times of ``runs`` (each run's first steps left out: warm-up)."""
    times = [t for r in runs for t in r.cpu_s[min(5, len(r.cpu_s) - 2) :]]
    q = statistics.quantiles(times, n=4)
    return {"step_s_median": q[1], "step_s_p25": q[0], "step_s_p75": q[2]}


def _summarise(runs: list[Run]) -> dict:
    evals = [r.evaluate() for r in runs]
    return {"val_loss": [e[0] for e in evals], "val_metric": [e[1] for e in evals], **_step_times(runs)}


def _print(results: dict) -> None:
    modes = results["modes"]
    base = modes.get("bf16", {}).get("val_loss")  # None when bf16 itself failed: no gaps to print
    metric = "perplexity" if results["task"] == "lm" else "accuracy"
    where = f"seeds {results['seeds']}, {results['device']}, torch {results['torch']}"
    print(f"{results['task']}, {results['steps']} steps, {where}")
    head = f"{'mode':<22} {'held-out loss':>14} {'vs bf16 (per seed)':>22} {metric:>10}"
    spread = "(range of runs)" if results.get("combined") else "(IQR)"
    print(head + f" {results['time'] + '/step ' + spread:>26}")
    for mode, r in modes.items():
        gaps = (
            " ".join(f"{v / b - 1:+.2%}" for v, b in zip(r["val_loss"], base, strict=True)) if base else "-"
        )
        loss = statistics.fmean(r["val_loss"])
        spread = f"{r['step_s_median']:.4f} ({r['step_s_p25']:.4f}-{r['step_s_p75']:.4f})"
        print(f"{mode:<22} {loss:>14.4f} {gaps:>22} {statistics.fmean(r['val_metric']):>10.4f} {spread:>26}")
    for mode, error in results.get("errors", {}).items():
        print(f"{mode:<22} FAILED: {error}")
    if results["device"] == "cpu":
        print(
            "CPU: quantized GEMMs are emulated, slower than bf16 by design; the held-out loss is the figure."
        )


if __name__ == "__main__":
    sys.exit(1 if main().get("errors") else 0)
