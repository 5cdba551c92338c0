"""Tenants' shares in the node pool: the shared index evicts by index/tenants.py's rule over every engine's blocks.

Each rule test has a twin that runs the same steps under a wrong rule (``_nodeindex.set_rule``: a mutant of the
sweep) and shows the check then fails: the tests see the rule, not an accident of the set-up."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from tests.tiers.node import clock_trace
from tests.tiers.node.pools import keys, locks_in, segment_in

from kvoffload import _nodeindex
from kvoffload.config import NodeTierConfig, TenantBy, TenantConfig
from kvoffload.keys import Namespace, OffloadKey
from kvoffload.tiers.node.index import NodeIndex
from kvoffload.tiers.node.segment import namespace_directory
from kvoffload.tiers.node.status import read_status
from kvoffload.tiers.node.tenants import name_bytes, shown

SLOTS = 8
QUOTA = TenantConfig(TenantBy.CACHE_SALT, 0.125, (("victim", 0.5), ("flood", 0.375)))
"""Quotas of an 8-slot pool: victim 4, flood 3, other 1."""


@pytest.fixture(autouse=True)
def the_rule() -> Iterator[None]:
    """Every test starts and ends under the rule (a mutant is the process's until set back)."""
    _nodeindex.set_rule(_nodeindex.RULE)
    yield
    _nodeindex.set_rule(_nodeindex.RULE)


def engine(node_path: Path, tenants: TenantConfig | None = QUOTA, layout: str = "tenants") -> NodeIndex:
    """A new engine attached to the namespace's pool of ``SLOTS`` slots, with ``tenants``."""
    return NodeIndex(segment_in(node_path, SLOTS, layout), locks_in(node_path, layout), tenants=tenants)


def store_as(index: NodeIndex, tenant: str | None, stored: Sequence[OffloadKey]) -> bool:
    """Store ``stored`` for ``tenant`` as the scheduler does (assign, prepare, clear) and complete it; whether the
    store had room."""
    book = index.tenant_book
    if book is not None:
        book.assign(stored, tenant)
    try:
        out = index.prepare_store(stored)
    finally:
        if book is not None:
            book.clear()
    if out is None:
        return False
    index.complete_store(out.keys_to_store)
    return True


def resident(index: NodeIndex) -> dict[str, int]:
    return {name: counts["resident"] for name, counts in index.tenant_counts().items()}


def held(index: NodeIndex, blocks: Sequence[OffloadKey]) -> int:
    """How many of ``blocks`` the pool holds (each looked up alone: a gap does not hide the rest)."""
    return sum(index.lookup([key]).hits for key in blocks)


# ---- 1. a flood cannot flush a tenant under its share ----------------------------------------------------------

def flood(node_path: Path) -> int:
    """Engine A stores 3 of victim's blocks (under its quota of 4); engine B floods 40 new blocks of flood, two a
    step; how many of victim's blocks the pool still holds."""
    a, b = engine(node_path), engine(node_path)
    mine = keys(3)
    assert store_as(a, "victim", mine)
    for _ in range(20):
        store_as(b, "flood", keys(2))
    return held(a, mine)


def test_a_flooding_tenant_cannot_evict_the_blocks_of_a_tenant_under_its_share(node_path: Path) -> None:
    assert flood(node_path) == 3
    counts = engine(node_path).tenant_counts()
    assert counts["victim"]["evictions"] == 0 and counts["flood"]["evictions"] >= 30
    assert counts["flood"]["resident"] == 5  # the room victim and other leave is lent to the flood


def test_the_flood_check_fails_under_a_rule_that_protects_no_one(node_path: Path) -> None:
    _nodeindex.set_rule(_nodeindex.RULE_ANY)  # plain CLOCK over every tenant's blocks
    assert flood(node_path) < 3


def test_without_tenants_the_flood_flushes_the_other_engines_blocks(node_path: Path) -> None:
    """What tenants are for: the same flood in a pool without a table."""
    assert flood_without_tenants(node_path) < 3


def flood_without_tenants(node_path: Path) -> int:
    a, b = engine(node_path, None), engine(node_path, None)
    mine = keys(3)
    assert store_as(a, None, mine)
    for _ in range(20):
        store_as(b, None, keys(2))
    return held(a, mine)


# ---- 2. unused share is lent, and taken back -------------------------------------------------------------------

def lend_and_take_back(node_path: Path) -> tuple[dict[str, int], bool, dict[str, int]]:
    """flood (quota 3) alone fills the 8 slots; then victim stores 4: who holds what after each, and whether
    victim's store had room."""
    a, b = engine(node_path), engine(node_path)
    for _ in range(SLOTS):
        store_as(a, "flood", keys(1))
    alone = resident(a)
    stored = store_as(b, "victim", keys(4))
    return alone, stored, resident(a)


def test_a_lone_tenant_fills_the_whole_pool_and_gives_back_what_another_tenant_needs(node_path: Path) -> None:
    alone, stored, after = lend_and_take_back(node_path)
    assert alone == {"victim": 0, "flood": SLOTS, "other": 0}
    assert stored and after == {"victim": 4, "flood": 4, "other": 0}


def test_the_lending_check_fails_when_quotas_are_hard_caps(node_path: Path) -> None:
    _nodeindex.set_rule(_nodeindex.RULE_HARD_QUOTA)
    alone, _, _ = lend_and_take_back(node_path)
    assert alone["flood"] == 3


def test_the_take_back_check_fails_when_lent_share_is_never_taken_back(node_path: Path) -> None:
    _nodeindex.set_rule(_nodeindex.RULE_NO_TAKE_BACK)
    _, stored, after = lend_and_take_back(node_path)
    assert not stored and after["flood"] == SLOTS


# ---- 3. a tenant at or under its share that stores gives its own; 4. else the store is refused -----------------

def full_with_flood_pinned(node_path: Path) -> tuple[NodeIndex, list[OffloadKey], list[OffloadKey]]:
    """A full pool: 5 flood blocks (over its quota of 3) pinned by a load, 3 of victim's (under its 4)."""
    a = engine(node_path)
    flooded, mine = keys(5), keys(3)
    assert store_as(a, "flood", flooded) and store_as(a, "victim", mine)
    a.prepare_load(flooded)  # pinned: the over-quota tenant has nothing the pool may evict
    assert resident(a) == {"victim": 3, "flood": 5, "other": 0}
    return a, flooded, mine


def test_a_tenant_under_its_share_gives_its_own_block_when_no_one_over_can(node_path: Path) -> None:
    a, flooded, mine = full_with_flood_pinned(node_path)
    new = keys(1)
    assert store_as(a, "victim", new)  # 4 of its quota of 4 with the new one: rule 3, its own
    assert held(a, mine) == 2 and held(a, new) == 1 and held(a, flooded) == 5


def test_the_own_block_check_fails_when_rule_three_is_left_out(node_path: Path) -> None:
    _nodeindex.set_rule(_nodeindex.RULE_NO_OWN)
    a, _, mine = full_with_flood_pinned(node_path)
    assert not store_as(a, "victim", keys(1)) and held(a, mine) == 3


def test_a_store_no_tenant_may_make_room_for_is_refused(node_path: Path) -> None:
    a, flooded, mine = full_with_flood_pinned(node_path)
    assert not store_as(a, "nobody", keys(1))  # other stores: victim is under its share and not storing (rule 4)
    assert held(a, mine) == 3 and held(a, flooded) == 5
    assert a.check_integrity() is None


def test_the_refusal_check_fails_under_a_rule_that_protects_no_one(node_path: Path) -> None:
    _nodeindex.set_rule(_nodeindex.RULE_ANY)
    a, _, mine = full_with_flood_pinned(node_path)
    assert store_as(a, "nobody", keys(1)) and held(a, mine) == 2


def test_keys_nobody_assigned_count_for_the_shared_tenant(node_path: Path) -> None:
    shared = TenantConfig(TenantBy.CACHE_SALT, 0.5, (("shared", 0.5),))
    a, off = engine(node_path, shared), engine(node_path, None)
    assert store_as(a, None, keys(2)) and store_as(off, None, keys(1))  # unassigned; an engine with tenants off
    a.prepare_store(keys(1))  # the scheduler assigned nothing
    assert resident(a) == {"shared": 4, "other": 0}


# ---- tenants off: the very same victims as before tenants ------------------------------------------------------

def test_without_a_tenant_table_the_pool_evicts_exactly_as_before_tenants() -> None:
    """The record of index version 3 (clock_trace.py): the same slots, epochs, victims and refusals."""
    assert clock_trace.run(_nodeindex) == json.loads(clock_trace.RECORD.read_text())


def test_the_record_check_fails_when_the_pool_has_a_tenant_table() -> None:
    """The control: a table (one tenant, "other", the whole pool) changes the sweep, and the record sees it."""
    def one_tenant(buffer: bytearray, fd: int, attachment: int) -> None:
        assert _nodeindex.set_tenants(buffer, fd, attachment, [], _nodeindex.SHARE_ONE, False)

    assert clock_trace.run(_nodeindex, one_tenant) != json.loads(clock_trace.RECORD.read_text())


# ---- who sets the shares ---------------------------------------------------------------------------------------

def test_the_first_engine_writes_the_table_and_a_later_one_with_other_shares_is_warned(
        node_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    first = engine(node_path)
    with caplog.at_level(logging.WARNING):
        later = engine(node_path, TenantConfig(TenantBy.CACHE_SALT, 0.5, (("acme", 0.5),)))
    assert "differ from this engine's tenant_quota" in caplog.text
    assert set(later.tenant_counts()) == {"victim", "flood", "other"}  # the pool's table counts
    assert store_as(later, "acme", keys(1))  # a tenant the pool does not name stores as "other"
    assert resident(first)["other"] == 1


def test_set_tenant_shares_changes_every_engines_shares_and_keeps_the_kept_tenants_blocks(node_path: Path) -> None:
    a, b = engine(node_path), engine(node_path)
    assert store_as(a, "victim", keys(2)) and store_as(a, "flood", keys(1))
    assert b.set_tenant_shares(["flood", "acme"], 0.25, [0.25, 0.5])
    assert resident(a) == {"flood": 1, "acme": 0, "other": 2}  # victim's blocks went to "other"
    assert b.tenant_book is not None and b.tenant_book.names == ("flood", "acme", "other")  # renamed in place
    assert store_as(b, "acme", keys(1)) and resident(a)["acme"] == 1
    a.check_integrity()


def test_a_table_lost_to_damage_is_written_back_by_the_next_look(node_path: Path) -> None:
    a = engine(node_path)
    assert a.set_tenant_shares(["acme"], 0.5, [0.5])  # a live change: what counts, and what comes back
    a._segment[_nodeindex.LAYOUT["tenants_on"]] = 9
    assert a.tenant_counts() == {}  # a damaged table reads as none
    a._last_reclaim = 0.0
    a._reclaim()  # repaired (reset), then written back
    assert set(a.tenant_counts()) == {"acme", "other"}


def test_a_long_name_is_kept_as_a_prefix_and_a_hash_and_shown_whole_to_engines_that_know_it(
        node_path: Path) -> None:
    long = "tenant-" + "x" * 200
    a = engine(node_path, TenantConfig(TenantBy.LORA, 0.5, ((long, 0.5),)))
    assert store_as(a, long, keys(1)) and resident(a) == {long: 1, "other": 0}
    stored, hashed = name_bytes(long)
    assert hashed and len(stored) == _nodeindex.TENANT_NAME
    assert shown(stored, True).startswith("tenant-xxx") and shown(stored, True) != long
    assert name_bytes("tenant-" + "x" * 201) != (stored, True)


def test_pool_status_shows_each_tenants_counts(node_path: Path) -> None:
    a = engine(node_path)
    assert store_as(a, "victim", keys(2))
    status = read_status(namespace_directory(NodeTierConfig(node_path), Namespace(model="m", dtype="bf16",
                                                                                  layout="tenants")))
    assert status.tenants["victim"] == {"resident": 2, "stores": 2, "evictions": 0}
    assert set(status.tenants) == {"victim", "flood", "other"} and status.tenants == a.tenant_counts()
