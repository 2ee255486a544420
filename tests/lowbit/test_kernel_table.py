"""benchmarks/kernel_table.py: its cells are select_kernel's decisions on padded operands, and known facts."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from mixprec.lowbit import HP, OPERANDS, RECIPES, get_format, quantize
from mixprec.lowbit.kernels import select_kernel

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kernel_table.py"
SHAPE = (64, 96, 80)  # M, K, N: padding gives every block kernel its K, except nvfp4's dgrad (K = 80)


def _script():
    spec = importlib.util.spec_from_file_location("kernel_table", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _decide(recipe, cap) -> list[str | None]:
    """Per GEMM, select_kernel on the operands' stored (padded) shapes, quantized here on the CPU."""
    m, k, n = SHAPE
    mats = {  # the (rows, K) matrix of each operand, as recipes.py's module doc lays them out
        "fprop_x": (m, k), "fprop_w": (n, k), "dgrad_go": (m, n), "dgrad_w": (k, n),
        "wgrad_go": (n, m), "wgrad_x": (k, m),
    }  # fmt: skip
    out = []
    for i in range(3):
        names = OPERANDS[2 * i], OPERANDS[2 * i + 1]
        fmts = [recipe.operand(o) for o in names]
        if HP in fmts:
            out.append("mm")
            continue
        shapes = []
        for o, f in zip(names, fmts, strict=True):
            data = quantize(torch.randn(mats[o]), f, pad=True).data
            shapes.append((data.shape[0], data.shape[1] * (2 if get_format(f).element == "e2m1" else 1)))
        kernel, _ = select_kernel(get_format(fmts[0]), get_format(fmts[1]), *shapes, cap)
        out.append(kernel.name if kernel else "emulated")
    return out


def test_the_table_is_select_kernels_decision(tmp_path: Path, capsys) -> None:
    script = _script()
    out = tmp_path / "t.json"
    result = script.main(["--shape", ",".join(map(str, SHAPE)), "--json", str(out)])
    printed = capsys.readouterr().out
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert "| recipe | sm89 | sm90 | sm100 | sm120 |" in printed
    cells = result["cells"]
    for name in ("fp8_rowwise_gw_hp", "fp8_blockwise", "nvfp4", "mxfp4"):
        for cap in script.CAPABILITIES:
            want = _decide(RECIPES[name], cap)
            col = f"sm{cap[0]}{cap[1]}"
            paths = result["paths"][name][col].values()
            got = [p["kernel"] or ("mm" if "torch.mm" in p["why"] else "emulated") for p in paths]
            assert got == want, (name, col)
            if set(want) <= {"emulated", "mm"} and "emulated" in want:
                assert cells[name][col].startswith("emulated (")
            elif len(set(want)) == 1:
                assert cells[name][col] == f"{want[0]} x3"
            else:
                assert cells[name][col] == " / ".join(want)
            assert f"| {cells[name][col]} |" in printed
    # known facts: the DeepSeek blockwise kernels exist on sm90 only, and nvfp4 needs K a multiple of 32
    assert [c.startswith("fp8_blockwise") for c in cells["fp8_blockwise"].values()] == [
        False,
        True,
        False,
        False,
    ]
    assert all(
        c.startswith("emulated (") and "sm9x" in c for k, c in cells["fp8_blockwise"].items() if k != "sm90"
    )
    assert cells["nvfp4"]["sm100"] == "nvfp4 / emulated / nvfp4"
    assert "K=80" in result["paths"]["nvfp4"]["sm100"]["dgrad"]["why"]
    assert cells["fp8_rowwise_gw_hp"]["sm89"] == "fp8_rowwise / fp8_rowwise / mm"


def test_a_bad_shape_is_refused_naming_it(capsys) -> None:
    with pytest.raises(SystemExit):
        _script().main(["--shape", "64,96"])
    assert "'64,96'" in capsys.readouterr().err
