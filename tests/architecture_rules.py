"""The dependency rules of docs/architecture.md as functions over a source tree, so that tests/test_architecture.py
can check them on ``src/kvoffload`` and show each one failing on a small tree that breaks it.

A module's imports are every ``import`` and ``from ... import`` in its file, at any depth (an import inside a
function still runs, only later). ``from package import name`` depends on ``package.name`` when that is a module
of the tree, else on ``package`` itself.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable
from pathlib import Path

Graph = dict[str, set[str]]


def module_name(root: Path, path: Path) -> str:
    """``root/a/b.py`` -> ``<root name>.a.b``; a package's ``__init__.py`` is the package."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_graph(root: Path) -> Graph:
    """Each module of the package at ``root`` -> the modules of the same tree it imports (itself excluded)."""
    files = {module_name(root, p): p for p in root.rglob("*.py")}
    return {name: _imports(path, files) - {name} for name, path in files.items()}


def _imports(path: Path, modules: Iterable[str]) -> set[str]:
    known = set(modules)
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in known else node.module)
    return found & known


def cycles(graph: Graph) -> list[list[str]]:
    """The import cycles of ``graph``: its strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def imports_into(graph: Graph, importers: Iterable[str], forbidden: Iterable[str]) -> list[tuple[str, str]]:
    """Every ``(module, imported)`` where ``module`` is under one of ``importers`` and ``imported`` under one of
    ``forbidden`` (dotted prefixes: ``a.b`` covers ``a.b`` and ``a.b.c``)."""
    def under(name: str, prefixes: Iterable[str]) -> bool:
        return any(name == p or name.startswith(p + ".") for p in prefixes)

    importers, forbidden = tuple(importers), tuple(forbidden)
    return sorted((m, w) for m, deps in graph.items() if under(m, importers) for w in deps if under(w, forbidden))


def oversized(root: Path, limit: int) -> dict[str, int]:
    """Files of ``root`` (relative paths) longer than ``limit`` lines, with their lengths."""
    lengths = {str(p.relative_to(root)): len(p.read_text().splitlines()) for p in root.rglob("*.py")}
    return {path: n for path, n in sorted(lengths.items()) if n > limit}


def reach(graph: Graph, start: str, within: str) -> set[str]:
    """The modules under ``within`` that ``start`` imports, directly or through other modules under ``within``."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for dep in graph.get(todo.pop(), ()):
            if dep not in seen and (dep == within or dep.startswith(within + ".")):
                seen.add(dep)
                todo.append(dep)
    return seen


def tier_crossings(graph: Graph, tiers: str) -> list[tuple[str, str]]:
    """``(index or handler, the other)`` for each tier folder under the package ``tiers`` whose scheduler-side
    index reaches its worker-side handler through the tier's own modules, or the reverse (the tier's spec, which
    makes both, may import both)."""
    depth = tiers.count(".") + 2  # tiers.<folder>.<module>
    folders = sorted({m.rsplit(".", 1)[0] for m in graph if m.startswith(tiers + ".") and m.count(".") >= depth})
    found: list[tuple[str, str]] = []
    for folder in folders:
        index, handler = f"{folder}.index", f"{folder}.handler"
        if index in graph and handler in reach(graph, index, folder):
            found.append((index, handler))
        if handler in graph and index in reach(graph, handler, folder):
            found.append((handler, index))
    return found


def foreign_tier_imports(graph: Graph, tiers: str, shared: str = "lower") -> list[tuple[str, str]]:
    """``(module, imported)`` for each module of a tier folder under ``tiers`` that imports a module of another
    tier folder; the folder ``shared`` holds what tiers share, and any tier may import it."""
    depth = tiers.count(".") + 2  # tiers.<folder>.<module>

    def folder(module: str) -> str | None:
        parts = module.split(".")
        return parts[depth - 1] if module.startswith(tiers + ".") and len(parts) > depth else None

    return sorted((m, dep) for m, deps in graph.items() for dep in deps
                  if (own := folder(m)) is not None and (other := folder(dep)) is not None
                  and other not in (own, shared))


def tier_halves(graph: Graph, tiers: str) -> tuple[set[str], set[str]]:
    """The modules under ``tiers`` of each half, derived from file names: a module named ``index`` or ``*_index``
    (an index, scheduler side) or ``handler`` (a handler, worker side), with what it reaches under ``tiers``. A
    module both sides reach (a codec, object names, a breaker) belongs to neither half; one side reaching the
    other's index or handler is ``tier_crossings``'s to report."""
    def side(is_root: Callable[[str], bool]) -> set[str]:
        roots = {m for m in graph if m.startswith(tiers + ".") and is_root(m.rsplit(".", 1)[1])}
        return roots.union(*(reach(graph, m, tiers) for m in roots))

    scheduler = side(lambda name: name == "index" or name.endswith("_index"))
    worker = side(lambda name: name == "handler")
    return scheduler - worker, worker - scheduler
