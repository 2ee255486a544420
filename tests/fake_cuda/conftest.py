"""The fake-CUDA tier: runs only on a CUDA build of torch (.ci/run runs it in a second environment).

On a CPU build every test here is collected and skipped with the reason below (a module-level
``pytest.skip`` in a conftest breaks ``pytest tests/fake_cuda``, where the conftest loads before
collection). The test modules import only what a CPU build has, so collecting them is safe.
"""

from __future__ import annotations

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


@pytest.fixture(params=CAPABILITIES, ids=lambda c: f"sm{c[0]}{c[1]}")
def capability(request: pytest.FixtureRequest) -> tuple[int, int]:
    """Each compute capability mixprec's CUDA branches distinguish."""
    return request.param


@pytest.fixture
def fake(capability: tuple[int, int]):
    """A fake CUDA mode at ``capability`` with a :class:`Recorder` inside it; yields the recorder."""
    with fake_cuda(capability) as recorder:
        yield recorder


@pytest.fixture
def fake_hopper():
    """The fake CUDA mode at sm90 only, for paths the capability does not change."""
    with fake_cuda((9, 0)) as recorder:
        yield recorder
