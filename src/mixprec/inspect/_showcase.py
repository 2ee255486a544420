"""What ``mixprec inspect`` shows: every diagnostic on the :mod:`~mixprec.inspect.demo` models."""

from __future__ import annotations

from pathlib import Path

import torch

from mixprec.autocast import autocast
from mixprec.inspect import demo
from mixprec.inspect.fp8 import fp8_report, plot_fp8_report
from mixprec.inspect.nonfinite import find_nonfinite
from mixprec.inspect.plots import plot_gradient_histogram, plot_underflow
from mixprec.inspect.report import write_report
from mixprec.inspect.scaler_log import ScalerLog
from mixprec.inspect.trace import trace_dtypes
from mixprec.inspect.underflow import underflow_report
from mixprec.policy import Policy

#: The policy of the dtype-trace demo: float16 on CPU, with the head pinned to float32.
TRACE_POLICY = Policy.for_device("cpu", torch.float16).with_modules({"head": torch.float32})


def _section(title: str) -> None:
    print(f"\n== {title}")


def print_diagnostics() -> None:
    """Print the non-finite reports, the underflow tables at scale 1 and 2^16, and a dtype trace."""
    inputs = demo.demo_inputs()
    _section("find_nonfinite: forward overflow (blocks.2.fc has weights of 30000), float16")
    model = demo.forward_overflow_model()
    print(find_nonfinite(model, inputs))
    print("in bfloat16:", find_nonfinite(model, inputs, dtype=torch.bfloat16) or "every value stays finite")

    _section("find_nonfinite: backward overflow (finite forward; blocks.1.fc has weights of 30000), float16")
    model = demo.backward_overflow_model()
    for scale in (2.0**12, 2.0**4):
        found = find_nonfinite(model, inputs, loss_fn=demo.scaled_loss(scale))
        print(f"loss scale 2^{int(scale).bit_length() - 1}: {found or 'every value stays finite'}")

    _section("underflow_report: gradients of about 1e-10 to 4e-5, float16, loss scale 1 and 2^16")
    for scale in (1.0, 2.0**16):
        report = underflow_report(demo.healthy_model(), inputs, loss_fn=demo.tiny_loss, scale=scale)
        print(report.table())
        print(report)
        print()

    _section("trace_dtypes under mixprec.autocast('cpu'): a float16 policy with the head pinned to float32")
    model = demo.healthy_model()
    with trace_dtypes(model) as trace, autocast("cpu", policy=TRACE_POLICY):
        model(inputs)
    print(trace.table())

    _section("fp8_report: e4m3 forward, e5m2 gradients; one input feature is an outlier of 30000")
    print(_fp8_demo().table())


def _fp8_demo():
    """Outlier features (as in LLM activations) make one per-tensor scale flush the ordinary values."""
    inputs = demo.demo_inputs()
    inputs[:, 0] *= 3e4
    return fp8_report(demo.healthy_model(), inputs, loss_fn=demo.tiny_loss)


def write_pictures(out: Path, steps: int = 40) -> list[Path]:
    """Histograms and underflow bars of the underflow demo, and a scaler-log run with its report."""
    inputs = demo.demo_inputs()
    reports = [
        underflow_report(demo.healthy_model(), inputs, loss_fn=demo.tiny_loss, scale=scale)
        for scale in (1.0, 2.0**16)
    ]
    written = [
        plot_gradient_histogram(reports[0], out / "grad_histogram_scale1.png"),
        plot_gradient_histogram(reports[1], out / "grad_histogram_scale65536.png"),
        plot_underflow(reports, out / "underflow.png"),
        plot_fp8_report(_fp8_demo(), out / "fp8_report.png"),
    ]
    log_path = out / "scaler_log.jsonl"
    _train_with_log(log_path, steps)
    return [*written, log_path, *write_report(log_path, out / "report")]


def _train_with_log(path: Path, steps: int) -> None:
    """A short float16 run whose first scale (2^24) is far too high, so the log shows skipped steps."""
    model = demo.healthy_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24, growth_interval=8)
    generator = torch.Generator().manual_seed(2)
    with ScalerLog(scaler, path, optimizer=optimizer, model=model, histogram_every=10) as log:
        for step in range(steps):
            x = torch.randn(16, demo.WIDTH, generator=generator)
            target = x[:, :1].sin()
            with autocast("cpu", dtype=torch.float16):
                loss = (model(x).float() - target).square().mean()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            log.record(step, loss=loss)
            optimizer.zero_grad()
