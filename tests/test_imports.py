"""The package's imports form no cycle: a module a newcomer reads never needs the module that
imports it. ``from P import name`` counts as an import of P (it reads P's namespace) and of
``P.name`` when that is a module. Imports inside functions and under ``if TYPE_CHECKING:``
count too: a deferred or type-only import hides a cycle without removing it (the reader still
needs both modules to understand either); move what both need to the lower module instead."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "avionics"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_imports(path: Path, modules: set[str]) -> set[str]:
    """The avionics modules that ``path`` imports."""
    return imports_of(path.read_text(), module_name(path), path.name == "__init__.py", modules)


def imports_of(source: str, name: str, is_package: bool, modules: set[str]) -> set[str]:
    """The ``modules`` that the source of module ``name`` imports, anywhere in it."""
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {m for m in found if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    paths = list(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): module_imports(p, modules) for p in paths}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_package_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


def test_the_check_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    graph = import_graph()
    assert "avionics.persample" in graph["avionics.quantities.base"]


def test_the_check_sees_deferred_and_type_only_imports():
    source = """
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from avionics.a import A


def f():
    from . import b
"""
    found = imports_of(source, "avionics.c", False, {"avionics.a", "avionics.b"})
    assert found == {"avionics.a", "avionics.b"}
