"""The folder tree of ``src/mixprec``, one line per file: its path and the first sentence of its docstring.

``docs/architecture.md`` holds it between the ``file-tree`` markers; ``tests/test_architecture.py`` fails
when the two differ (a file added, moved or removed, or a docstring's first sentence changed), and

    python docs/file_tree.py --write

rewrites the block from the code.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "mixprec"
DOC = ROOT / "docs" / "architecture.md"
START, END = "<!-- file-tree: start (python docs/file_tree.py --write) -->", "<!-- file-tree: end -->"


def summary(path: Path) -> str:
    """The first sentence of ``path``'s module docstring, with reST roles and literals as plain text."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    text = " ".join(doc.split("\n\n")[0].split())
    text = re.sub(r":mod:`~?([^`]+)`", r"`\1`", text)  # a module by its full name
    text = re.sub(r":[a-z]+:`~?([^`]+)`", lambda m: m.group(1).rpartition(".")[2], text)
    text = text.replace("``", "`")
    sentence = re.split(r"(?<=\.)\s", text, maxsplit=1)[0]
    return sentence or "(no docstring)"


def tree() -> str:
    """``src/mixprec/`` and below: folders first-level by name, each file with its summary."""
    files = sorted(PACKAGE.rglob("*.py"), key=lambda p: p.relative_to(PACKAGE).parts)
    rows: list[tuple[str, str]] = [("src/mixprec/", "")]
    seen: set[Path] = set()
    for path in files:
        relative = path.relative_to(PACKAGE)
        for depth, folder in enumerate(relative.parents[::-1][1:], start=1):
            if folder not in seen:
                seen.add(folder)
                rows.append(("  " * depth + f"{folder.name}/", ""))
        rows.append(("  " * len(relative.parts) + relative.name, summary(path)))
    width = max(len(name) for name, _ in rows) + 2
    return "\n".join(f"{name:<{width}}{text}".rstrip() for name, text in rows)


def block() -> str:
    return f"{START}\n\n```text\n{tree()}\n```\n\n{END}"


def documented() -> str:
    text = DOC.read_text(encoding="utf-8")
    start, end = text.find(START), text.find(END)
    if start < 0 or end < 0:
        raise SystemExit(f"{DOC}: no file-tree block (markers {START!r} ... {END!r})")
    return text[start : end + len(END)]


def main(argv: list[str]) -> int:
    if argv == ["--write"]:
        text = DOC.read_text(encoding="utf-8")
        DOC.write_text(text.replace(documented(), block()), encoding="utf-8")
        return 0
    if argv:
        print(f"usage: python docs/file_tree.py [--write]; got {argv}", file=sys.stderr)
        return 2
    print(tree())
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
