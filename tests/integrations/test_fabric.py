"""mixprec's Fabric plugin in a plain lightning.fabric loop, against Fabric's own mixed precision."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

L = pytest.importorskip("lightning")

import mixprec  # noqa: E402
from mixprec.integrations import lightning as trainer_plugin  # noqa: E402
from mixprec.integrations.fabric import MixprecPrecision  # noqa: E402
from tests.integrations import _tiny_fabric as tiny  # noqa: E402
from tests.integrations import _tiny_lightning  # noqa: E402


@pytest.fixture(scope="module")
def native(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The oracle: Fabric's own bf16-mixed and 16-mixed, in a process that never imports mixprec."""
    out = tmp_path_factory.mktemp("oracle") / "fabric.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, tiny.__file__, str(out)], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out)


def _assert_same(expected: dict, got: dict) -> None:
    torch.testing.assert_close(got["losses"], expected["losses"], rtol=0, atol=0, equal_nan=True)
    for name, tensor in expected["state"].items():
        assert torch.equal(tensor, got["state"][name]), name
    assert got["scale"] == expected["scale"]


def test_bf16_equals_fabrics_own_bitwise(native: dict) -> None:
    got = tiny.train(tiny.fabric(plugins=[MixprecPrecision("bf16-mixed", device="cpu")]))
    _assert_same(native["bf16"], got)


def test_fp16_with_an_inf_batch_skips_counts_and_recovers(native: dict) -> None:
    plugin = MixprecPrecision("16-mixed", device="cpu")
    got = tiny.train(tiny.fabric(plugins=[plugin]), inf=True)
    _assert_same(native["16"], got)  # equal to Fabric's own torch GradScaler, scale 32768 after one skip
    assert plugin.scaler.skipped_steps == 1 and got["scale"] == 32768.0
    assert torch.equal(got["weights"][tiny.INF_BATCH], got["weights"][tiny.INF_BATCH - 1])  # skipped
    assert not torch.equal(got["weights"][-1], got["weights"][tiny.INF_BATCH])  # and training went on
    assert bool(torch.isfinite(got["losses"][tiny.INF_BATCH + 1 :]).all())


def _steps(fabric: L.Fabric, model, optimizer, batches: list) -> None:
    for x, y in batches:
        fabric.backward(torch.nn.functional.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()


def test_a_checkpoint_resumes_bitwise_with_the_plugin_in_fabrics_state(tmp_path) -> None:
    """Fabric saves only the objects it is given: the scaler comes back when the plugin is in the state
    (as docs/guide/trainers.md says), and restarts at its initial scale when it is not."""
    batches = list(tiny.loader(inf=True))

    def setup() -> tuple:
        torch.manual_seed(0)
        plugin = MixprecPrecision("16-mixed", device="cpu", scaler=mixprec.GradScaler(growth_interval=3))
        fabric = tiny.fabric(plugins=[plugin])
        model = torch.nn.Sequential(torch.nn.Linear(tiny.FEATURES, 32), torch.nn.Linear(32, tiny.CLASSES))
        return (fabric, plugin, *fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2)))

    fabric, plugin, model, optimizer = setup()
    _steps(fabric, model, optimizer, batches[:10])  # the inf batch (6) skipped, the scale grown since
    fabric.save(tmp_path / "with.ckpt", {"model": model, "optimizer": optimizer, "precision": plugin})
    fabric.save(tmp_path / "without.ckpt", {"model": model, "optimizer": optimizer})
    saved = plugin.scaler.state_dict()
    assert saved["skipped_steps"] == 1 and saved["scale"] != 2.0**16
    _steps(fabric, model, optimizer, batches[10:])
    for name, bitwise in (("with.ckpt", True), ("without.ckpt", False)):
        fabric2, plugin2, model2, optimizer2 = setup()
        state = {"model": model2, "optimizer": optimizer2}
        fabric2.load(tmp_path / name, {**state, "precision": plugin2} if bitwise else state)
        assert (plugin2.scaler.state_dict() == saved) is bitwise, name
        _steps(fabric2, model2, optimizer2, batches[10:])
        same = all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters(), strict=True))
        assert same is bitwise, name


def test_a_pin_holds_under_fabric() -> None:
    from mixprec.inspect import trace_dtypes

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    policy = mixprec.Policy().with_modules({"1": torch.float32})
    fabric = tiny.fabric(plugins=[MixprecPrecision("bf16-mixed", policy=policy, device="cpu")])
    wrapped = fabric.setup_module(model)
    with trace_dtypes(model) as trace:
        wrapped(torch.randn(3, 4))
    assert trace.counts["0"]["linear"] == {torch.bfloat16: 1}
    assert trace.counts["1"]["linear"] == {torch.float32: 1}


def test_each_framework_refuses_the_other_plugin() -> None:
    fabric = tiny.fabric(plugins=[trainer_plugin.MixprecPrecision("bf16-mixed")])
    model = fabric.setup_module(torch.nn.Linear(4, 2))
    with pytest.raises(TypeError, match=r"for lightning\.fabric\.Fabric use mixprec\.integrations\.fabric"):
        fabric.backward(model(torch.randn(3, 4)).sum())
    with pytest.raises(Exception, match="MixprecPrecision"):  # Lightning's own check names the plugin
        _tiny_lightning.trainer(plugins=[MixprecPrecision("bf16-mixed")])


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="'bf16-mixed' or '16-mixed'"):
        MixprecPrecision("32-true")
    with pytest.raises(ValueError, match=r"^precision='bf16-mixed' asks for torch\.bfloat16, but the policy"):
        MixprecPrecision("bf16-mixed", policy="16-mixed")  # names the precision given, as Lightning's plugin
    with pytest.raises(TypeError, match="mixprec.GradScaler"):
        MixprecPrecision("16-mixed", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError):
        MixprecPrecision("bf16-mixed", device="tpu")
    assert MixprecPrecision("16-mixed").scaler is not None and MixprecPrecision().scaler is None
