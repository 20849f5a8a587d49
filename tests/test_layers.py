"""The package's floors: ``dyntree.kernels`` (Triton kernels, CPU ops and the formats and references
they define) imports no other ``dyntree`` package, so the core and the engines build on it and
never the reverse. Read from the sources' import statements, without importing anything."""

from __future__ import annotations

import ast
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[1] / "dyntree" / "kernels"


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
