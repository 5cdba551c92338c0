"""The ram tier's index against the tier-index conformance suite, and the plug-in's layering: the scheduler half
(its index and spec) loads no torch, and neither half imports the other."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from tests.architecture_rules import module_graph, reach

from kvoffload.blocks import Medium, TierBlocks
from kvoffload.index.base import LowerIndex
from kvoffload.keys import BlockHash, OffloadKey, offload_key
from kvoffload.testing.tier_conformance import ALL_INDEX_CHECKS, IndexHarness

PACKAGE = Path(__file__).resolve().parent / "ramtier"


class RamIndexHarness(IndexHarness):
    def __init__(self, capacity: int = 6) -> None:
        self._capacity = capacity
        self._ids = itertools.count()

    @property
    def capacity(self) -> int:
        return self._capacity

    def new_index(self) -> LowerIndex:
        from ramtier.index import ram_index

        return ram_index(self._capacity)

    def keys(self, n: int) -> list[OffloadKey]:
        return [offload_key(BlockHash(next(self._ids).to_bytes(8, "little")), 0) for _ in range(n)]


@pytest.mark.parametrize("check", ALL_INDEX_CHECKS, ids=lambda c: c.__name__)
def test_ram_index_conforms(check: Callable[[IndexHarness], None], ramtier_installed: Path) -> None:
    check(RamIndexHarness())


def test_the_index_answers_tier_blocks_of_its_medium_with_the_slots_it_gave(ramtier_installed: Path) -> None:
    harness = RamIndexHarness()
    index = harness.new_index()
    keys = harness.keys(3)
    out = index.prepare_store(keys)
    assert out is not None
    assert out.store_spec == TierBlocks(Medium("ramtier"), tuple(keys), (3,), (0, 1, 2))
    index.complete_store(keys)
    assert index.prepare_load(keys[1:]) == TierBlocks(Medium("ramtier"), tuple(keys[1:]), (2,), (1, 2))


@pytest.mark.parametrize("capacity", [0, -1, True, 2.5])
def test_an_index_of_no_slots_is_refused(capacity: int, ramtier_installed: Path) -> None:
    from ramtier.index import ram_index

    with pytest.raises(ValueError, match="num_slots"):
        ram_index(capacity)


def test_neither_half_imports_the_other() -> None:
    graph = module_graph(PACKAGE)
    assert reach(graph, "ramtier.index", "ramtier") == {"ramtier"}
    assert reach(graph, "ramtier.handler", "ramtier") == {"ramtier"}
    assert reach(graph, "ramtier.spec", "ramtier") == {"ramtier", "ramtier.index", "ramtier.handler"}  # seen


def test_the_scheduler_half_of_the_tier_loads_no_torch() -> None:
    code = ("import sys, ramtier.index, ramtier.spec; print('torch' in sys.modules);"
            "import ramtier.handler; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(PACKAGE.parent)})
    assert out.stdout.split() == ["False", "True"]  # the second line shows the check sees a module that does
