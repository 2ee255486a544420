"""The documentation site cannot rot: every Python block in docs/ runs, every page is in a toctree,
and the API checker reports a public name that has no reference entry.

A page's ```python blocks run in order in one fresh namespace, as a reader would run them, on the CPU.
A block is skipped only when the line before it is ``<!-- docs: no-run (why) -->`` with a reason.
The strict Sphinx build and ``docs/check_api.py`` on its inventory run in ``.ci/run``.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
_BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
_NO_RUN = re.compile(r"<!--\s*docs:\s*no-run\s*\((?P<why>[^)]+)\)\s*-->\s*$")


def pages() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.parts)


def python_blocks(page: Path) -> list[tuple[int, str, str | None]]:
    """(line, code, reason it is skipped or None) for each ```python block of ``page``."""
    text = page.read_text()
    blocks = []
    for match in _BLOCK.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        skip = _NO_RUN.search(before)
        blocks.append((line, match.group(1), skip.group("why").strip() if skip else None))
    return blocks


PAGES_WITH_CODE = [p for p in pages() if python_blocks(p)]


@pytest.mark.parametrize("page", PAGES_WITH_CODE, ids=lambda p: str(p.relative_to(DOCS)))
def test_page_code_runs(page: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)  # a block that writes a file (plan.png) writes it here, not into docs/
    namespace: dict[str, object] = {"__name__": "__docs__"}
    for line, code, skipped in python_blocks(page):
        if skipped:
            continue
        try:
            exec(compile(code, f"{page.relative_to(ROOT)}:{line}", "exec"), namespace)
        except Exception as exc:
            raise AssertionError(f"the block at {page.relative_to(ROOT)}:{line} raised {exc!r}") from exc


def test_blocks_are_counted_and_skips_give_a_reason(capsys: pytest.CaptureFixture[str]) -> None:
    run = skipped = 0
    for page in pages():
        text = page.read_text()
        # a no-run mark must sit right before a python block and say why
        for mark in re.finditer(r"<!--\s*docs:\s*no-run.*?-->", text):
            assert _NO_RUN.search(mark.group(0)), f"{page.name}: {mark.group(0)!r} gives no (reason)"
        marks = len(re.findall(r"<!--\s*docs:\s*no-run", text))
        blocks = python_blocks(page)
        assert marks == sum(1 for *_, why in blocks if why), (
            f"{page.name}: a no-run mark is not before a block"
        )
        run += sum(1 for *_, why in blocks if why is None)
        skipped += sum(1 for *_, why in blocks if why)
    with capsys.disabled():
        print(f"\ndocs: {run} python blocks run, {skipped} marked no-run")
    assert run >= 5  # the guide's first loop alone has six


def _toctree_entries(page: Path) -> list[Path]:
    text = page.read_text()
    if page.suffix == ".md":
        bodies = re.findall(r"^```\{toctree\}\n(.*?)^```", text, re.S | re.M)
    else:
        bodies = re.findall(r"^\.\. toctree::\n((?:[ \t]+.*\n|\n)*)", text, re.M)
    entries = []
    for body in bodies:
        for raw in body.splitlines():
            entry = raw.strip()
            if entry and not entry.startswith(":"):
                entries.append(page.parent / entry)
    return entries


def test_every_page_is_reachable_from_the_index() -> None:
    sources = {
        p.with_suffix("") for p in DOCS.rglob("*") if p.suffix in (".md", ".rst") and "_build" not in p.parts
    }
    reached, todo = set(), [DOCS / "index"]
    while todo:
        doc = todo.pop()
        if doc in reached:
            continue
        reached.add(doc)
        source = next(doc.with_suffix(s) for s in (".md", ".rst") if doc.with_suffix(s).exists())
        for entry in _toctree_entries(source):
            assert entry in sources, f"{source.name}'s toctree names {entry}, which is not a page"
            todo.append(entry)
    assert sources - reached == set(), f"pages in no toctree: {sorted(map(str, sources - reached))}"


def _check_api():
    spec = importlib.util.spec_from_file_location("check_api", DOCS / "check_api.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["check_api"] = module
    spec.loader.exec_module(module)
    return module


def test_api_checker_names_a_public_name_without_an_entry() -> None:
    import mixprec
    import mixprec.formats
    import mixprec.policy

    check = _check_api()
    faces = [mixprec.formats]
    inventory = {"mixprec.formats": "py:module"}
    inventory |= {f"mixprec.formats.{n}": "py:data" for n in mixprec.formats.__all__ if n != "FP16"}
    assert check.missing_names(inventory, faces) == (["mixprec.formats.FP16"], len(mixprec.formats.__all__))
    inventory["mixprec.formats.FP16"] = "py:data"
    assert check.missing_names(inventory, faces)[0] == []
    # a re-export is covered by the entry of the same object elsewhere; the face needs a module entry
    inventory = {"mixprec.Policy": "py:class"}
    missing, _ = check.missing_names(inventory, [mixprec.policy])
    assert mixprec.Policy is mixprec.policy.Policy and "mixprec.policy.Policy" not in missing
    assert {"mixprec.policy (the module itself)", "mixprec.policy.ResolvedPolicy"} <= set(missing)
