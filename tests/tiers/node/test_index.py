"""``NodeIndex``: every rule a tier's index keeps (the tier conformance suite), and what sharing adds: engines see
each other's blocks, wait only on their own stores, never evict what another pins, fail a load whose block went
after their lookup, and release what dead engines held."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from tests.tiers.node.pools import index_in, keys, locks_in, segment_in, store

from kvoffload import _nodeindex
from kvoffload.config import ConfigError
from kvoffload.index.base import EventKind, IntegrityError
from kvoffload.keys import OffloadKey
from kvoffload.testing.tier_conformance import ALL_INDEX_CHECKS, IndexCheck, IndexHarness
from kvoffload.tiers.node.index import NodeIndex
from kvoffload.tiers.node.segment import MISSING_EPOCH


def engines(node_path: Path, slots: int = 8) -> tuple[NodeIndex, NodeIndex]:
    """Two engines' views of one pool (one process here: their attachments tell them apart)."""
    segment = segment_in(node_path, slots)
    return NodeIndex(segment, locks_in(node_path)), index_in(node_path, slots)


class NodeHarness(IndexHarness):
    def __init__(self, node_path: Path) -> None:
        self._node_path = node_path
        self._layouts = itertools.count()

    @property
    def capacity(self) -> int:
        return 5

    def new_index(self) -> NodeIndex:
        return index_in(self._node_path, self.capacity, layout=f"harness-{next(self._layouts)}")

    def keys(self, n: int) -> list[OffloadKey]:
        return keys(n)


@pytest.mark.parametrize("check", ALL_INDEX_CHECKS, ids=lambda c: c.__name__)
def test_node_index_keeps_every_rule_of_a_tier_index(check: IndexCheck, node_path: Path) -> None:
    check(NodeHarness(node_path))


def test_a_block_one_engine_stored_is_a_hit_for_another(node_path: Path) -> None:
    a, b = engines(node_path)
    prefix = keys(4)
    spec = store(a, prefix)
    assert b.lookup(prefix).hits == 4
    load = b.prepare_load(prefix)
    assert load.slots == spec.slots and load.epochs == spec.epochs  # the very slots A wrote
    assert _nodeindex.verify(b._segment, load.slots, load.epochs)
    b.complete_load(prefix)
    assert b.pool_counters()["cross_hits"] == 4 and b.pool_counters()["stores"] == 4
    assert a.pool_counters()["served"] == 4 and b.pool_counters()["served"] == 0  # A's blocks served B
    a.check_integrity()
    b.check_integrity()


def test_only_an_engine_own_stores_are_pending(node_path: Path) -> None:
    a, b = engines(node_path)
    prefix = keys(2)
    assert a.prepare_store(prefix) is not None
    assert a.lookup(prefix).pending and a.lookup(prefix).hits == 0
    assert not b.lookup(prefix).pending and b.lookup(prefix).hits == 0  # A may stop stepping: B recomputes
    again = b.prepare_store(prefix)
    assert again is not None and again.keys_to_store == ()  # and does not store them twice


def test_a_block_evicted_after_the_lookup_fails_the_load(node_path: Path) -> None:
    a, b = engines(node_path, slots=4)
    prefix = keys(4)
    store(a, prefix)
    assert b.lookup(prefix).hits == 4
    out = a.prepare_store(keys(4))  # the pool is full: A's new blocks evict the prefix before B pins it
    assert out is not None and set(out.evicted_keys) == set(prefix)
    load = b.prepare_load(prefix)
    assert set(load.epochs) == {MISSING_EPOCH}
    assert not _nodeindex.verify(b._segment, load.slots, load.epochs)  # the worker refuses it: a recompute
    b.complete_load(prefix, success=False)
    b.check_integrity()


def test_a_pinned_block_is_never_evicted_by_another_engine(node_path: Path) -> None:
    a, b = engines(node_path, slots=4)
    prefix = keys(4)
    store(a, prefix)
    load = b.prepare_load(prefix[:2])
    out = a.prepare_store(keys(4))
    assert out is None  # two slots are pinned: no room for four, nothing changed
    out = a.prepare_store(keys(2))
    assert out is not None and set(out.evicted_keys) == set(prefix[2:])
    assert _nodeindex.verify(b._segment, load.slots, load.epochs)
    b.complete_load(prefix[:2])
    a.check_integrity()


def test_a_slot_rewritten_under_a_reader_fails_its_check(node_path: Path) -> None:
    a, _ = engines(node_path, slots=2)
    first = keys(2)
    spec = store(a, first)
    store(a, keys(2))  # unpinned: the same slots, new epochs
    assert not _nodeindex.verify(a._segment, spec.slots, spec.epochs)


def test_reset_drops_only_this_engine_blocks(node_path: Path) -> None:
    a, b = engines(node_path)
    mine, theirs = keys(2), keys(2)
    store(a, mine)
    store(b, theirs)
    a.reset()
    assert b.lookup(mine).hits == 0 and a.lookup(theirs).hits == 2


def test_a_dead_engine_pins_and_stores_are_released(node_path: Path) -> None:
    segment = segment_in(node_path, 4)
    locks = locks_in(node_path)  # an engine that never locked its byte: dead to the others
    dead = _nodeindex.attach(segment, locks.fd, 2**22 + 7, 1, 0)
    held = keys(4)
    assert _nodeindex.reserve(segment, locks.fd, dead, b"".join(held[:2])) is not None  # killed mid-store ...
    survivor = NodeIndex(segment, locks_in(node_path))  # ... found dead by the next engine to attach
    assert survivor.pool_counters()["reclaimed"] == 1 and survivor.pool_counters()["attached"] == 1
    assert store(survivor, held)  # its half-made slots are free again
    survivor.check_integrity()


def test_close_detaches_and_drops_the_engine_pins(node_path: Path) -> None:
    a, b = engines(node_path)
    pinned = keys(1)
    store(a, pinned)
    a.prepare_load(pinned)
    a.close()
    assert b.pool_counters()["attached"] == 1 and b.pool_counters()["reclaimed"] == 0
    b.check_integrity()  # a pin of a detached engine would be a broken law


def test_every_attachment_taken_is_a_config_error(node_path: Path) -> None:
    segment = segment_in(node_path, 4)
    engines = [NodeIndex(segment, locks_in(node_path)) for _ in range(_nodeindex.MAX_ATTACH)]  # all alive
    with pytest.raises(ConfigError, match="engines already share this node pool"):
        NodeIndex(segment, locks_in(node_path))
    engines.pop().close()
    NodeIndex(segment, locks_in(node_path))  # a detached engine's attachment is free again


def test_check_integrity_catches_a_corrupt_segment(node_path: Path) -> None:
    """The integrity check is shown to catch what it looks for: a slot state no code writes."""
    a, _ = engines(node_path)
    store(a, keys(1))
    a.check_integrity()
    a._segment[_nodeindex.HEADER_BYTES + 48] = 7  # slot 0's state byte
    with pytest.raises(IntegrityError, match=r"slot 0 fails its check \(state 7\)"):
        a.check_integrity()


def test_events_name_stores_and_evictions(node_path: Path) -> None:
    a, _ = engines(node_path, slots=2)
    first, second = keys(2), keys(2)
    store(a, first)
    store(a, second)
    events = a.take_events()
    assert [e.kind for e in events] == [EventKind.STORED, EventKind.REMOVED, EventKind.STORED]
    assert set(events[1].keys) == set(first)
