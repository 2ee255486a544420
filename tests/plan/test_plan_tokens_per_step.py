"""plan_precision(..., tokens_per_step=N): costs at the run's shape, errors on the calibration batch, the
table's reasons, the JSON field and its older versions, the CLI flag (issue 33 item 2)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn

from mixprec.plan import PrecisionPlan, plan_precision
from mixprec.plan.cost import TARGETS, gemm_cost


def _mlp(width: int = 256, depth: int = 6) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers[:-1])


def _batches(rows: int = 128, width: int = 256) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, width, generator=g), torch.randn(rows, width, generator=g)) for _ in range(2)]


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.mse_loss(model(batch[0]), batch[1])


def _ratio(fmt: str, m: int, n: int = 256, k: int = 256, target: str = "b200") -> float:
    return gemm_cost(TARGETS[target], fmt, m, n, k) / gemm_cost(TARGETS[target], "bf16", m, n, k)


def test_the_128_row_plan_without_tokens_per_step_warns_and_says_so() -> None:
    with pytest.warns(
        UserWarning, match=r"priced at the calibration batch's 128 rows; pass tokens_per_step=N"
    ):
        plan = plan_precision(_mlp(), _batches(), _loss)
    assert plan.tokens_per_step is None and set(plan.formats.values()) == {"bf16"}
    table = plan.table()
    assert "priced at the calibration batch's M=128 rows (no tokens_per_step" in table
    nv, mx = _ratio("nvfp4", 128), _ratio("mxfp8", 128)
    for fqn in plan.formats:
        # the other formats, cheapest first (eager CUDA: mxfp8 and nvfp4 in the pure-torch quantizers)
        assert plan.reasons[fqn].startswith(
            f"cheapest at M=128 (no gain: mxfp8 {mx:.2f}x bf16, nvfp4 {nv:.2f}x"
        )
        assert plan.layers[fqn]["priced_rows"] == 128


def test_the_same_model_planned_for_4096_tokens_prices_every_gemm_there() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no calibration-rows warning once the run's shape is given
        plan = plan_precision(_mlp(), _batches(), _loss, tokens_per_step=4096)
    assert plan.tokens_per_step == 4096
    assert "priced at M=4096 rows per GEMM (tokens_per_step)" in plan.table()
    nv = _ratio("nvfp4", 4096)
    for fqn, info in plan.layers.items():
        assert info["shape"] == [128, 256, 256] and info["priced_rows"] == 4096  # measured at 128 rows
        assert info["flops"] == 6 * 4096 * 256 * 256
        assert info["cost"]["nvfp4"] == gemm_cost(TARGETS["b200"], "nvfp4", 4096, 256, 256)
        # a 256-wide GEMM is memory-bound on a B200 at any M: the casts keep every low-bit format dearer
        assert plan.formats[fqn] == "bf16" and f"nvfp4 {nv:.2f}x bf16" in plan.reasons[fqn]


def test_tokens_per_step_changes_the_plan_where_the_shape_decides() -> None:
    # a user cost in which nvfp4 gains only from 1024 rows: the same calibration batch, two plans
    def cost(fmt: str, m: int, n: int, k: int) -> float:
        return {"bf16": 1.0, "fp32": 4.0}.get(fmt, 0.5 if m >= 1024 else 1.5)

    model, batches = _mlp(64, 2), _batches(32, 64)
    with pytest.warns(UserWarning, match="calibration batch's 32 rows"):
        small = plan_precision(model, batches, _loss, formats=("nvfp4", "bf16"), cost=cost, budget=0.5)
    big = plan_precision(
        model, batches, _loss, formats=("nvfp4", "bf16"), cost=cost, budget=0.5, tokens_per_step=2048
    )
    assert set(small.formats.values()) == {"bf16"} and set(big.formats.values()) == {"nvfp4"}
    assert all(r.startswith("nvfp4 0.50x bf16, cheapest at M=2048") for r in big.reasons.values())
    assert all("no gain: nvfp4 1.50x bf16" in r for r in small.reasons.values())


def test_a_format_cheaper_than_bf16_but_dearer_than_the_chosen_one_is_not_called_no_gain() -> None:
    # was: "nvfp4 0.25x bf16, cheapest at M=32 (no gain: mxfp8 0.50x bf16)": mxfp8 gains, only less
    def cost(fmt: str, m: int, n: int, k: int) -> float:
        return {"bf16": 1.0, "fp32": 4.0, "mxfp8": 0.5, "nvfp4": 0.25}[fmt]

    model, batches = _mlp(64, 2), _batches(32, 64)
    plan = plan_precision(
        model, batches, _loss, formats=("nvfp4", "mxfp8", "bf16"), cost=cost, budget=0.5, tokens_per_step=32
    )
    assert set(plan.formats.values()) == {"nvfp4"}
    assert all("cheapest at M=32 (dearer: mxfp8 0.50x bf16)" in r for r in plan.reasons.values())


@pytest.mark.parametrize("bad", [0, -4, 12.0, True, "4096"])
def test_a_bad_tokens_per_step_is_refused_by_name(bad) -> None:
    with pytest.raises(ValueError, match=rf"tokens_per_step must be a positive int .* got {bad!r}"):
        plan_precision(_mlp(32, 2), _batches(8, 32), _loss, tokens_per_step=bad)


def test_json_records_it_and_older_versions_still_load() -> None:
    plan = plan_precision(_mlp(32, 2), _batches(8, 32), _loss, tokens_per_step=512)
    data = json.loads(plan.to_json())
    assert data["version"] == 6 and data["tokens_per_step"] == 512 and data["not_run"] == []
    assert PrecisionPlan.from_json(plan.to_json()) == plan
    for version in (2, 3):  # written before tokens_per_step: priced at the calibration rows
        old = {k: v for k, v in data.items() if k not in ("tokens_per_step", "not_run")}
        old["version"] = version
        loaded = PrecisionPlan.from_json(json.dumps(old))
        assert loaded.tokens_per_step is None and loaded.not_run == [] and loaded.formats == plan.formats
    with pytest.raises(ValueError, match="version 6"):
        PrecisionPlan.from_json(json.dumps({**data, "version": 7}))


def test_the_cli_takes_tokens_per_step(tmp_path, capsys) -> None:
    from mixprec import cli

    out = tmp_path / "plan.json"
    argv = ["plan", "--size", "tiny", "--batches", "1", "--tokens-per-step", "8192"]
    argv += ["--json", str(out), "--plot", str(tmp_path / "plan.png")]
    assert cli.main(argv) == 0
    assert json.loads(out.read_text())["tokens_per_step"] == 8192
    assert "priced at M=8192 rows per GEMM" in capsys.readouterr().out
