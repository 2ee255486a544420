"""Every bench mode on every bench workload, and the benchmarks' model set-ups, on fake CUDA under the device
check: built where they train, prepared, stepped (issue 39: ``bf16-true-kahan`` and
``benchmarks/precision_paths.py`` crashed on a GPU's first optimizer step).

Autograd's engine does not run under fake CUDA, so ``Tensor.backward`` is replaced by
:func:`hand_backward`: every trainable parameter of the model gets a gradient of its own shape and dtype,
times the (scaled) loss, as ``fake_cuda.loops`` sets them; the layers' own backward kernels are the float8
and lowbit tiers' concern (``test_float8_cuda.py``, ``test_lowbit_kernels.py``). The data sets are
stand-ins of the shapes and dtypes ``mixprec.bench.data`` loads (a fake tensor holds no values, and
scikit-learn is not in the fake tier's environment). ``benchmarks/lowbit_lm.py``'s recipes draw their
stochastic rounding on the model's device (a host generator, which a CUDA layer refuses, was issue 39's
item 2).
"""

from __future__ import annotations

import contextlib
import importlib.util
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from torch import nn

from fake_cuda.harness import module_apply_in_place
from mixprec.bench import data as datasets
from mixprec.bench import lowbit_modes  # noqa: F401  (registers the lowbit modes)
from mixprec.bench.modes import MODES
from mixprec.bench.workloads import WORKLOADS

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _script(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PRECISION_PATHS = _script("precision_paths")
LOWBIT_LM = _script("lowbit_lm")


@contextlib.contextmanager
def hand_backward(model: nn.Module | None = None) -> Iterator[None]:
    """``loss.backward()`` sets each trainable parameter's ``.grad`` to a gradient of its shape and dtype
    times the loss (the scale of a scaled loss included), as backward would leave them: the parameters of
    ``model``, or with None those of every module called inside (a model built where it is not seen)."""
    called: dict[int, torch.Tensor] = {}
    real_call = nn.Module.__call__

    def call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        called.update((id(p), p) for p in self.parameters(recurse=False))
        return real_call(self, *args, **kwargs)

    def backward(self: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        with torch.no_grad():
            for p in model.parameters() if model is not None else list(called.values()):
                if p.requires_grad:
                    p.grad = torch.randn_like(p) * self.detach().to(p.dtype)

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(torch.Tensor, "backward", backward))
        if model is None:
            stack.enter_context(mock.patch.object(nn.Module, "__call__", call))
        yield


def _stand_in(workload: str) -> Any:
    """Data of the shapes and dtypes ``mixprec.bench.data`` loads for ``workload``."""
    if workload in ("lm", "lm-gemm"):
        return datasets.TextCorpus(
            torch.randint(96, (20_000,)), torch.randint(96, (4_000,)), "x" * 96, "stand-in"
        )
    if workload == "cnn":
        x, y = torch.rand(256, 1, 8, 8), torch.randint(10, (256,))
    else:
        x, y = torch.randn(256, 10), torch.randn(256)
    return datasets.Split(x[:192], y[:192], x[192:], y[192:], source="stand-in")


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_bench_mode_trains_each_workload_on_cuda(fake_hopper, mode: str, workload: str) -> None:
    spec, preset = WORKLOADS[workload], WORKLOADS[workload].presets["tiny"]
    device = torch.device("cuda")
    data = _stand_in(workload)
    with warnings.catch_warnings(), module_apply_in_place():
        warnings.simplefilter("ignore")  # emulated GEMMs and the presets' notes
        with device:  # built where it trains (a fake parameter cannot move: module_apply_in_place)
            work = spec.build(data, preset, 0, 3, device)
        run = MODES[mode].create("cuda")
        run.prepare(work.model, work.optimizer)
        scheduler = work.make_scheduler(run.torch_optimizer) if work.make_scheduler else None
        with hand_backward(run.model):
            for _ in range(2):
                x, y = (t.to(device, non_blocking=True) for t in next(work.batches))
                run.train_step(x, y, work.loss_fn)
                if scheduler is not None:
                    scheduler.step()
                run.observe()
        run.model.eval()
        with torch.no_grad():
            assert run.forward(x).device.type == "cuda"


FP8_MODES = sorted(m for m in MODES if m.startswith("fp8") or m.startswith("lowbit-fp8"))


@pytest.mark.parametrize("mode", [*FP8_MODES, "mixprec-bf16"])
def test_lm_gemm_fp8_modes_run_every_linear_on_the_tensor_core_kernel(fake_hopper, mode: str) -> None:
    """The GEMM-bound preset (d=2048, context 1024) at its GPU size: each fp8 mode's forward reaches
    ``_scaled_mm`` (the fp8 tensor-core GEMM ``mixprec.float8`` / ``mixprec.lowbit`` take on Hopper) for
    every block linear, accepted by its meta kernel and without a host sync; bf16 runs none."""
    spec, preset = WORKLOADS["lm-gemm"], WORKLOADS["lm-gemm"].presets["default"]
    assert preset.params["width"] >= 2048 and preset.params["context"] >= 1024
    device = torch.device("cuda")
    with warnings.catch_warnings(), module_apply_in_place():
        warnings.simplefilter("ignore")
        with device:
            work = spec.build(_stand_in("lm-gemm"), preset, 0, 3, device)
        run = MODES[mode].create("cuda")
        run.prepare(work.model, work.optimizer)
        block_linears = 4 * preset.params["layers"]  # qkv, proj and the MLP's two per block
        x, y = (t.to(device, non_blocking=True) for t in next(work.batches))
        fake_hopper.reset()
        with hand_backward(run.model):
            run.train_step(x, y, work.loss_fn)
    calls = fake_hopper.of("scaled_mm")
    if mode == "mixprec-bf16":
        assert calls == []
        return
    assert len(calls) >= block_linears, [e.detail for e in calls]
    assert [e.detail["error"] for e in calls if "error" in e.detail] == []
    assert fake_hopper.host_syncs() == 0


@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_bench_modes_probe_step_runs_on_cuda(fake_hopper, mode: str) -> None:
    # the bench's availability probe: a failure here would drop the mode from a GPU run
    with warnings.catch_warnings(), module_apply_in_place(), torch.device("cuda"):
        warnings.simplefilter("ignore")
        with hand_backward():
            MODES[mode].probe("cuda")


@pytest.mark.parametrize("path", PRECISION_PATHS.PATHS)
def test_precision_paths_build_and_step_on_cuda(fake_hopper, path: str) -> None:
    script = PRECISION_PATHS
    if path == "optimi-kahan" and script.optimi_missing():
        pytest.skip(script.optimi_missing())
    with warnings.catch_warnings(), module_apply_in_place():
        warnings.simplefilter("ignore")
        model, optimizer = script.build(path, 64, 2, 1e-3, (0.9, 0.999), 0.01, "cuda")
        x = torch.randn(8, 64, device="cuda")
        x = x.bfloat16() if path in ("bf16", "optimi-kahan", "kahan-fp32state") else x
        y = torch.randint(0, 10, (8,), device="cuda")
        with hand_backward(model):
            for _ in range(2):
                optimizer.zero_grad()
                loss = nn.functional.cross_entropy(model(x).float(), y)
                optimizer.backward(loss) if hasattr(optimizer, "backward") else loss.backward()
                optimizer.step()


@pytest.mark.parametrize("task", ["lm", "teacher"])
@pytest.mark.parametrize("mode", LOWBIT_LM.MODES)
def test_lowbit_lm_sets_up_and_steps_on_cuda(fake_hopper, mode: str, task: str) -> None:
    script = LOWBIT_LM
    x, y = torch.randn(256, 64), torch.randint(10, (256,))  # the teacher task's shapes (sampling its
    split = datasets.Split(x[:192], y[:192], x[192:], y[192:], "stand-in")  # labels reads values)
    with (
        warnings.catch_warnings(),
        module_apply_in_place(),
        mock.patch.object(script, "_teacher_split", return_value=split),
        mock.patch.object(script.datasets, "text_corpus", return_value=_stand_in("lm")),
    ):
        warnings.simplefilter("ignore")
        with torch.device("cuda"):  # the model built where it trains (a fake parameter cannot move)
            run = script.Run(task, mode, 0, 3, torch.device("cuda"))
        with hand_backward(run.work.model), mock.patch.object(torch.cuda, "synchronize"):
            run.step()  # (synchronize: the fake device has no driver to wait for)
            run.step()
