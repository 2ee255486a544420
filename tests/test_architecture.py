"""docs/architecture.md's import graph is the code's: every import between mixprec's parts (module-level
and inside functions) is listed there with its reason, nothing listed is missing from the code, and no
module imports itself in a circle, not even through an import made inside a function.

Imports under ``if TYPE_CHECKING:`` are left out of both: they never run, so they cannot make an import
cycle, and they name types for the checker, not a dependency of the running code."""

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


def _imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of a module, at any depth (functions, classes, try/if blocks), except those
    under ``if TYPE_CHECKING:``."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(inner) for stmt in node.body for inner in ast.walk(stmt)}
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skipped
    ]


def module_graph(lazy: bool = True) -> dict[str, set[str]]:
    """Module -> the mixprec modules it imports: at import time (its top-level statements) and, with
    ``lazy``, inside its functions too."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        for node in _imports(tree) if lazy else tree.body:
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


def part_edges(lazy: bool = True) -> set[tuple[str, str]]:
    """Edges between parts; the package face (``mixprec/__init__``) importing its parts is left out."""
    return {
        (_part(a), _part(b))
        for a, targets in module_graph(lazy).items()
        if a != "mixprec"
        for b in targets
        if _part(a) != _part(b)
    }


def documented_edges() -> tuple[set[tuple[str, str]], set[tuple[str, str]]]:
    """The edges docs/architecture.md lists: (imported at import time, imported only inside functions)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Import graph", 1)[1].split("\n## ", 1)[0]
    eager, lazy = section.split(LAZY_HEADING, 1)

    def edges(part: str) -> set[tuple[str, str]]:
        return {match.groups() for line in part.splitlines() if (match := EDGE_LINE.match(line))}

    return edges(eager), edges(lazy)


LAZY_HEADING = "Imports made only inside functions"


def test_documented_import_graph_is_the_codes():
    eager, everything = part_edges(lazy=False), part_edges()
    documented_eager, documented_lazy = documented_edges()
    assert eager - documented_eager == set(), "imports missing from docs/architecture.md"
    assert documented_eager - eager == set(), "docs/architecture.md lists imports the code does not make"
    lazy = everything - eager
    assert lazy - documented_lazy == set(), f"function-local imports missing from '{LAZY_HEADING}'"
    assert documented_lazy - lazy == set(), f"'{LAZY_HEADING}' lists imports the code does not make there"


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan): each holds at least one cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(name: str) -> None:
        index[name] = low[name] = len(index)
        stack.append(name)
        for target in sorted(graph[name]):
            if target not in index:
                visit(target)
                low[name] = min(low[name], low[target])
            elif target in stack:
                low[name] = min(low[name], index[target])
        if low[name] == index[name]:
            component = []
            while (top := stack.pop()) != name:
                component.append(top)
            if component:
                found.append(sorted([name, *component]))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return found


def test_no_import_cycle_between_modules_not_even_inside_functions():
    cycles = import_cycles(module_graph(lazy=True))
    assert cycles == [], f"modules that import each other in a circle (some inside functions): {cycles}"


def test_the_optimizer_steps_never_import_the_wrappers():
    """optim's data flows up: state formats, rounding, the guard and FSDP2's shards feed the update steps
    (foreach, fused, low-bit), which feed the wrapper base, which the two wrappers build on; nothing below
    the wrapper base imports it, the wrappers or their state-dict checks, even inside a function."""
    graph = module_graph(lazy=True)
    upper = {f"mixprec.optim.{name}" for name in ("wrapper", "state", "compensated", "masters")}
    below = {name for name in graph if name.startswith("mixprec.optim.")} - upper
    assert {(a, b) for a in below for b in graph[a] if b in upper | {"mixprec.optim"}} == set()


def test_the_planner_sits_on_lowbit_and_inspect_and_nothing_below_imports_it():
    """plan uses lowbit, autocast and inspect's measurements; inspect (diagnostics) never imports plan.
    Function-local imports count: only ``mixprec plan --workload`` reaches up, for a bench workload."""
    edges = part_edges()
    assert {b for a, b in edges if a == "plan"} <= {
        "bench",  # plan/command.py, when run with --workload: the CLI command, not the planner
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
