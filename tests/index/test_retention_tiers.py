"""Retention hints below host: the disk and the remote tier (a real redis-server) keep a held block through a flood
that evicts it without the hint, a block keeps its deadline written below, and each tier registers on the one
book."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from tests.index.test_tenants_tiers import lower as lower  # the disk or remote fixture
from tests.index.test_tiered import NS, VALUE, Layout, Tier, disk_bytes, finish_all, keys

from kvoffload.blocks import Medium
from kvoffload.config import DiskTierConfig, EvictionPolicy, RemoteTierConfig, WritePolicy
from kvoffload.index.retention import RetentionBook
from kvoffload.index.slot_index import SlotIndex
from kvoffload.index.tier_policies import tier_policy
from kvoffload.index.tiered import Below, TieredIndex
from kvoffload.keys import OffloadKey
from kvoffload.tiers.disk.spec import DiskTierSpec
from kvoffload.tiers.spec import TierContext


def tiered(lower: Tier, book: RetentionBook, host_slots: int = 4, lower_blocks: int = 10) -> TieredIndex:
    """Host over ``lower``, both on ``book``, as ``build_index`` makes them."""
    host = SlotIndex(host_slots, tier_policy(None, book, EvictionPolicy.LRU, host_slots, "host"))
    context = TierContext(NS, Layout(), 2, None, book)
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


def store(lower: Tier, m: TieredIndex, ks: list[OffloadKey]) -> None:
    out = m.prepare_store(ks)
    assert out is not None
    m.complete_store(out.keys_to_store)
    finish_all(lower, m)


@pytest.fixture
def book() -> Iterator[RetentionBook]:
    yield RetentionBook(0.5)


@pytest.mark.parametrize("hinted", [True, False])
def test_a_held_block_outlives_a_flood_below_host(lower: Tier, book: RetentionBook, hinted: bool) -> None:
    m = tiered(lower, book)
    mine = keys(4, salt=200)
    if hinted:
        book.hold(mine, book.clock() + 600)
    store(lower, m, mine)
    for i in range(30):
        store(lower, m, keys(2, salt=i))
    m.check_integrity()
    below = m.lower_indexes[0]
    assert sum(below.lookup([k]).hits for k in mine) == (4 if hinted else 0)  # unhinted: the control
    assert [tier.tier for tier in book.tiers] == ["host", lower.medium.value]
    assert [tier.retained() for tier in book.tiers] == ([2, 4] if hinted else [0, 0])  # host: its cap of 2


def test_a_hold_after_the_store_retains_blocks_already_below(lower: Tier, book: RetentionBook) -> None:
    m = tiered(lower, book)
    mine = keys(4, salt=200)
    store(lower, m, mine)
    book.hold(mine, book.clock() + 600)  # a later turn's lookup holds what an earlier one left
    for i in range(30):
        store(lower, m, keys(2, salt=i))
    assert sum(m.lower_indexes[0].lookup([k]).hits for k in mine) == 4
