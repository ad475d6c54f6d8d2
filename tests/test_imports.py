"""The ``ds_mtraining`` package has no import cycles, and every module imports cleanly.

The graph is built statically and models what Python runs: every module is parsed with ``ast`` and every
``import`` / ``from ... import`` at any depth (module level or inside functions) is an edge, so a cycle hidden by
a function-local import still counts; importing a submodule is also an edge to each package ``__init__`` above it
(Python runs those first). Imports under ``if TYPE_CHECKING:`` never run and are not edges.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import ds_mtraining

PACKAGE = "ds_mtraining"
ROOT = Path(ds_mtraining.__file__).resolve().parent


def _module_files() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__.py``)."""
    modules = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


MODULES = _module_files()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _resolve(name: str) -> str | None:
    """``name`` if it is one of the package's modules, else its longest prefix that is, else None."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(module: str) -> set[str]:
    """The package's modules that ``module`` imports anywhere in its source."""
    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    package = module if _is_package(module) else module.rpartition(".")[0]
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
        for stmt in node.body
        for inner in ast.walk(stmt)
    }
    targets: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            # ``from base import name`` is an edge to the submodule ``base.name`` where there is one, else to ``base``.
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        for name in names:
            if name == PACKAGE or name.startswith(PACKAGE + "."):
                resolved = _resolve(name)
                if resolved is not None:
                    targets |= _with_parent_packages(resolved)
    # A module's own parent packages have run before it; an edge to them is no cycle of its making.
    return targets - _with_parent_packages(module)


def _with_parent_packages(name: str) -> set[str]:
    """``name`` and every package above it inside ``ds_mtraining`` (the package root itself excluded)."""
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(2, len(parts) + 1)}


def _graph() -> dict[str, set[str]]:
    return {module: _imports(module) for module in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per back edge that a depth-first search meets (each as ``[a, b, ..., a]``)."""
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                cycles.append(path[path.index(target) :] + [target])
            elif target not in state:
                visit(target)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return cycles


def test_graph_sees_lazy_and_relative_imports():
    """The walker resolves relative, function-local and ``from package import submodule`` imports."""
    graph = _graph()
    assert "ds_mtraining.sparse.index" in graph["ds_mtraining.sparse.attention"]
    assert "ds_mtraining.sparse.torch_path" in graph["ds_mtraining.sparse.attention"]
    assert "ds_mtraining.sparse.triton.ops" in graph["ds_mtraining.sparse.triton"]
    # Importing a submodule runs its package's __init__ first: an edge to the package too.
    assert "ds_mtraining.sparse.triton" in graph["ds_mtraining.sparse.backends"]
    # Annotation-only imports never run.
    assert "ds_mtraining.sparse.index" not in graph["ds_mtraining.sparse.triton.ops"]


def test_no_import_cycles():
    cycles = _cycles(_graph())
    report = "\n".join(" -> ".join(cycle) for cycle in cycles)
    assert not cycles, f"import cycles in {PACKAGE}:\n{report}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_imports(module: str):
    importlib.import_module(module)
