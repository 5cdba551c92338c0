"""A tier from another package needs one import: the ram tier names nothing of kvoffload's outside
``kvoffload.tiers``, whose plug-in surface resolves every name it lists, lazily."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import kvoffload.tiers

RAMTIER = Path(__file__).parent / "ramtier"


def kvoffload_imports(source: str) -> set[str]:
    """The kvoffload modules ``source`` imports from, at any depth."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m == "kvoffload" or m.startswith("kvoffload.")}


def test_the_ram_tier_imports_only_the_plugin_surface() -> None:
    used = {path.name: kvoffload_imports(path.read_text()) for path in sorted(RAMTIER.glob("*.py"))}
    assert set(used) == {"__init__.py", "spec.py", "index.py", "handler.py"}
    elsewhere = {name: modules - {"kvoffload.tiers"} for name, modules in used.items()}
    assert {name: modules for name, modules in elsewhere.items() if modules} == {}
    # the check sees an import of another module, even one inside a function
    assert kvoffload_imports("def f():\n    from kvoffload.blocks import Medium\n") == {"kvoffload.blocks"}


def test_the_surface_lists_exactly_what_it_resolves() -> None:
    assert sorted(kvoffload.tiers.__all__) == sorted(kvoffload.tiers.PLUGIN_SURFACE)
    for name, module in kvoffload.tiers.PLUGIN_SURFACE.items():
        assert getattr(kvoffload.tiers, name) is getattr(sys.modules[module], name)
    with pytest.raises(AttributeError, match="no attribute 'Nothing'"):
        kvoffload.tiers.Nothing  # noqa: B018


def test_scheduler_side_names_load_no_torch_and_the_host_pool_does() -> None:
    code = ("import sys; from kvoffload.tiers import TierSpec, LowerIndex, SlotIndex, TierBlocks; "
            "print('torch' in sys.modules); from kvoffload.tiers import HostPool; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True"]
