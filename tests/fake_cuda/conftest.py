"""The fake-CUDA tier: runs only on a CUDA build of torch (.ci/run runs it in a second environment).

On a CPU build every test here is collected and skipped with the reason below (a module-level
``pytest.skip`` in a conftest breaks ``pytest tests/fake_cuda``, where the conftest loads before
collection). The test modules import only what a CPU build has, so collecting them is safe.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from fake_cuda.harness import CAPABILITIES, fake_cuda

_HERE = Path(__file__).parent
_NO_CUDA = (
    f"tests/fake_cuda needs a CUDA build of torch (this is {torch.__version__}, built without CUDA); "
    ".ci/run runs them in .ci/.venv-cuda"
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.version.cuda is not None:
        return
    for item in items:
        if _HERE in Path(item.path).parents:
            item.add_marker(pytest.mark.skip(reason=_NO_CUDA))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    if report.when == "call":
        item.stash[_CALL_FAILED] = report.failed
    return report


_CALL_FAILED = pytest.StashKey[bool]()


@contextmanager
def _checked(request: pytest.FixtureRequest, capability: tuple[int, int]):
    """:func:`fake_cuda` whose device check fails the test once: a mismatch that made the test fail is not
    reported again at teardown (only one the code under test caught is)."""
    with fake_cuda(capability) as recorder:
        yield recorder
        if request.node.stash.get(_CALL_FAILED, False):
            recorder.device_errors.clear()


@pytest.fixture(params=CAPABILITIES, ids=lambda c: f"sm{c[0]}{c[1]}")
def capability(request: pytest.FixtureRequest) -> tuple[int, int]:
    """Each compute capability mixprec's CUDA branches distinguish."""
    return request.param


@pytest.fixture
def fake(request: pytest.FixtureRequest, capability: tuple[int, int]):
    """A fake CUDA mode at ``capability`` with a :class:`Recorder` inside it (device check on); yields the
    recorder."""
    with _checked(request, capability) as recorder:
        yield recorder


@pytest.fixture
def fake_hopper(request: pytest.FixtureRequest):
    """The fake CUDA mode at sm90 only, for paths the capability does not change."""
    with _checked(request, (9, 0)) as recorder:
        yield recorder


@pytest.fixture
def interpret(monkeypatch: pytest.MonkeyPatch):
    """Triton's CPU interpreter for this test, the fused-quantize switch unset; the fused module
    ``mixprec.lowbit.triton_quantize`` (imported here: it needs Triton). A module may define its own."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("MIXPREC_FUSED_QUANTIZE", raising=False)
    from mixprec.lowbit import triton_quantize

    return triton_quantize
