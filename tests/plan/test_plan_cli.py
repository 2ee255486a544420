"""``mixprec plan``: the planner from the command line on a user's ``module:function``."""

from __future__ import annotations

import json
import re
import textwrap

import pytest

from mixprec.cli import main
from mixprec.plan import PrecisionPlan

FACTORY = """
import torch
import torch.nn.functional as F
from torch import nn


def make():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    batches = [(torch.randn(16, 32), torch.randint(0, 4, (16,))) for _ in range(2)]
    return model, batches, lambda m, b: F.cross_entropy(m(b[0]), b[1])


def not_a_triple():
    return 3


def torch_style():  # the loss as torch writes it, loss(out, y): not loss_fn(model, batch)
    model, batches, _ = make()
    return model, batches, F.cross_entropy


def one_batch():  # a bare tensor for batches
    model, batches, loss_fn = make()
    return model, batches[0][0], lambda m, x: m(x).sum()


def generated():  # batches from a generator, which plan_precision takes
    model, batches, loss_fn = make()
    return model, (batch for batch in batches), loss_fn


class Unsized:  # an iterable without a length (a DataLoader over an IterableDataset)
    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)

    def __len__(self):
        raise TypeError("IterableDataset has no len()")


def unsized():
    model, batches, loss_fn = make()
    return model, Unsized(batches), loss_fn


NOT_A_FUNCTION = 3
"""


@pytest.fixture
def factory(tmp_path, monkeypatch):
    (tmp_path / "plan_factory.py").write_text(textwrap.dedent(FACTORY))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_plan_command_prints_the_table_and_writes_json_and_plot(factory, capsys):
    out_json, out_png = factory / "p.json", factory / "p.png"
    argv = [
        "plan",
        "--from",
        "plan_factory:make",
        "--budget",
        "0.05",
        "--formats",
        "mxfp8,bf16",
        "--exhaustive",
    ]
    assert main([*argv, "--json", str(out_json), "--plot", str(out_png)]) == 0
    printed = capsys.readouterr().out
    plan = PrecisionPlan.from_json(out_json.read_text())
    assert set(plan.formats) == {"0", "2"} and set(plan.formats.values()) <= {"mxfp8", "bf16"}
    assert "below bf16" in printed and "wrote" in printed
    assert plan.measured["loss"] <= 0.05
    assert all(set(info["divergence"]) >= {"mxfp8", "bf16"} for info in plan.layers.values())
    assert out_png.stat().st_size > 1000
    json.loads(out_json.read_text())


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--from", "plan_factory"], "MODULE:FUNCTION"),
        (["--from", "plan_factory:missing"], "cannot load"),
        (["--from", "plan_factory:not_a_triple"], "must return (model, batches, loss_fn)"),
        (["--from", "plan_factory:NOT_A_FUNCTION"], "is a int, not a function returning"),  # was a traceback
        (
            ["--from", "plan_factory:torch_style"],
            "mixprec calls it as loss_fn(model, batch) -> scalar tensor",
        ),
        (["--from", "plan_factory:one_batch"], "batches must be an iterable of batches"),
        (["--from", "plan_factory:make", "--formats", "fp7"], "unknown format 'fp7'"),
        (["--from", "plan_factory:make", "--budget", "0"], "budget must be > 0"),
        (["--from", "plan_factory:make", "--grad-budget", "-1"], "grad_budget must be > 0"),
        (["--from", "plan_factory:make", "--min-low-share", "0.5"], "applies with max_cost only"),
        (["--from", "plan_factory:make", "--max-cost", "-1"], "max_cost must be > 0"),
        (["--from", "plan_factory:make", "--budget", "0.05", "--max-cost", "0.8"], "not both"),  # was ignored
        (["--from", "plan_factory:make", "--json", "missing/p.json"], "does not exist"),
        # were: a traceback (IsADirectoryError) or matplotlib's error, after the planning and the JSON
        (
            ["--from", "plan_factory:make", "--json", "."],
            "--json . is a folder; name a file in it, e.g. plan.json",
        ),
        (
            ["--from", "plan_factory:make", "--plot", "."],
            "--plot . is a folder; name a file in it, e.g. plan.png",
        ),
        (["--from", "plan_factory:make", "--plot", "p.xyz"], "matplotlib cannot write '.xyz'; accepted: "),
        (["--from", "plan_factory:make", "--max-memory", "lots"], "max_memory must be an int number"),
        (["--from", "plan_factory:make", "--max-memory", "100"], "below the least memory"),
    ],
)
def test_plan_command_refuses_bad_input_with_exit_code_2(factory, capsys, argv, message):
    assert main(["plan", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("function", "count"), [("generated", "2 batch(es)"), ("unsized", "the given batches")]
)
def test_plan_command_takes_batches_without_a_length(factory, capsys, function, count):
    # was: TypeError: object of type 'generator' has no len(), before any planning
    argv = ["plan", "--from", f"plan_factory:{function}", "--formats", "mxfp8,bf16", "--cost", "b200-peak"]
    assert main([*argv, "--json", str(factory / "p.json"), "--plot", str(factory / "p.png")]) == 0
    assert f"on {count} (--measure exact" in capsys.readouterr().err
    assert set(PrecisionPlan.from_json((factory / "p.json").read_text()).formats) == {"0", "2"}


def test_plan_command_with_max_cost_plans_the_most_accurate_within_it(factory, capsys):
    out_json = factory / "p.json"
    argv = ["plan", "--from", "plan_factory:make", "--max-cost", "0.8", "--cost", "b200-peak"]
    assert (
        main([*argv, "--formats", "mxfp8,bf16", "--json", str(out_json), "--plot", str(factory / "p.png")])
        == 0
    )
    plan = PrecisionPlan.from_json(out_json.read_text())
    assert plan.budget is None and plan.max_cost == 0.8
    assert plan.relative_cost() <= 0.8 + 1e-9
    assert "most accurate within 0.8x" in capsys.readouterr().out
    assert plan.measure == "exact"
    assert main([*argv, "--measure", "local", "--json", str(out_json), "--plot", str(factory / "p.png")]) == 0
    local = PrecisionPlan.from_json(out_json.read_text())
    assert local.measure == "local" and local.relative_cost() <= 0.8 + 1e-9
    assert local.passes < plan.passes


def test_plan_command_with_max_memory_plans_smaller_state_and_activations(factory, capsys):
    out_json, out_png = factory / "p.json", factory / "p.png"
    argv = ["plan", "--from", "plan_factory:make", "--formats", "bf16", "--tokens-per-step", "4096"]
    assert main([*argv, "--json", str(out_json), "--plot", str(out_png)]) == 0
    free = PrecisionPlan.from_json(out_json.read_text())
    bound = free.memory["components"]["total"] - 1
    assert main([*argv, "--max-memory", str(bound), "--json", str(out_json), "--plot", str(out_png)]) == 0
    plan = PrecisionPlan.from_json(out_json.read_text())
    assert (plan.state_format, plan.activation_format) != (None, None)
    assert plan.memory["components"]["total"] <= bound == plan.memory["max_memory"]
    assert "save_activations=" in capsys.readouterr().out


def test_plan_command_compile_prices_the_compiled_layers(factory, capsys):
    """--compile --cost measured: each format timed under torch.compile (inductor) on this CPU."""
    out_json, out_png = factory / "c.json", factory / "c.png"
    argv = [
        "plan",
        "--from",
        "plan_factory:make",
        "--budget",
        "0.05",
        "--formats",
        "bf16",
        "--cost",
        "measured",
    ]
    assert (
        main([*argv, "--compile", "--tokens-per-step", "16", "--json", str(out_json), "--plot", str(out_png)])
        == 0
    )
    plan = PrecisionPlan.from_json(out_json.read_text())
    assert plan.target == "measured:cpu:compiled"
    assert all(c > 0 for info in plan.layers.values() for c in info["cost"].values())


@pytest.mark.parametrize(
    ("flags", "path", "words"),
    [
        ([], "triton", "eager Triton quantization"),
        (["--quantize", "unfused"], "unfused", "eager pure-torch quantization"),
        (["--compile"], "fused", "compiled, fused quantization"),
        (["--compile", "--quantize", "triton"], "triton", "eager Triton quantization"),
    ],
)
def test_plan_quantize_picks_the_path_a_roofline_prices_and_says_it(
    factory, capsys, monkeypatch, flags, path, words
):
    """The plan records and prints the quantization path its roofline priced; the path changes the price
    (rowwise fp8 at 8192 rows on h100: unfused quantization costs more than the Triton kernels')."""
    monkeypatch.delenv("MIXPREC_FUSED_QUANTIZE", raising=False)
    out_json = factory / "q.json"
    argv = ["plan", "--from", "plan_factory:make", "--formats", "fp8_rowwise,bf16", "--cost", "h100"]
    argv += [
        "--tokens-per-step",
        "8192",
        "--exhaustive",
        "--json",
        str(out_json),
        "--plot",
        str(factory / "q.png"),
    ]
    assert main([*argv, *flags]) == 0
    plan = PrecisionPlan.from_json(out_json.read_text())
    assert plan.quantize == path and plan.target == "h100"
    assert f"on h100 ({words})" in capsys.readouterr().out
    cost = {p: None for p in ("triton", "unfused")}
    for quantize in cost:
        assert main([*argv, "--quantize", quantize]) == 0
        layer = PrecisionPlan.from_json(out_json.read_text()).layers["0"]["cost"]
        cost[quantize] = layer["fp8_rowwise"] / layer["bf16"]
    assert cost["unfused"] > cost["triton"]


def test_plan_measured_cost_records_no_quantize_path(factory, capsys):
    out_json = factory / "m.json"
    argv = ["plan", "--from", "plan_factory:make", "--formats", "bf16", "--cost", "measured"]
    assert (
        main([*argv, "--tokens-per-step", "16", "--json", str(out_json), "--plot", str(factory / "m.png")])
        == 0
    )
    assert PrecisionPlan.from_json(out_json.read_text()).quantize is None
    assert "quantization)" not in capsys.readouterr().out


def test_plan_at_a_peak_target_records_no_quantize_path(factory, capsys):
    # was: "cost 0.250x bf16 on b200-peak (eager Triton quantization)", a path the compute-only cost ignores
    out_json = factory / "k.json"
    argv = ["plan", "--from", "plan_factory:make", "--formats", "mxfp8,bf16", "--cost", "b200-peak"]
    assert main([*argv, "--json", str(out_json), "--plot", str(factory / "k.png")]) == 0
    assert PrecisionPlan.from_json(out_json.read_text()).quantize is None
    out = capsys.readouterr().out
    assert "on b200-peak;" in out and "quantization)" not in out


def test_plan_quantize_refuses_an_unknown_path(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--quantize", "fast"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err  # argparse quotes the choices from Python 3.12 (and some 3.11 builds) on
    assert re.search(
        r"--quantize: invalid choice: 'fast' \(choose from '?fused'?, '?triton'?, '?unfused'?\)", err
    )


def test_plan_without_tokens_per_step_names_the_flag_and_where_it_wrote(factory, capsys):
    """A CLI user is told the flag (not the Python keyword, not as a UserWarning with a source path), and
    the absolute paths of the files written into the current folder by default."""
    assert main(["plan", "--from", "plan_factory:make", "--formats", "bf16"]) == 0
    captured = capsys.readouterr()
    assert "mixprec plan: note: --tokens-per-step not given" in captured.err
    assert "pass --tokens-per-step N" in captured.err
    assert "tokens_per_step=N" not in captured.err and "UserWarning" not in captured.err
    assert f"wrote {factory / 'plan.json'} and {factory / 'plan.png'}" in captured.out
    assert (factory / "plan.json").exists() and (factory / "plan.png").exists()


def test_plan_refuses_a_gpu_sized_workload_at_once_with_what_to_do(capsys):
    """The user's command that ran 400 s silently: refused before anything is built, as bench refuses it."""
    argv = ["plan", "--workload", "lm-gemm", "--size", "default", "--cost", "h100", "--tokens-per-step"]
    argv += ["8192", "--formats", "fp8_rowwise,fp8_tensorwise,bf16"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "workload 'lm-gemm' at size 'default' is sized for a GPU: one step is about 2 min" in err
    assert "plan it at --size tiny" in err and "building" not in err


def test_plan_says_what_it_is_doing_on_stderr(factory, capsys):
    assert main(["plan", "--from", "plan_factory:make", "--formats", "mxfp8,bf16"]) == 0
    err = capsys.readouterr().err
    assert "mixprec plan: planning 2 linear layer(s) in mxfp8, bf16 on 2 batch(es)" in err
    assert "mixprec plan: planned in " in err


def test_plan_help_shows_the_choices_and_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--workload {lm,lm-gemm,cnn,tabular-regression}" in text and "(default lm)" in text
    assert "--size {tiny,quick,default,full,large}" in text and "(default tiny)" in text
    assert "(default nvfp4,mxfp8,bf16), from: fp8_tensorwise," in text and "fp32, bf16" in text
    assert "(default 0.01)" in text
    # were missing, though the guide says --help gives each default
    assert "(default exact)" in text and "(default b200, also for a --from model on a GPU)" in text
    assert "(default 0)" in text
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--workload", "nope"])
    assert exc.value.code == 2
    assert "invalid choice: 'nope' (choose from" in capsys.readouterr().err
