"""Retention hints in the node pool: the deadlines live in the shared index, so a block one engine was asked to keep
outlives every engine's unretained stores, and is evicted after them, oldest deadline first.

Each test runs a control beside its check (the same steps without the hint, or with a cap or clock that lets it
go), which shows the check fails when the hint is not what keeps the block. Deadlines pass by the index's test
clock (``_nodeindex.shift_clock``) and the book's clock moved with it: no test sleeps."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.tiers.node.pools import keys, locks_in, segment_in

from kvoffload import _nodeindex
from kvoffload.blocks import HostBlocks
from kvoffload.config import TenantBy, TenantConfig
from kvoffload.index.retention import RetentionBook
from kvoffload.keys import BlockHash, OffloadKey, offload_key
from kvoffload.tiers.node.index import NodeIndex

SLOTS = 8


class Clock:
    """``time.monotonic`` moved ahead with the index's clock: deadlines pass at once."""

    def __init__(self) -> None:
        self.ahead = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.ahead

    def advance(self, seconds: float) -> None:
        self.ahead += seconds
        _nodeindex.shift_clock(round(self.ahead * 1000))


@pytest.fixture
def clock() -> Iterator[Clock]:
    _nodeindex.shift_clock(0)
    yield Clock()
    _nodeindex.shift_clock(0)


def engine(node_path: Path, book: RetentionBook | None, layout: str = "retention",
           tenants: TenantConfig | None = None) -> NodeIndex:
    """A new engine on the namespace's pool of ``SLOTS`` slots, on ``book``."""
    return NodeIndex(segment_in(node_path, SLOTS, layout), locks_in(node_path, layout), tenants=tenants,
                     retention=book)


def store_all(index: NodeIndex, stored: list[OffloadKey]) -> list[OffloadKey]:
    """Store and complete ``stored``; the keys it evicted."""
    out = index.prepare_store(stored)
    assert out is not None
    index.complete_store(out.keys_to_store)
    return list(out.evicted_keys)


def held(index: NodeIndex, blocks: list[OffloadKey]) -> list[bool]:
    return [index.lookup([key]).hits == 1 for key in blocks]


def flood(index: NodeIndex, stores: int = 20) -> None:
    for _ in range(stores):
        store_all(index, keys(1))


# ---- 1. a retained block outlives a flood, and goes after it ---------------------------------------------------

@pytest.mark.parametrize("hinted", [True, False])
def test_a_retained_block_outlives_a_flood_of_unretained_stores(node_path: Path, clock: Clock, hinted: bool) -> None:
    book = RetentionBook(0.5, clock)
    a = engine(node_path, book, f"flood-{hinted}")
    older, newer = keys(1), keys(1)
    if hinted:
        book.hold(older, clock() + 60)
        book.hold(newer, clock() + 120)
    store_all(a, older + newer)
    flood(a)
    assert held(a, older + newer) == [hinted, hinted]  # control: without the hint both went in the flood
    if hinted:
        assert a.retention is not None and a.retention.retained() == 2
        # A store that needs every slot: the 6 unretained go first, then the older deadline; the newer stays.
        evicted = store_all(a, keys(SLOTS - 1))
        assert evicted[-1:] == older and newer[0] not in evicted
        assert held(a, older + newer) == [False, True]
        assert a.retention.counts().evicted == 1
    a.check_integrity()


# ---- 2. a deadline that passed makes the block ordinary --------------------------------------------------------

@pytest.mark.parametrize("passed", [True, False])
def test_an_expired_hint_makes_the_block_ordinary(node_path: Path, clock: Clock, passed: bool) -> None:
    book = RetentionBook(0.5, clock)
    a = engine(node_path, book, f"expired-{passed}")
    mine = keys(1)
    book.hold(mine, clock() + 10)
    store_all(a, mine)
    if passed:
        clock.advance(11)
    flood(a)
    assert held(a, mine) == [not passed]  # control: before its deadline the same flood left it
    assert a.retention is not None and a.retention.retained() == (0 if passed else 1)
    a.check_integrity()


# ---- 3. across engines ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("when", ["stored", "held", "none"])
def test_a_hint_given_on_one_engine_holds_against_another_engines_flood(node_path: Path, clock: Clock,
                                                                        when: str) -> None:
    """Engine A's book holds the key when it stores it, or later while it is in the pool (``hold`` reaches the
    index as a ``RetainTier``); engine B, with a book of its own that holds nothing, floods; B then finds and pins
    A's block. Control: no hint, and the flood takes it."""
    book_a, book_b = RetentionBook(0.5, clock), RetentionBook(0.5, clock)
    a, b = engine(node_path, book_a, f"engines-{when}"), engine(node_path, book_b, f"engines-{when}")
    assert a.retention in book_a.tiers
    mine = keys(2)
    if when == "stored":
        book_a.hold(mine, clock() + 60)
    store_all(a, mine)
    if when == "held":
        book_a.hold(mine, clock() + 60)  # resident: its slots' deadlines are raised in the shared index
    flood(b)
    kept = when != "none"
    assert b.lookup(mine).hits == (2 if kept else 0)
    if kept:
        spec = b.prepare_load(mine)
        assert all(spec.epochs) and _nodeindex.verify(b._segment, spec.slots, spec.epochs)
        b.complete_load(mine)
        assert b.retention is not None and b.retention.counts().hits == 2  # the pool's figures, every engine's
    a.check_integrity()


def test_a_later_hint_raises_a_deadline_and_never_lowers_it(node_path: Path, clock: Clock) -> None:
    book_a, book_b = RetentionBook(0.5, clock), RetentionBook(0.5, clock)
    a, _b = engine(node_path, book_a, "raise"), engine(node_path, book_b, "raise")  # B reaches the pool by its book
    mine = keys(1)
    book_a.hold(mine, clock() + 10)
    store_all(a, mine)
    book_b.hold(mine, clock() + 100)  # B's hint raises it
    book_a.hold(mine, clock() + 20)  # A's shorter one does not lower it
    clock.advance(50)
    flood(a)
    assert held(a, mine) == [True]
    clock.advance(60)
    flood(a)
    assert held(a, mine) == [False]


# ---- 4. the cap ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("share", [0.25, 1.0])
def test_past_the_cap_the_oldest_deadline_becomes_ordinary(node_path: Path, clock: Clock, share: float) -> None:
    """A cap of 2 of 8 slots: of 3 held blocks, the one with the oldest deadline is ordinary and goes in the flood.
    Control: a share of the whole pool keeps all 3."""
    book = RetentionBook(share, clock)
    a = engine(node_path, book, f"cap-{share}")
    mine = keys(3)
    for i, key in enumerate(mine):
        book.hold([key], clock() + 10 * (i + 1))
    store_all(a, mine)
    assert a.retention is not None
    capped = share < 1
    assert a.retention.retained() == (2 if capped else 3)
    assert a.retention.counts().demoted == (1 if capped else 0)
    flood(a)
    assert held(a, mine) == [not capped, True, True]
    a.check_integrity()


# ---- 5. no deadline: the victims of today -----------------------------------------------------------------------

def fixed_keys(start: int, n: int) -> list[OffloadKey]:
    """The same keys in every run (each namespace is its own pool)."""
    return [offload_key(BlockHash(i.to_bytes(8, "little")), 0) for i in range(start, start + n)]


def victims(node_path: Path, book: RetentionBook | None, layout: str, hold: bool = False,
            tenants: TenantConfig | None = None) -> list[tuple[list[int], list[OffloadKey]]]:
    """A fixed mix of stores, loads and touches on one engine; each store's slots and evictions."""
    a = engine(node_path, book, layout, tenants)
    if hold and book is not None:
        book.hold(fixed_keys(3, 1), book.clock() + 60)
    seen = []
    for step in range(30):
        stored = fixed_keys(step * 3, 1 + step % 3)
        tenant_book = a.tenant_book
        if tenant_book is not None:
            tenant_book.assign(stored, ("t1", "t2")[step % 2])
        out = a.prepare_store(stored)
        if tenant_book is not None:
            tenant_book.clear()
        assert out is not None and isinstance(out.store_spec, HostBlocks)
        a.complete_store(out.keys_to_store)
        seen.append((list(out.store_spec.slots), list(out.evicted_keys)))
        looked = fixed_keys(step * 2, 2)
        if a.lookup(looked).hits == 2 and step % 4 == 0:
            a.prepare_load(looked)
            a.complete_load(looked)
        a.touch(fixed_keys(step, 1))
    return seen


@pytest.mark.parametrize("tenants", [None, TenantConfig(TenantBy.CACHE_SALT, 0.25, (("t1", 0.5), ("t2", 0.25)))])
def test_a_book_that_holds_nothing_changes_no_victim(node_path: Path, clock: Clock,
                                                     tenants: TenantConfig | None) -> None:
    off = victims(node_path, None, "same-off", tenants=tenants)
    on = victims(node_path, RetentionBook(0.5, clock), "same-on", tenants=tenants)
    assert on == off
    held_one = victims(node_path, RetentionBook(0.5, clock), "same-held", hold=True, tenants=tenants)
    assert held_one != off  # control: one hint changes the victims, so the comparison can fail


# ---- with tenants: the tenant gives, its unretained first -------------------------------------------------------

@pytest.mark.parametrize("hinted", [True, False])
def test_with_tenants_a_tenants_retained_block_goes_after_its_other_blocks(node_path: Path, clock: Clock,
                                                                           hinted: bool) -> None:
    """Tenant t1 (4 of 8 slots) floods its own blocks: its retained one stays while t1 has another to give."""
    quota = TenantConfig(TenantBy.CACHE_SALT, 0.25, (("t1", 0.5), ("t2", 0.25)))
    book = RetentionBook(0.5, clock)
    a = engine(node_path, book, f"tenants-{hinted}", tenants=quota)
    tenant_book = a.tenant_book
    assert tenant_book is not None
    mine = keys(1)
    if hinted:
        book.hold(mine, clock() + 60)
    for stored in [mine, *(keys(1) for _ in range(20))]:
        tenant_book.assign(stored, "t1")
        store_all(a, stored)
        tenant_book.clear()
    assert held(a, mine) == [hinted]
    a.check_integrity()
