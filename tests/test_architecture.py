"""docs/architecture.md's import graph is the code's: every module-level import between mixprec's parts
is listed there with its reason, nothing listed is missing from the code, and the graph has no cycle."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "mixprec"
EDGE_LINE = re.compile(r"^- `([\w.]+)` -> `([\w.]+)`: \S")


def _part(module: str) -> str:
    """The part of mixprec a module belongs to: ``mixprec.scaling.unscale`` -> ``scaling``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "mixprec"


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def module_graph() -> dict[str, set[str]]:
    """Module -> the mixprec modules it imports when it is imported (top-level statements)."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # a name is resolved to the module it is, or else to the module it comes from
                targets = [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                inside = target != "mixprec" and name.startswith(target + ".")  # its own package
                if target.startswith("mixprec") and target != name and not inside:
                    graph[name].add(target)
    return graph


def part_edges() -> set[tuple[str, str]]:
    """Edges between parts; the package face (``mixprec/__init__``) importing its parts is left out."""
    return {
        (_part(a), _part(b))
        for a, targets in module_graph().items()
        if a != "mixprec"
        for b in targets
        if _part(a) != _part(b)
    }


def documented_edges() -> set[tuple[str, str]]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Import graph", 1)[1].split("\n## ", 1)[0]
    return {match.groups() for line in section.splitlines() if (match := EDGE_LINE.match(line))}


def test_documented_import_graph_is_the_codes():
    code, documented = part_edges(), documented_edges()
    assert code - documented == set(), "imports missing from docs/architecture.md"
    assert documented - code == set(), "docs/architecture.md lists imports the code does not make"


def test_no_import_cycle_between_modules():
    graph, done, cycles = module_graph(), set(), []

    def visit(name: str, stack: list[str]) -> None:
        stack.append(name)
        for target in graph[name]:
            if target in stack:
                cycles.append([*stack[stack.index(target) :], target])
            elif target not in done:
                visit(target, stack)
        stack.pop()
        done.add(name)

    for name in graph:
        if name not in done:
            visit(name, [])
    assert cycles == []


def test_the_planner_sits_on_lowbit_and_inspect_and_nothing_below_imports_it():
    """plan uses lowbit, autocast and inspect's measurements; inspect (diagnostics) never imports plan."""
    edges = part_edges()
    assert {b for a, b in edges if a == "plan"} <= {
        "lowbit",
        "autocast",
        "inspect",
        "formats",
        "policy",
        "_files",
        "optim",
    }
    assert ("inspect", "plan") not in edges
    assert {a for a, b in edges if b == "plan"} <= {"cli", "bench", "integrations"}


def test_the_documented_file_tree_is_the_codes():
    spec = importlib.util.spec_from_file_location("file_tree", ROOT / "docs" / "file_tree.py")
    assert spec is not None and spec.loader is not None
    file_tree = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(file_tree)
    assert file_tree.documented() == file_tree.block(), "run: python docs/file_tree.py --write"
    listed = [line.split()[0] for line in file_tree.tree().splitlines() if line.split()[0].endswith(".py")]
    assert len(listed) == len(list((ROOT / "src" / "mixprec").rglob("*.py")))  # every file, once
