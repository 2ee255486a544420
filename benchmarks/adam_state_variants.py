"""Optimizer-step time of candidate representations of pure-bf16 Kahan AdamW state, side by side.

How the state of a bf16 weight is kept decides the bytes per parameter and the passes over memory. This
script times one AdamW step (beta2 0.999, Kahan-compensated bf16 weights) on the gradients of the MLP of
``precision_paths.py`` for each candidate, interleaved in one process (round r runs every candidate once,
then round r + 1), CPU time, one thread; it prints median and IQR over the rounds and writes JSON.

==================  =====  ====================================================================
candidate           B/par  what
optimi              10     torch-optimi ``AdamW(kahan_sum=True)``: bf16 m and v, 12 foreach passes
bf16-v-nearest      10     the same sequence of foreach ops in mixprec (bf16 v freezes at 0.999)
fp32-v-foreach      12     bf16 m, fp32 v, foreach ops (mixed bf16/fp32 ops are not vectorised)
fp32-v-upcast       12     bf16 m, fp32 v, gradients copied to fp32 first so v's ops are fp32 only
bf16-v-stochastic   10     bf16 m and v, v's update rounded stochastically (unbiased decay)
fused-chunks        12     mixprec's path: torch's fused Adam kernel on fp32 copies of 2**18-element
                           chunks, bf16 m, fp32 v (``mixprec.optim.fused_adam``), no non-finite check
fused-folded        12     the same with the check folded into the pass (the default under 2**20
                           values: one dot of the fp32 gradient copies the kernel needs anyway)
fused-separate      12     the same with the check as a separate read of the bf16 gradients first
fused-stochastic    10     the default path with stochastic rounding instead of a Kahan buffer (checked)
fp32-state          14     mixprec with ``state_dtype=torch.float32`` (fp32 m and v, unfused)
==================  =====  ====================================================================

The prototypes (bf16-v-*, fp32-v-*) implement only the Kahan AdamW step they time. Usage::

    python benchmarks/adam_state_variants.py --width 512 --rounds 30 --json adam_state_variants.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import nn

from mixprec import CompensatedOptimizer

LR, BETAS, EPS, WD = 1e-4, (0.9, 0.999), 1e-8, 0.01


def make_grads(width: int) -> list[nn.Parameter]:
    torch.manual_seed(0)
    blocks = [m for _ in range(6) for m in (nn.Linear(width, width), nn.LayerNorm(width), nn.ReLU())]
    model = nn.Sequential(*blocks, nn.Linear(width, 10)).to(torch.bfloat16)
    x, y = torch.randn(64, width, dtype=torch.bfloat16), torch.randint(0, 10, (64,))
    nn.functional.cross_entropy(model(x).float(), y).backward()
    return list(model.parameters())


def fold(p, c, t):
    torch._foreach_copy_(t, p)
    torch._foreach_add_(p, c)
    torch._foreach_sub_(t, p)
    torch._foreach_add_(c, t)


class Prototype:
    """One foreach Kahan AdamW step with the moments in ``m_dtype``/``v_dtype`` (step count fixed at 10)."""

    def __init__(self, params, v_dtype, upcast=False, stochastic_v=False) -> None:
        self.p = [p.detach().clone() for p in params]
        self.g = [p.grad.clone() for p in params]
        self.m = [torch.zeros_like(p) for p in self.p]
        self.v = [torch.full_like(p, 1e-6, dtype=v_dtype) for p in self.p]
        self.c = [torch.zeros_like(p) for p in self.p]
        self.t = [torch.empty_like(p) for p in self.p]
        self.f = [torch.empty_like(p, dtype=torch.float32) for p in self.p]
        self.upcast, self.stochastic_v = upcast, stochastic_v
        self.generator = torch.Generator().manual_seed(0)
        total = sum(p.numel() for p in self.p)
        self.draws = torch.empty((total + 3) // 4, dtype=torch.int64)
        self.flat = torch.empty(total)
        start, self.views = 0, []
        for p in self.p:
            self.views.append(self.flat[start : start + p.numel()].view(p.shape))
            start += p.numel()

    def step(self) -> None:
        (b1, b2), bc1, root = BETAS, 1 - BETAS[0] ** 10, (1 - BETAS[1] ** 10) ** 0.5
        torch._foreach_lerp_(self.m, self.g, 1 - b1)
        if self.stochastic_v:
            self._second_moment_stochastic(b2)
        else:
            g = self.g
            if self.upcast:
                torch._foreach_copy_(self.f, self.g)
                g = self.f
            torch._foreach_mul_(self.v, b2)
            torch._foreach_addcmul_(self.v, g, g, value=1 - b2)
        torch._foreach_copy_(self.t, self.v)
        torch._foreach_sqrt_(self.t)
        torch._foreach_add_(self.t, EPS * root)
        torch._foreach_add_(self.c, self.p, alpha=-LR * WD)
        torch._foreach_addcdiv_(self.c, self.m, self.t, -LR * root / bc1)
        fold(self.p, self.c, self.t)

    def _second_moment_stochastic(self, b2: float) -> None:
        torch._foreach_copy_(self.views, self.v)
        torch._foreach_mul_(self.views, b2)
        torch._foreach_addcmul_(self.views, self.g, self.g, value=1 - b2)
        self.draws.random_(-(2**63), 2**63 - 1, generator=self.generator)
        bits = self.flat.view(torch.int32)
        bits.add_(self.draws.view(torch.int16)[: bits.numel()]).add_(2**15).bitwise_and_(-65536)
        torch._foreach_copy_(self.v, self.views)


def mixprec_step(params, method="kahan", check=False, fold=True, **kwargs):
    weights = [nn.Parameter(p.detach().clone()) for p in params]
    for w, p in zip(weights, params, strict=True):
        w.grad = p.grad.clone()
    inner = torch.optim.AdamW(weights, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    opt = CompensatedOptimizer(inner, method, skip_nonfinite=check, **kwargs)
    if not fold:
        opt.workspace.fold_numel = 0
    return opt.step


def optimi_step(params):
    import optimi

    weights = [nn.Parameter(p.detach().clone()) for p in params]
    for w, p in zip(weights, params, strict=True):
        w.grad = p.grad.clone()
    return optimi.AdamW(weights, lr=LR, betas=BETAS, weight_decay=WD, kahan_sum=True, foreach=True).step


def candidates(params) -> dict:
    return {
        "optimi": optimi_step(params),
        "bf16-v-nearest": Prototype(params, torch.bfloat16).step,
        "fp32-v-foreach": Prototype(params, torch.float32).step,
        "fp32-v-upcast": Prototype(params, torch.float32, upcast=True).step,
        "bf16-v-stochastic": Prototype(params, torch.bfloat16, stochastic_v=True).step,
        "fused-chunks": mixprec_step(params),
        "fused-folded": mixprec_step(params, check=True),
        "fused-separate": mixprec_step(params, check=True, fold=False),
        "fused-stochastic": mixprec_step(params, "stochastic", check=True),
        "fp32-state": mixprec_step(params, state_dtype=torch.float32),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=30, help="at least 2 (for the IQR)")
    parser.add_argument("--repeat", type=int, default=3, help="steps per candidate per round")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--candidates", help="comma-separated subset to time (optimi always runs)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if args.rounds < 2:
        parser.error(f"--rounds must be at least 2 (the IQR needs two values), got {args.rounds}")
    torch.set_num_threads(args.threads)
    params = make_grads(args.width)
    steps = candidates(params)
    if args.candidates:
        chosen = {"optimi", *args.candidates.split(",")}
        if chosen - steps.keys():
            parser.error(f"unknown candidates {sorted(chosen - steps.keys())}; accepted: {list(steps)}")
        steps = {name: step for name, step in steps.items() if name in chosen}
    for step in steps.values():
        step()  # state creation and workspace allocation happen outside the timing
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            start = time.process_time()
            for _ in range(args.repeat):
                step()
            times[name].append((time.process_time() - start) / args.repeat * 1e3)
    base = statistics.median(times["optimi"])
    numel = sum(p.numel() for p in params)
    print(
        f"width {args.width} ({numel / 1e6:.2f}M params), {args.threads} thread(s), CPU ms per optimizer step"
    )
    rows = []
    for name, values in times.items():
        q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
        rows.append({"candidate": name, "ms": median, "q1": q1, "q3": q3, "vs_optimi": median / base})
        print(f"{name:18} {median:7.3f} ms  IQR {q3 - q1:.3f}  x{median / base:.2f}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"args": vars(args), "rows": rows, "times": times}, out, indent=1)


if __name__ == "__main__":
    main()
