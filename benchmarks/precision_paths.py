"""Step time and memory of each precision path, side by side with its best peer, at several model widths.

Paths (all AdamW with the same hyperparameters, on an MLP of ``depth`` Linear-LayerNorm-ReLU blocks):

==================  ==========================================================================
fp32                torch AdamW, fp32 weights (the baseline)
bf16                weights cast to bf16, torch AdamW (its state bf16 too): loses small updates
optimi-kahan        torch-optimi ``AdamW(kahan_sum=True)`` on bf16 weights: the peer for pure bf16
bf16-true+kahan     ``mixprec.initialize(model, AdamW, "bf16-true", weight_update="kahan")`` (guarded)
kahan-nocheck       bf16-true+kahan with ``loss_scale=None``: no inf/nan check before the step (as optimi)
kahan-sepcheck      bf16-true+kahan with the check as a separate read of the gradients (no folding)
kahan-fp32state     bf16-true+kahan with ``CompensatedOptimizer(state_dtype=torch.float32)``: fp32 moments
bf16-true+sr        the same with ``weight_update="stochastic"`` (guarded)
O1                  ``initialize(..., "O1")``: fp32 weights, mixprec autocast, dynamic loss scale
O2                  ``initialize(..., "O2")``: bf16 model, fp32 masters, dynamic loss scale
==================  ==========================================================================

Every (path, width) runs in a fresh process, ``--rounds`` times, interleaved (round 1 runs every path once,
then round 2, ...), so drift on a shared machine spreads over all paths. One process times ``--steps``
training steps after ``--warmup`` and reports their median; the table gives the median over rounds and the
interquartile range (IQR) of the per-round medians. On a CPU ``step ms`` is CPU time of the process per
training step (forward, backward, optimizer step; ``time.process_time``), which other load on a shared
machine disturbs far less than the wall clock (also printed, ``wall ms``); with ``--threads 1`` (default)
the two agree on an idle machine. With ``--device cuda`` the model and batch live on the GPU and ``step
ms`` is wall time between two ``torch.cuda.synchronize`` calls (CPU time would miss the GPU's work).
``tensors`` counts the distinct storages alive after a
step: parameters, buffers, gradients, optimizer state, masters (and their gradients), Kahan buffers; exact
and reproducible. ``scratch`` is what a CompensatedOptimizer keeps between steps besides (its workspace
buffers and random-bit pool: bounded, not per parameter). ``peak`` is the process's peak RSS growth over
training (includes transients); on CUDA the peak of ``torch.cuda.max_memory_allocated`` over training.

``--in-process`` runs every (path, width, round) in this process instead of paths x widths x rounds fresh
processes (150 by default, each paying torch's import): on CUDA that loses nothing (memory is the
device's, counted per run), on a CPU the RSS peak of a shared process means nothing and is left out
(``peak_mib`` None). Without torch-optimi installed the ``optimi-kahan`` rows are skipped (the reason is
in the JSON's ``skipped``) and the ``vs optimi`` ratios are None. A path that raises (at a width) is
recorded under ``errors`` with its message and the others go on (exit code 1 then). ``--json`` is
rewritten after every run (``"partial"`` says how many of the planned runs are in it) and on SIGTERM,
so a run cut short by a time limit keeps the rounds it finished (``benchmarks/checkpoint.py``).

Usage::

    python benchmarks/precision_paths.py --widths 256,512 --beta2 0.999,0.99 --rounds 7 --json out.json
    python benchmarks/precision_paths.py --device cuda --in-process --widths 1024,4096 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoint import STOPPED, stop_on_sigterm, write_json  # a sibling script, not a package

PATHS = (
    "fp32",
    "bf16",
    "optimi-kahan",
    "bf16-true+kahan",
    "kahan-nocheck",
    "kahan-sepcheck",
    "kahan-fp32state",
    "bf16-true+sr",
    "O1",
    "O2",
)
MIB = 2**20


def _tensors_in(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors_in(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item)


def tensor_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the distinct storages of params, buffers, grads, optimizer state, masters and their grads."""
    masters = getattr(optimizer, "master_params", [])
    grads = [p.grad for p in [*model.parameters(), *masters] if p.grad is not None]
    tensors = [*model.parameters(), *model.buffers(), *grads, *masters, *_tensors_in(optimizer.state_dict())]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.numel()}
    return sum(storages.values())


def scratch_bytes(optimizer) -> int:
    """Bytes of a CompensatedOptimizer's workspace buffers and random-bit pools (0 for other optimizers)."""
    workspace = getattr(getattr(optimizer, "optimizer", None), "workspace", None)
    if workspace is None:
        return 0
    tensors = [*workspace.buffers.values(), *(pool.pool for pool in workspace.pools.values())]
    return sum(t.numel() * t.element_size() for t in tensors)


def build(
    path: str, width: int, depth: int, lr: float, betas: tuple[float, float], wd: float, device: str = "cpu"
):
    torch.manual_seed(0)
    with torch.device(device):  # built where it trains: a width-4096 init on the host would cost seconds
        blocks = [m for _ in range(depth) for m in (nn.Linear(width, width), nn.LayerNorm(width), nn.ReLU())]
        model = nn.Sequential(*blocks, nn.Linear(width, 10))
    if path in ("bf16", "optimi-kahan", "kahan-fp32state"):
        model.to(torch.bfloat16)
    if path == "optimi-kahan":
        import optimi

        return model, optimi.AdamW(model.parameters(), lr=lr, betas=betas, weight_decay=wd, kahan_sum=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, weight_decay=wd)
    if path in ("fp32", "bf16"):
        return model, optimizer
    from mixprec import CompensatedOptimizer, MixedPrecisionOptimizer, initialize

    if path == "kahan-fp32state":
        inner = CompensatedOptimizer(optimizer, "kahan", state_dtype=torch.float32)
        return model, MixedPrecisionOptimizer(inner, scaler=1.0, master_weights=False)
    update = {"bf16-true+kahan": "kahan", "kahan-nocheck": "kahan", "kahan-sepcheck": "kahan"}
    update["bf16-true+sr"] = "stochastic"
    if path in update:
        scale = {"loss_scale": None} if path == "kahan-nocheck" else {}
        model, wrapped = initialize(model, optimizer, "bf16-true", weight_update=update[path], **scale)
        if path == "kahan-sepcheck":
            wrapped.optimizer.workspace.fold_numel = 0  # every step reads its gradients once more first
        return model, wrapped
    return initialize(model, optimizer, path)


def worker(args: argparse.Namespace, fresh_process: bool = True) -> dict:
    """One (path, width), in a fresh process unless ``fresh_process`` is False (``--in-process``)."""
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    torch.manual_seed(1)  # the same batch in a fresh process and in-process
    x = torch.randn(args.batch, args.width).to(device)
    y = torch.randint(0, 10, (args.batch,)).to(device)
    if args.path in ("bf16", "optimi-kahan", "kahan-fp32state"):
        x = x.bfloat16()
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device)
    else:
        baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    beta2 = float(args.beta2)
    model, optimizer = build(args.path, args.width, args.depth, args.lr, (0.9, beta2), args.wd, device)
    times, cpu_times = [], []
    for step in range(args.warmup + args.steps):
        if cuda:
            torch.cuda.synchronize(device)
        start, cpu_start = time.perf_counter(), time.process_time()
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x).float(), y)
        optimizer.backward(loss) if hasattr(optimizer, "backward") else loss.backward()
        optimizer.step()
        if cuda:
            torch.cuda.synchronize(device)
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
            cpu_times.append(time.process_time() - cpu_start)
    params = sum(p.numel() for p in model.parameters())
    if cuda:
        peak: float | None = (torch.cuda.max_memory_allocated(device) - baseline) / MIB
        cpu_times = times  # the GPU's work is not CPU time: the synchronized wall clock is the figure
    elif fresh_process:
        peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - baseline) / 1024
    else:
        peak = None  # the RSS peak of a process that ran other paths before is not this run's
    return {
        "path": args.path,
        "width": args.width,
        "beta2": beta2,
        "scratch_bytes": scratch_bytes(optimizer),
        "params": params,
        "wall_ms": statistics.median(times) * 1e3,
        "step_ms": statistics.median(cpu_times) * 1e3,
        "tensor_bytes": tensor_bytes(model, optimizer),
        "peak_mib": peak,
    }


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def summarize(runs: list[dict]) -> list[dict]:
    """One row per (beta2, width, path): medians and IQRs over rounds, and the ratio to optimi-kahan
    computed within each round (the processes of one round ran back to back) with its IQR."""
    rows = []
    for beta2 in sorted({r["beta2"] for r in runs}, reverse=True):
        for width in sorted({r["width"] for r in runs}):
            here = [r for r in runs if r["width"] == width and r["beta2"] == beta2]
            peers = {r["round"]: r["step_ms"] for r in here if r["path"] == "optimi-kahan"}
            for path in PATHS:
                mine = [r for r in here if r["path"] == path]
                if mine:
                    rows.append(_row(beta2, width, path, mine, peers))
    return rows


def _row(beta2: float, width: int, path: str, mine: list[dict], peers: dict[int, float]) -> dict:
    q1, median, q3 = _quartiles([r["step_ms"] for r in mine])
    ratios = [r["step_ms"] / peers[r["round"]] for r in mine if r["round"] in peers]
    r1, ratio, r3 = _quartiles(ratios) if ratios else (None, None, None)  # no optimi-kahan runs
    peaks = [r["peak_mib"] for r in mine if r["peak_mib"] is not None]
    return {
        "beta2": beta2,
        "width": width,
        "path": path,
        "params": mine[0]["params"],
        "step_ms": median,
        "step_iqr_ms": q3 - q1,
        "vs_optimi": ratio,
        "vs_optimi_q1": r1,
        "vs_optimi_q3": r3,
        "wall_ms": statistics.median(r["wall_ms"] for r in mine),
        "tensor_mib": mine[0]["tensor_bytes"] / MIB,
        "bytes_per_param": mine[0]["tensor_bytes"] / mine[0]["params"],
        "scratch_mib": mine[0]["scratch_bytes"] / MIB,
        "peak_mib": statistics.median(peaks) if peaks else None,
        "rounds": len(mine),
    }


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    print(
        f"AdamW lr {args.lr} wd {args.wd}, depth {args.depth}, batch {args.batch}, {args.threads} threads; "
        f"{_clock(args)} ms per training step: median of {args.steps} steps per run, median and IQR over "
        f"{args.rounds} interleaved rounds; vs optimi: per-round ratio, median [IQR]"
    )
    print(
        f"{'beta2':>5} {'width':>5} {'path':16} {'params':>7} {'step ms':>8} {'IQR':>5} "
        f"{'vs optimi':>17} {'B/param':>7} {'scratch MiB':>11} {'peak MiB':>8}"
    )
    for row in rows:
        ratio = "-"
        if row["vs_optimi"] is not None:
            ratio = f"{row['vs_optimi']:.2f} [{row['vs_optimi_q1']:.2f}-{row['vs_optimi_q3']:.2f}]"
        peak = "-" if row["peak_mib"] is None else f"{row['peak_mib']:.1f}"
        print(
            f"{row['beta2']:>5} {row['width']:>5} {row['path']:16} {row['params'] / 1e6:6.2f}M "
            f"{row['step_ms']:8.2f} {row['step_iqr_ms']:5.2f} {ratio:>17} {row['bytes_per_param']:7.2f} "
            f"{row['scratch_mib']:11.1f} {peak:>8}"
        )


def _clock(args: argparse.Namespace) -> str:
    return "synchronized wall" if torch.device(args.device).type == "cuda" else "CPU"


def optimi_missing() -> str | None:
    """Why torch-optimi cannot be imported, or None when it can."""
    try:
        import optimi  # noqa: F401
    except ImportError as exc:
        return f"torch-optimi is not installed ({exc})"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--widths", default="256,512,1024")
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--beta2", default="0.999", help="comma-separated second-moment decay rates")
    parser.add_argument("--wd", type=float, default=0.01)
    parser.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated subset of {list(PATHS)}")
    parser.add_argument("--json", help="write the rows and every run to this file")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]: where the model trains")
    parser.add_argument(
        "--in-process", action="store_true", help="run every path here, not in fresh processes (see above)"
    )
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--width", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.path:
        print(json.dumps(worker(args)))
        return 0
    paths = args.paths.split(",")
    unknown = sorted(set(paths) - set(PATHS))
    if unknown:
        parser.error(f"unknown paths {unknown}; accepted: {list(PATHS)}")
    if "optimi-kahan" not in paths:
        parser.error("the table compares every path with optimi-kahan: keep it in --paths")
    skipped = {}
    if (why := optimi_missing()) is not None:
        skipped["optimi-kahan"] = why
        paths.remove("optimi-kahan")
        print(
            f"precision_paths: skipping optimi-kahan: {why}; the vs optimi ratios are left out",
            file=sys.stderr,
        )
    plan = [
        (round_, beta2, width, path)
        for round_ in range(args.rounds)
        for beta2 in args.beta2.split(",")
        for width in map(int, args.widths.split(","))
        for path in paths
    ]
    runs: list[dict] = []
    errors: dict[str, str] = {}
    stop_on_sigterm()

    def save(partial: str | None) -> None:
        payload = {"args": vars(args), "rows": summarize(runs), "runs": runs, "skipped": skipped}
        write_json(args.json, {**payload, "errors": errors}, partial)

    try:
        for done, (round_, beta2, width, path) in enumerate(plan, 1):
            key = f"{path} width {width} beta2 {beta2}"
            if key in errors:
                continue  # a path that raised once raises every round: its time goes to the others
            try:
                runs.append({**_run(args, path, width, beta2), "round": round_})
            except Exception as exc:  # one broken path loses only its own rows
                errors[key] = _error(exc)
                print(f"precision_paths: {key} failed, going on without it: {errors[key]}", file=sys.stderr)
            save(f"running: {done} of {len(plan)} runs")
    except KeyboardInterrupt as exc:
        why = STOPPED if str(exc) == STOPPED else "interrupted"
        save(f"{why} after {len(runs)} of {len(plan)} runs")
        print_table(summarize(runs), args)
        return 124
    save(None)
    print_table(summarize(runs), args)
    for key, error in errors.items():
        print(f"{key}: FAILED: {error}")
    return 1 if errors else 0


def _error(exc: Exception) -> str:
    """The exception in one line; a failed worker process's last stderr line (its exception)."""
    if isinstance(exc, subprocess.CalledProcessError):
        last = (exc.stderr or "").strip().splitlines()[-1:] or [f"exit code {exc.returncode}"]
        return last[0]
    return f"{type(exc).__name__}: {exc}"


def _run(args: argparse.Namespace, path: str, width: int, beta2: str) -> dict:
    """One (path, width) run: in this process with ``--in-process``, else in a fresh one."""
    if args.in_process:
        return worker(
            argparse.Namespace(**{**vars(args), "path": path, "width": width, "beta2": beta2}), False
        )
    shared = [f"--{k}={getattr(args, k)}" for k in ("depth", "batch", "steps", "warmup", "threads", "lr")]
    command = [sys.executable, __file__, *shared, f"--wd={args.wd}", f"--device={args.device}"]
    command += [f"--beta2={beta2}", f"--path={path}", f"--width={width}"]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    sys.exit(main())
