"""The package's floors: ``dyntree.kernels`` (Triton kernels, CPU ops and the formats and references
they define) imports no other ``dyntree`` package, so the core and the engines build on it and
never the reverse; and no two modules depend on each other, directly or around a circle. Read
from the sources' import statements, without importing anything."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dyntree"
KERNELS = PACKAGE / "kernels"


def _dyntree_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {n for n in names if n == "dyntree" or n.startswith("dyntree.")}


def test_kernels_import_no_other_dyntree_package() -> None:
    files = sorted(KERNELS.rglob("*.py"))
    assert files
    crossing = {f"{p.relative_to(KERNELS)}: {m}" for p in files for m in _dyntree_imports(p)
                if not m.startswith("dyntree.kernels")}
    assert not crossing, f"dyntree.kernels must import only torch and triton: {sorted(crossing)}"


def _module(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _stated_imports(path: Path, modules: set[str]) -> set[str]:
    """The ``dyntree`` modules ``path`` imports anywhere (functions included: a deferred import is a
    dependency too), except under ``if TYPE_CHECKING:``; ``from package import module`` names the
    module."""
    found: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test):
                visit(node.orelse)
                continue
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules]
                found.update(subs or [node.module])
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.stmt):
                    visit([child])

    visit(ast.parse(path.read_text()).body)
    return {m for m in found if m in modules}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), and self-imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = [[m] for m, deps in graph.items() if m in deps]

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_in_the_package() -> None:
    files = {_module(p): p for p in PACKAGE.rglob("*.py")}
    graph = {m: _stated_imports(p, set(files)) for m, p in files.items()}
    assert sum(map(len, graph.values())) > 50  # the walk sees the package's imports
    assert not _cycles(graph), f"modules that import each other: {_cycles(graph)}"


def test_the_cycle_check_finds_a_circle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"a"}}) == [["a"]] and not _cycles({"a": {"b"}, "b": set()})
