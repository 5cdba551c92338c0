"""Check vLLM's source, without importing it, against the API the adapter uses (api_surface.py).

vLLM releases its CUDA wheel before the CPU build this project can run, and renames or extends its KV connector
API between releases. This reads a release's Python source with ``ast`` (from a wheel file, or an installed
``site-packages``) and compares every class, method signature, field and module name that ``api_surface.SURFACE``
declares with what the source defines, and reports each difference as a ``Drift``. ``make vllm-api-check`` runs it
on the newest wheel; tests/tools/vllm/test_api_check.py runs it on the installed vLLM (proving the table) and on
altered sources (proving it fails).

What it compares: names and kinds (method, classmethod, property, field), parameter names, order and kinds, and
which parameters have defaults; fields a class is constructed with; abstract methods and new hooks of a class
whose every hook the table lists; for a name missing where the adapter imports it, the modules that define it now
(a moved name); and the order in which vLLM's model runners call the connector's hooks
(``api_surface.CALL_ORDERS``). Not annotations or other behaviour: the end-to-end tests and the simulated engine
prove those on the releases the adapter is tested with.

Usage: ``python -m kvoffload.tools.vllm.api_check WHEEL_OR_SITE_PACKAGES`` (exit status 1 on drift).
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvoffload.integrations.vllm import compat
from kvoffload.tools.vllm.api_source import VllmSource, defined_names, installed_vllm_root
from kvoffload.tools.vllm.api_surface import (
    CALL_ORDERS,
    CONNECTOR_BASE,
    SURFACE,
    CallOrder,
    ClassUse,
    Member,
    ModuleUse,
    Release,
    Use,
)

__all__ = ["Drift", "VllmSource", "check", "format_report", "installed_vllm_root", "main", "signature"]


@dataclass(frozen=True)
class Drift:
    """One difference between the table and vLLM's source. ``expected``/``found``: signatures, when both exist."""

    where: str
    member: str
    problem: str
    expected: str | None = None
    found: str | None = None


# ---- what the source defines --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Found:
    """A class member as the source defines it: its signature in the table's notation, and facts about it."""

    signature: str
    is_method: bool
    is_abstract: bool = False
    has_default: bool = True


_KINDS = {"classmethod": "@classmethod ", "staticmethod": "@staticmethod ", "property": "@property ",
          "cached_property": "@property "}


def signature(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """``fn`` in the table's notation: ``@classmethod name(cls, a, b=..., *, c, **kwargs)``, no annotations."""
    kind = next((_KINDS[n] for n in map(_decorator_name, fn.decorator_list) if n in _KINDS), "")
    if kind == "@property ":
        return f"{kind}{fn.name}"
    a = fn.args
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    parts = [p.arg + ("=..." if d is not None else "") for p, d in zip(positional, defaults, strict=True)]
    if a.posonlyargs:
        parts.insert(len(a.posonlyargs), "/")
    if a.vararg is not None:
        parts.append(f"*{a.vararg.arg}")
    elif a.kwonlyargs:
        parts.append("*")
    parts += [k.arg + ("=..." if d is not None else "") for k, d in zip(a.kwonlyargs, a.kw_defaults, strict=True)]
    if a.kwarg is not None:
        parts.append(f"**{a.kwarg.arg}")
    return f"{kind}{fn.name}({', '.join(parts)})"


def _decorator_name(node: ast.expr) -> str:
    target = node.func if isinstance(node, ast.Call) else node
    if isinstance(target, ast.Attribute):
        return target.attr
    return target.id if isinstance(target, ast.Name) else ""


def _class_members(cls: ast.ClassDef) -> dict[str, Found]:
    members: dict[str, Found] = {}
    for node in cls.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for inner in ast.walk(node):
                for attribute in _self_targets(inner):
                    members.setdefault(attribute, Found(attribute, is_method=False))
            is_abstract = "abstractmethod" in map(_decorator_name, node.decorator_list)
            members[node.name] = Found(signature(node), is_method=True, is_abstract=is_abstract)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if not _is_classvar(node.annotation):
                members[node.target.id] = Found(node.target.id, is_method=False, has_default=node.value is not None)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    members[target.id] = Found(target.id, is_method=False)
    return members


def _self_targets(node: ast.AST) -> Iterator[str]:
    """The ``x`` of every ``self.x = ...`` (or ``self.x: T = ...``) that ``node`` is."""
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, ast.AnnAssign):
        targets = [node.target]
    else:
        return
    for target in targets:
        for t in ast.walk(target):
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                yield t.attr


def _is_classvar(annotation: ast.expr) -> bool:
    text = ast.unparse(annotation)
    return text.startswith(("ClassVar", "typing.ClassVar"))


class Resolver:
    """Finds classes and their members (own first, then bases, through imports) in a ``VllmSource``."""

    def __init__(self, source: VllmSource) -> None:
        self.source = source

    def find_class(self, module: str, name: str, depth: int = 0) -> tuple[str, ast.ClassDef] | None:
        tree = self.source.module(module)
        node = defined_names(tree).get(name) if tree is not None else None
        if isinstance(node, ast.ClassDef):
            return module, node
        if isinstance(node, ast.ImportFrom) and depth < 5:
            original = next((a.name for a in node.names if (a.asname or a.name) == name), name)
            return self.find_class(self.source.absolute(module, node), original, depth + 1)
        return None

    def members(self, module: str, cls: ast.ClassDef, depth: int = 0) -> dict[str, Found]:
        own = _class_members(cls)
        if depth > 8:
            return own
        inherited: dict[str, Found] = {}
        for base in reversed(cls.bases):
            name = ast.unparse(base).split("[")[0]
            found = self.find_class(module, name) if "." not in name else None
            if found is not None:
                inherited.update(self.members(found[0], found[1], depth + 1))
        return {**inherited, **own}


# ---- comparing ----------------------------------------------------------------------------------------------


def check(source: VllmSource, surface: tuple[ClassUse | ModuleUse, ...] = SURFACE,
          orders: tuple[CallOrder, ...] = CALL_ORDERS) -> list[Drift]:
    """Every difference between ``surface`` (and ``orders``) and ``source``; empty when the adapter's uses all
    hold."""
    release = compat.release(source.version)
    resolver = Resolver(source)
    drifts: list[Drift] = []
    for use in surface:
        if isinstance(use, ModuleUse):
            drifts += _check_module(resolver, use, release)
        else:
            drifts += _check_class(resolver, use, release)
    hooks = frozenset(m.name for m in CONNECTOR_BASE.members)
    for order in orders:
        drifts += _check_order(resolver, order, hooks, release)
    return drifts


def _in_range(since: Release | None, until: Release | None, release: tuple[int, int, int] | None) -> bool:
    """Whether a source of ``release`` must have what the table dates ``[since, until]`` (unknown: yes)."""
    if release is None:
        return True
    return (since is None or release[:2] >= since) and (until is None or release[:2] <= until)


def _is_due(member: Member, release: tuple[int, int, int] | None) -> bool:
    """Whether the source must have ``member``: only a source outside its ``since``/``until`` may lack it."""
    return _in_range(member.since, member.until, release)


def _check_module(resolver: Resolver, use: ModuleUse, release: tuple[int, int, int] | None) -> list[Drift]:
    if not _in_range(use.since, use.until, release):
        return []
    tree = resolver.source.module(use.module)
    if tree is None:
        return [Drift(use.module, "", "module not found")]
    names = defined_names(tree)
    drifts = [Drift(use.module, name, _not_defined(resolver.source, name, "name")) for name in use.names
              if name not in names and resolver.source.module(f"{use.module}.{name}") is None]
    for member in use.functions:
        node = names.get(member.name)
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            if _is_due(member, release):
                drifts.append(Drift(use.module, member.name, _not_defined(resolver.source, member.name, "function"),
                                    member.signature))
            continue
        if _is_due(member, release):
            drifts += _compare(use.module, member, Found(signature(node), is_method=True))
    return drifts


def _not_defined(source: VllmSource, name: str, kind: str) -> str:
    """The problem of a name missing where the adapter imports it, naming where vLLM defines it now, if anywhere."""
    homes = source.where_defined(name)
    return f"{kind} not defined" + (f"; moved? vLLM defines it in {', '.join(homes)}" if homes else "")


def _check_class(resolver: Resolver, use: ClassUse, release: tuple[int, int, int] | None) -> list[Drift]:
    if not _in_range(use.since, None, release):
        return []
    where = f"{use.module}.{use.name}"
    found_cls = resolver.find_class(use.module, use.name)
    if found_cls is None:
        return [Drift(where, "", _not_defined(resolver.source, use.name, "class"))]
    members = resolver.members(*found_cls)
    drifts: list[Drift] = []
    for member in use.members:
        found = members.get(member.name)
        if found is None:
            if member.use is not Use.INHERIT and _is_due(member, release):
                drifts.append(Drift(where, member.name, f"missing (the adapter {member.use.value}s it)",
                                    member.signature))
            continue
        drifts += _compare(where, member, found)
    listed = {m.name for m in use.members}
    if use.every_hook:
        for name, found in _class_members(found_cls[1]).items():
            if found.is_method and name not in listed:
                problem = ("abstract in vLLM and not implemented by the connector" if found.is_abstract
                           else "new in vLLM and not in the table: override it, or list it as inherited")
                drifts.append(Drift(where, name, problem, found=found.signature))
    if use.constructs:
        for name, found in members.items():
            if not found.is_method and not found.has_default and name not in listed:
                drifts.append(Drift(where, name, "a required field the adapter does not pass when it builds one"))
    return drifts


def _compare(where: str, member: Member, found: Found) -> list[Drift]:
    if member.use is Use.READ or member.use is Use.INHERIT:
        return []
    if member.use is Use.OVERRIDE:
        ok = found.signature == member.signature
    else:
        ok = _accepts(member.signature, found.signature)
    if ok:
        return []
    problem = "signature differs (the connector overrides it)" if member.use is Use.OVERRIDE else \
        "signature no longer takes the adapter's call"
    return [Drift(where, member.name, problem, member.signature, found.signature)]


def _check_order(resolver: Resolver, order: CallOrder, hooks: frozenset[str],
                 release: tuple[int, int, int] | None) -> list[Drift]:
    if not _in_range(order.since, order.until, release):
        return []
    where = f"{order.module}.{order.function}"
    fn = _function(resolver, order.module, order.function)
    if fn is None:
        return [Drift(where, "", "function not found (the adapter was tested with the hooks it calls)")]
    watched = hooks | set(order.calls)
    calls = sorted((c.lineno, c.col_offset, c.func.attr) for c in ast.walk(fn)
                   if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute) and c.func.attr in watched)
    found = tuple(name for _, _, name in calls)
    if found == order.calls:
        return []
    return [Drift(where, "(hook calls)", f"calls the connector in another order than the adapter was tested "
                  f"with ({order.why})", ", ".join(order.calls), ", ".join(found))]


def _function(resolver: Resolver, module: str, qualified: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    owner, _, name = qualified.rpartition(".")
    if owner:
        found = resolver.find_class(module, owner)
        body: list[ast.stmt] = found[1].body if found is not None else []
    else:
        tree = resolver.source.module(module)
        body = tree.body if tree is not None else []
    return next((n for n in body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == name), None)


def _accepts(called: str, found: str) -> bool:
    """Whether a call shaped like ``called`` (its parameters, in order) still fits ``found``.

    ``found`` must be of the same kind and start with the same parameters in the same order; any further
    parameter of it must have a default or be variadic.
    """
    called_kind, called_params = _split(called)
    found_kind, found_params = _split(found)
    head = [p.removesuffix("=...") for p in found_params[:len(called_params)]]
    if called_kind != found_kind or head != [p.removesuffix("=...") for p in called_params]:
        return False
    return all(p.endswith("=...") or p.startswith("*") or p == "/" for p in found_params[len(called_params):])


def _split(sig: str) -> tuple[str, list[str]]:
    """``"@classmethod f(cls, a=...)"`` -> ``("@classmethod", ["cls", "a=..."])``."""
    head, _, params = sig.partition("(")
    kind = head.rpartition(" ")[0]
    return kind, [p.strip() for p in params.rstrip(")").split(",") if p.strip()]


def format_report(source: VllmSource, drifts: list[Drift]) -> str:
    """The drifts as a readable diff, grouped by class or module; one line when there are none."""
    head = f"vLLM {source.version} ({source.origin})"
    if not drifts:
        count = sum(len(u.members) if isinstance(u, ClassUse) else len(u.names) + len(u.functions) for u in SURFACE)
        return (f"{head}: matches the API the adapter uses ({len(SURFACE)} classes and modules, {count} uses, "
                f"{len(CALL_ORDERS)} hook call orders)")
    lines = [f"{head}: {len(drifts)} difference(s) from the API the adapter uses "
             "(kvoffload/tools/vllm/api_surface.py):"]
    last = None
    for drift in drifts:
        if drift.where != last:
            lines.append(f"  {drift.where}")
            last = drift.where
        lines.append(f"    {drift.member or '(itself)'}: {drift.problem}")
        if drift.expected is not None:
            lines.append(f"      - adapter: {drift.expected}")
        if drift.found is not None:
            lines.append(f"      + vLLM:    {drift.found}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", nargs="?", type=Path,
                        help="a vLLM wheel, or a site-packages directory (default: the installed vLLM)")
    args = parser.parse_args(argv)
    source = VllmSource.open(args.source or installed_vllm_root())
    drifts = check(source)
    print(format_report(source, drifts))
    return 1 if drifts else 0


if __name__ == "__main__":
    sys.exit(main())
