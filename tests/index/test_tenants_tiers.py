"""Tenants below host and on a running engine: every tier's index keeps shares on one book (a flood on the disk or
the remote tier, a real redis-server, leaves an under-share tenant's blocks), a block keeps its tenant when written
below or promoted, new quotas take effect without a restart, and each tier counts per tenant."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.index.test_tiered import NS, VALUE, Layout, Tier, disk_bytes, finish_all, keys
from tests.index.workloads import key
from tests.index.workloads import keys as int_keys

from kvoffload.blocks import Medium
from kvoffload.config import DiskTierConfig, EvictionPolicy, RemoteTierConfig, WritePolicy
from kvoffload.index.slot_index import SlotIndex
from kvoffload.index.tenants import OTHER, TenantBook, TenantPolicy, inner_policies, tier_policy
from kvoffload.index.tiered import Below, TieredIndex
from kvoffload.keys import OffloadKey
from kvoffload.tiers.disk.spec import DiskTierSpec
from kvoffload.tiers.spec import TierContext

SHARES = {"a": 0.5, "b": 0.4}


@pytest.fixture(params=[Medium.DISK, Medium.REMOTE], ids=["disk", "remote"])
def lower(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Tier]:
    """The tier under host: the disk, or the remote tier on a real redis-server (its indexes closed after)."""
    if request.param == Medium.DISK:
        made = Tier(Medium.DISK, tmp_path)
    else:
        made = Tier(Medium.REMOTE, tmp_path, request.getfixturevalue("redis_client"),
                    request.getfixturevalue("redis_server").url)
    yield made
    made.close()


def book_of(shares: dict[str, float], default: float = 0.1) -> TenantBook:
    return TenantBook(list(shares), [*shares.values(), default])


def tiered(lower: Tier, book: TenantBook | None, host_slots: int = 4, lower_blocks: int = 10) -> TieredIndex:
    """Host over ``tier``, both on ``book`` (None: tenants off), as ``build_index`` makes them."""
    host = SlotIndex(host_slots, tier_policy(book, EvictionPolicy.LRU, host_slots, "host"))
    context = TierContext(NS, Layout(), 2, book)  # type: ignore[arg-type]
    if lower.medium == Medium.DISK:
        config = DiskTierConfig(path=lower.tmp_path, capacity_bytes=disk_bytes(lower_blocks))
        made = TieredIndex(host, [Below(DiskTierSpec(config).make_index(context), WritePolicy.WRITE_THROUGH)])
    else:
        from kvoffload.tiers.remote.index import RemoteIndex

        remote = RemoteTierConfig(urls=(lower.url,), capacity_bytes=lower_blocks * VALUE)
        made = TieredIndex(host, [Below(RemoteIndex.create(remote, NS, VALUE, context.policy),
                                        WritePolicy.WRITE_THROUGH)])
    lower.made.append(made)
    return made


def store_as(lower: Tier, m: TieredIndex, book: TenantBook | None, tenant: str, ks: list[OffloadKey]) -> None:
    """Store ``ks`` as ``tenant``'s, as the scheduler does, and run the writes below."""
    if book is not None:
        book.assign(ks, tenant)
    try:
        out = m.prepare_store(ks)
    finally:
        if book is not None:
            book.clear()
    assert out is not None
    m.complete_store(out.keys_to_store)
    finish_all(lower, m)


def below_after_flood(lower: Tier, book: TenantBook | None) -> int:
    """b stores 4 blocks, a floods 60 in stores of 2: how many of b's the lower tier (10 blocks) still holds."""
    m = tiered(lower, book)
    mine = keys(4, salt=200)
    store_as(lower, m, book, "b", mine)
    for i in range(30):
        store_as(lower, m, book, "a", keys(2, salt=i))
    m.check_integrity()
    lower = m.lower_indexes[0]
    return sum(lower.lookup([k]).hits for k in mine)


def test_a_flood_below_host_leaves_an_under_share_tenants_blocks(lower: Tier) -> None:
    book = book_of(SHARES)
    assert below_after_flood(lower, book) == 4
    assert [p.tier for p in book.policies] == ["host", lower.medium.value]


def test_control_below_host_without_tenants_the_flood_evicts_them(lower: Tier) -> None:
    assert below_after_flood(lower, None) == 0


def test_a_block_keeps_its_tenant_written_below_and_promoted_back(lower: Tier) -> None:
    book = book_of({"a": 0.5, "b": 0.25}, default=0.25)
    m = tiered(lower, book, host_slots=3)
    on_host, below = book.policies
    mine = keys(3, salt=200)
    store_as(lower, m, book, "b", mine)  # b: 3 on a host of 3, over its share of 0.75
    assert all(below.of[k] == 1 for k in mine)  # written below as b's, though nobody assigned the writes
    store_as(lower, m, book, "a", keys(3, salt=1))  # a under its share: b's over-share blocks leave the host
    assert m.host.lookup(mine).hits == 0
    assert m.lookup(mine).pending
    finish_all(lower, m)
    assert m.lookup(mine).hits == 3
    assert all(on_host.of[k] == 1 for k in mine)  # promoted: still b's, not the shared tenant's
    m.check_integrity()


# ---- new quotas on a running engine -------------------------------------------------------------------------------


def host_tier(book: TenantBook, capacity: int = 10, kind: EvictionPolicy = EvictionPolicy.LRU) -> SlotIndex:
    return SlotIndex(capacity, TenantPolicy(capacity, book.shares, inner_policies(kind, capacity), book))


def put(index: SlotIndex, book: TenantBook, tenant: str | None, ids: list[int] | range) -> list[OffloadKey]:
    evicted: list[OffloadKey] = []
    for i in ids:
        book.assign([key(i)], tenant)
        try:
            out = index.prepare_store([key(i)])
        finally:
            book.clear()
        assert out is not None
        index.complete_store(out.keys_to_store)
        evicted += out.evicted_keys
    index.check_integrity()
    return evicted


def test_new_shares_take_effect_at_the_next_store() -> None:
    book = book_of({"a": 0.5, "b": 0.4})
    index = host_tier(book)
    put(index, book, "b", range(100, 104))
    put(index, book, "a", range(6))  # full: a 6 (over 5), b 4
    assert put(index, book, "a", [6]) == int_keys(0)  # a over its share gives up its own
    book.set_quota(0.1, (("a", 0.8), ("b", 0.1)))  # b is now over its share of 1: lent space is taken back
    assert put(index, book, "a", [7, 8]) == int_keys(100, 101)
    assert index.host_policy.usage() == {"a": 8, "b": 2, OTHER: 0}  # type: ignore[attr-defined]


def test_a_tenant_no_longer_named_joins_other_and_goes_first_and_a_new_name_starts_afresh() -> None:
    book = book_of({"a": 0.3, "b": 0.3}, default=0.4)
    index = host_tier(book)
    put(index, book, "zed", range(200, 202))  # not named: "other"
    put(index, book, "b", range(100, 103))
    book.set_quota(0.4, (("a", 0.3), ("zed", 0.3)))  # b leaves the names, zed joins them
    policy = index.host_policy
    assert isinstance(policy, TenantPolicy)
    assert policy.usage() == {"a": 0, "zed": 0, OTHER: 5}  # zed's older blocks stay in "other"
    assert book.group("b") == 2 and book.group("zed") == 1
    victims = policy.victims(5, lambda k: True)
    assert victims == int_keys(100, 101, 102, 200, 201)  # b's (no longer named) first, then "other"'s own
    index_counts = policy.figures()[OTHER][1]
    assert index_counts.stored == 5 and index_counts.evicted == 5


def test_each_tier_counts_stores_evictions_and_hits_per_tenant() -> None:
    book = book_of({"a": 0.5, "b": 0.4})
    index = host_tier(book)
    put(index, book, "b", range(100, 103))
    put(index, book, "a", range(9))  # 2 of a's evicted to make room (a over its share)
    index.touch(int_keys(100, 101, 8))
    figures = book.figures()["host"]
    assert {name: (resident, c.stored, c.evicted, c.hits) for name, (resident, c) in figures.items()} == {
        "a": (7, 9, 2, 1), "b": (3, 3, 0, 2), OTHER: (0, 0, 0, 0)}


def test_a_wrong_group_map_in_one_tier_is_caught_by_the_integrity_check(tmp_path: Path) -> None:
    """The control for the group checks above: they read ``of``, which the integrity check ties to the groups."""
    book = book_of(SHARES)
    index = host_tier(book)
    put(index, book, "b", [1])
    policy = index.host_policy
    assert isinstance(policy, TenantPolicy)
    policy.of[key(1)] = 0  # says a's, while b's policy holds it
    with pytest.raises(Exception, match="not in its policy"):
        index.check_integrity()
