"""The closing "what to use" line of each workload, derived from the measured records, and the report's
cells (the Markdown summary formats them as the printed table does)."""

from __future__ import annotations

from types import SimpleNamespace

from mixprec.bench import report, stats
from mixprec.bench.advice import recommend


def _rec(
    mode: str,
    speedup: float,
    low: float | None,
    high: float | None,
    mib: float,
    metric: float,
    workload: str = "lm",
    noisy: bool = False,
) -> dict:
    return {
        "workload": workload,
        "mode": mode,
        "speedup_vs_fp32": speedup,
        "speedup_low": low,
        "speedup_high": high,
        "peak_memory_mb": mib,
        "final_metric": metric,
        "noisy": noisy,
    }


def _lm() -> list[dict]:
    """The new user's lm: every bf16 mode 1.43-1.52x with overlapping intervals, bf16-true the least
    memory but the worst perplexity (17.74 against fp32's 17.61)."""
    return [
        _rec("fp32", 1.0, None, None, 240.0, 17.61),
        _rec("torch-amp-bf16", 1.45, 1.30, 1.60, 180.0, 17.60),
        _rec("mixprec-bf16", 1.43, 1.28, 1.58, 185.0, 17.60),
        _rec("O2-bf16", 1.48, 1.35, 1.62, 155.0, 17.63),
        _rec("bf16-true", 1.52, 1.40, 1.66, 130.0, 17.74),
        _rec(stats.AA_LABEL, 1.01, 0.97, 1.05, 241.0, 17.61),
    ]


def test_tied_modes_give_the_least_memory_one_and_a_worse_metric_is_left_out() -> None:
    line = recommend(_lm(), "lm")
    assert line is not None and line.startswith("what to use on lm: O2-bf16: 1.48x [1.35-1.62] fp32's speed")
    assert (
        "tied (intervals overlap) with torch-amp-bf16, mixprec-bf16: chosen for the least peak memory" in line
    )
    assert (
        "bf16-true (perplexity 17.740)" in line and "faster but worse than fp32's perplexity 17.610" in line
    )


def test_nothing_faster_than_fp32_says_fp32() -> None:
    rows = [
        _rec("fp32", 1.0, None, None, 5.0, 0.17, workload="tabular-regression"),
        _rec("torch-amp-bf16", 0.85, 0.70, 0.95, 14.0, 0.18, workload="tabular-regression"),
        _rec("bf16-true", 0.59, 0.50, 0.66, 12.0, 0.23, workload="tabular-regression"),
    ]
    line = recommend(rows, "tabular-regression")
    assert line == (
        "what to use on tabular-regression: fp32: no mixed mode was faster with its 90% interval above 1x "
        "(best: torch-amp-bf16 at 0.85x [0.70-0.95])"
    )


def test_an_interval_reaching_below_1_is_not_faster_and_no_fp32_no_line() -> None:
    rows = [
        _rec("fp32", 1.0, None, None, 5.0, 0.9, workload="cnn"),
        _rec("mixprec-bf16", 1.2, 0.95, 1.4, 4.0, 0.9, workload="cnn"),
    ]
    assert recommend(rows, "cnn").startswith("what to use on cnn: fp32: no mixed mode")  # type: ignore[union-attr]
    rows[1]["speedup_low"] = 1.05
    assert recommend(rows, "cnn").startswith("what to use on cnn: mixprec-bf16: 1.20x")  # type: ignore[union-attr]
    assert recommend(rows[1:], "cnn") is None


def _result(mode: str, ms: float, metric: float, scale: float | None) -> SimpleNamespace:
    history = [{"step": i, "round": i, "step_time_ms": ms * (1 + 0.001 * i), "loss": 1.0} for i in range(12)]
    return SimpleNamespace(
        workload="cnn",
        mode=mode,
        device="cpu",
        threads=1,
        dtype="bfloat16",
        steps=12,
        warmup=0,
        history=history,
        peak_memory_mb=ms,
        memory_method="cpu-hwm",
        final_loss=0.06,
        final_metric=metric,
        skipped_steps=0,
        final_scale=scale,
        data_source="digits",
    )


def test_the_table_and_the_summary_end_with_the_same_advice_and_format_cells_alike() -> None:
    results = [_result("fp32", 20.0, 0.9916, None), _result("O2-bf16", 10.0, 0.9916, 65536.0)]
    table = report.format_table(results)
    records = report.make_records(results)
    summary = report.bench_summary(records, "run", [])
    advice = recommend(records, "cnn")
    assert advice is not None and advice.startswith("what to use on cnn: O2-bf16: 2.00x")
    assert advice[:60] in table and f"- {advice}" in summary and "## What to use" in summary
    head = next(line for line in table.splitlines() if line.startswith("mode "))
    assert head.split()[-2:] == ["scale", "noisy"]  # the NOISY flag's column has a name
    row = next(line for line in summary.splitlines() if line.startswith("| cnn | O2-bf16 |"))
    assert "| 99.16% |" in row and "| 65536 |" in row  # percent and the scale, as in the table
    assert "| scale | noisy |" in summary
