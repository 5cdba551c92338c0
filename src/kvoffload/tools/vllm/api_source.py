"""vLLM's Python source, read without importing it: from a wheel file or an installed ``site-packages``.

The reading half of the API check (api_check.py compares what this finds with api_surface.py): files by path,
parsed lazily with ``ast``, the names a module binds at top level, and where in the tree a name is defined (to
name the new home of a name that moved).
"""

from __future__ import annotations

import ast
import re
import zipfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from functools import cache
from pathlib import Path


class VllmSource:
    """vLLM's Python files by path inside the package tree ("vllm/v1/request.py"), read lazily."""

    def __init__(self, read: Callable[[str], str | None], origin: str,
                 paths: Callable[[], Iterable[str]] = tuple) -> None:
        """``read``: a file's text by path, None when absent; ``paths``: every ``.py`` path (for ``where_defined``)."""
        self._read = read
        self._paths = paths
        self.origin = origin
        self._module = cache(self._parse)

    @classmethod
    def open(cls, path: Path, overrides: Mapping[str, str] | None = None) -> VllmSource:
        """A wheel file, or a directory holding the ``vllm`` package (site-packages); ``overrides`` replace files."""
        changed = dict(overrides or {})
        if path.is_dir():
            def read(name: str) -> str | None:
                if name in changed:
                    return changed[name]
                file = path / name
                return file.read_text() if file.is_file() else None

            def paths() -> Iterable[str]:
                found = {str(f.relative_to(path)) for f in (path / "vllm").rglob("*.py")}
                return sorted(found | changed.keys())
        else:
            wheel = zipfile.ZipFile(path)
            names = set(wheel.namelist())

            def read(name: str) -> str | None:
                if name in changed:
                    return changed[name]
                return wheel.read(name).decode() if name in names else None

            def paths() -> Iterable[str]:
                found = {n for n in names if n.startswith("vllm/") and n.endswith(".py")}
                return sorted(found | changed.keys())
        return cls(read, str(path), paths)

    def module(self, dotted: str) -> ast.Module | None:
        """The parsed module (``a/b.py`` or the package ``a/b/__init__.py``); None when the source lacks it."""
        found = self._module(dotted)
        return found[0] if found is not None else None

    def absolute(self, module: str, node: ast.ImportFrom) -> str:
        """The module an ``import from`` inside ``module`` names, relative imports resolved."""
        if node.level == 0:
            return node.module or ""
        found = self._module(module)
        package = module if found is not None and found[1] else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        return f"{package}.{node.module}" if node.module else package

    def _parse(self, dotted: str) -> tuple[ast.Module, bool] | None:
        base = dotted.replace(".", "/")
        for name, is_package in ((f"{base}.py", False), (f"{base}/__init__.py", True)):
            text = self._read(name)
            if text is not None:
                return ast.parse(text, filename=name), is_package
        return None

    @property
    def version(self) -> str:
        """The release the source says it is (``vllm/_version.py``), "unknown" when it does not say."""
        tree = self.module("vllm._version")
        for node in tree.body if tree is not None else ():
            if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                    and isinstance(node.value.value, str)
                    and any(isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets)):
                return node.value.value
        return "unknown"

    def where_defined(self, name: str) -> list[str]:
        """The modules that define ``name`` at top level (a def, class or assignment, not an import), sorted."""
        pattern = re.compile(rf"^(?:(?:async )?def|class) {re.escape(name)}\b|^{re.escape(name)}\s*[:=]", re.M)
        found = []
        for path in self._paths():
            text = self._read(path)
            if text is None or pattern.search(text) is None:
                continue
            module = path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
            tree = self.module(module)
            node = defined_names(tree).get(name) if tree is not None else None
            if node is not None and not isinstance(node, ast.Import | ast.ImportFrom):
                found.append(module)
        return sorted(found)


def _top_level(tree: ast.Module) -> Iterator[ast.stmt]:
    """Module-level statements, including those inside ``if``/``try`` blocks (TYPE_CHECKING, fallbacks)."""
    stack = list(reversed(tree.body))
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If | ast.Try):
            inner = node.body + node.orelse + (node.finalbody if isinstance(node, ast.Try) else [])
            if isinstance(node, ast.Try):
                inner += [s for h in node.handlers for s in h.body]
            stack.extend(reversed(inner))
        else:
            yield node


def defined_names(tree: ast.Module) -> dict[str, ast.stmt]:
    """Every name the module binds at top level: defs, classes, assignments, imports."""
    names: dict[str, ast.stmt] = {}
    for node in _top_level(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                for t in ast.walk(target):
                    if isinstance(t, ast.Name):
                        names[t.id] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                names.setdefault((alias.asname or alias.name).split(".")[0], node)
    return names


def installed_vllm_root() -> Path:
    """The directory holding the installed ``vllm`` package, found without importing it."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("vllm is not installed in this environment")
    return Path(next(iter(spec.submodule_search_locations))).parent
