"""TieredIndex with two tiers below host, disk and remote (a real redis-server), beside each other.

The disk is asked first; a prefix may be promoted from both in one lookup; a block promoted from the remote tier
is written to disk; each tier keeps its own write policy and its own failures. The workers keep what the disk
tier's slots hold (``tests.index.test_tiered.SlotFiles``): a disk load sent anywhere but its block fails the test.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.index.test_tiered import SlotFiles, disk_bytes, named

from kvoffload.blocks import HostBlocks, Medium, TierBlocks
from kvoffload.config import DiskTierConfig, OffloadConfig, RemoteTierConfig, WritePolicy
from kvoffload.index.base import LookupResult, TierTransfer
from kvoffload.index.slot_index import SlotIndex
from kvoffload.index.tiered import Below, TieredIndex
from kvoffload.keys import Namespace, OffloadKey, offload_key
from kvoffload.tiers.disk.spec import DiskTierSpec
from kvoffload.tiers.lower.block_format import PLAIN, file_bytes
from kvoffload.tiers.remote.client import value_name
from kvoffload.tiers.spec import TierContext

NS = Namespace(model="m", dtype="bf16", layout="pages=64")
VALUE = file_bytes(2 * 256)


class Layout:
    groups = ("attn",)

    def group_block_bytes(self, group: int) -> int:
        return 256


def keys(n: int, salt: int = 0) -> list[OffloadKey]:
    return [offload_key(bytes([salt, i]) * 8, 0) for i in range(n)]  # type: ignore[arg-type]


@pytest.fixture
def make(tmp_path: Path, redis_client: Any, redis_server: Any) -> Iterator[Callable[..., TieredIndex]]:
    made: list[TieredIndex] = []

    def make(host_slots: int = 4, disk_blocks: int = 16,
             disk_policy: WritePolicy = WritePolicy.WRITE_THROUGH) -> TieredIndex:
        from kvoffload.tiers.remote.index import RemoteIndex

        disk = DiskTierConfig(path=tmp_path, capacity_bytes=disk_bytes(disk_blocks), write_policy=disk_policy)
        remote = RemoteIndex.create(RemoteTierConfig(urls=(redis_server.url,), capacity_bytes=64 * VALUE),
                                          NS, VALUE)
        below = DiskTierSpec(disk).make_index(TierContext(NS, Layout(), 2))
        made.append(TieredIndex(SlotIndex(host_slots), (Below(below, disk_policy), Below(remote))))
        return made[-1]
    yield make
    for index in made:  # the disk index's thread and engine number
        index.close()


FILES = SlotFiles()
"""What the disk tier's slots hold; each test starts it empty (``_empty_files``)."""


@pytest.fixture(autouse=True)
def _empty_files() -> None:
    FILES.held.clear()
    FILES.checked = 0


class Workers:
    """The workers' part: a disk write that succeeds leaves its blocks at their slots and a disk read must find
    them there (``FILES``); a remote write that succeeds leaves a value; ``fail`` makes one medium's transfers
    fail."""

    def __init__(self, client: Any, fail: Medium | None = None) -> None:
        self.client, self.fail = client, fail

    def finish(self, m: TieredIndex, transfer: TierTransfer, success: bool = True) -> None:
        success = success and self.fail not in (transfer.src.medium, transfer.dst.medium)
        src, dst = transfer.src, transfer.dst
        if isinstance(dst, TierBlocks) and dst.medium == Medium.DISK:
            FILES.write(dst, success)
        if isinstance(src, TierBlocks) and src.medium == Medium.DISK:
            FILES.read(src, success)
        if success and isinstance(dst, TierBlocks) and dst.medium == Medium.REMOTE:
            for key in dst.keys:
                self.client.set(value_name(NS, PLAIN, key), b"v")
        m.complete_transfer(transfer, success)

    def finish_all(self, m: TieredIndex) -> list[TierTransfer]:
        done: list[TierTransfer] = []
        while transfers := m.take_transfers():
            for t in transfers:
                self.finish(m, t)
            done += transfers
        return done


def store(m: TieredIndex, ks: list[OffloadKey]) -> None:
    out = m.prepare_store(ks)
    assert out is not None
    m.complete_store(out.keys_to_store)


def evict_from_host(m: TieredIndex, workers: Workers, n: int) -> None:
    store(m, keys(n, salt=99))
    workers.finish_all(m)


def split_between_disk_and_remote(m: TieredIndex, ks: list[OffloadKey], redis_client: Any) -> None:
    """The first half of ``ks`` on disk and in the remote tier, the second in the remote tier only; none on the
    host."""
    half = len(ks) // 2
    store(m, ks[:half])
    Workers(redis_client).finish_all(m)
    store(m, ks[half:])
    Workers(redis_client, fail=Medium.DISK).finish_all(m)
    evict_from_host(m, Workers(redis_client), len(ks))


def test_a_stored_block_is_written_to_both_tiers_at_once(make: Any, redis_client: Any) -> None:
    m, workers = make(), Workers(redis_client)
    ks = keys(2)
    store(m, ks)
    writes = m.take_transfers()
    assert sorted(w.dst.medium.value for w in writes) == ["disk", "remote"]
    assert all(w.src == HostBlocks((0, 1), (2,)) for w in writes)  # both read the same pinned host slots
    for w in writes:
        workers.finish(m, w)
    assert [(u.medium, u.used_blocks) for u in m.usage()] == [(Medium.HOST, 2), (Medium.DISK, 2),
                                                              (Medium.REMOTE, 2)]
    m.check_integrity()


def test_a_block_on_both_tiers_is_promoted_from_disk(make: Any, redis_client: Any) -> None:
    m, workers = make(host_slots=2), Workers(redis_client)
    ks = keys(2)
    store(m, ks)
    workers.finish_all(m)
    evict_from_host(m, workers, 2)
    assert m.lookup(ks) == LookupResult(0, pending=True)
    (promotion,) = m.take_transfers()
    assert named(promotion.src) == TierBlocks(Medium.DISK, tuple(ks), (2,))


def test_a_block_only_in_the_remote_tier_is_promoted_from_it_then_written_to_disk(
        make: Any, redis_client: Any) -> None:
    m = make(host_slots=2)
    ks = keys(2)
    store(m, ks)
    Workers(redis_client, fail=Medium.DISK).finish_all(m)  # the disk write fails: remote only
    evict_from_host(m, Workers(redis_client), 2)
    assert m.lower_indexes[0].lookup(ks).hits == 0
    assert m.lookup(ks) == LookupResult(0, pending=True)
    (promotion,) = m.take_transfers()
    assert promotion.src == TierBlocks(Medium.REMOTE, tuple(ks), (2,)) and isinstance(promotion.dst, HostBlocks)
    Workers(redis_client).finish(m, promotion)
    (write,) = m.take_transfers()
    assert write.src == promotion.dst and named(write.dst) == TierBlocks(Medium.DISK, tuple(ks), (2,))
    Workers(redis_client).finish(m, write)
    assert m.lookup(ks).hits == 2 and m.lower_indexes[0].lookup(ks).hits == 2
    m.check_integrity()


def test_a_prefix_split_between_disk_and_remote_is_promoted_from_both_in_one_lookup(
        make: Any, redis_client: Any) -> None:
    m = make(host_slots=4)
    ks = keys(4)
    split_between_disk_and_remote(m, ks, redis_client)
    assert m.lookup(ks) == LookupResult(0, pending=True)
    promotions = m.take_transfers()
    assert [named(p.src) for p in promotions] == [TierBlocks(Medium.DISK, tuple(ks[:2]), (2,)),
                                           TierBlocks(Medium.REMOTE, tuple(ks[2:]), (2,))]
    dst = [s for p in promotions if isinstance(p.dst, HostBlocks) for s in p.dst.slots]
    assert len(set(dst)) == 4  # four distinct host slots
    assert m.lookup(ks).pending
    for p in promotions:
        Workers(redis_client).finish(m, p)
    assert m.lookup(ks) == LookupResult(4)
    m.check_integrity()


def test_a_failed_remote_promotion_keeps_the_disk_part_of_the_hit(make: Any, redis_client: Any) -> None:
    m = make(host_slots=4)
    ks = keys(4)
    split_between_disk_and_remote(m, ks, redis_client)
    assert m.lookup(ks).pending
    for p in m.take_transfers():
        Workers(redis_client, fail=Medium.REMOTE).finish(m, p)  # e.g. the server evicted the values
    assert m.lookup(ks) == LookupResult(2)
    m.check_integrity()


class SlowRemote:
    def worth_loading(self, medium: Medium, blocks: int) -> bool:
        return medium != Medium.REMOTE


def test_a_slow_remote_tier_ends_the_hit_where_the_disk_run_ends(make: Any, redis_client: Any) -> None:
    m = make(host_slots=4)
    m.set_load_cost(SlowRemote())
    ks = keys(4)
    split_between_disk_and_remote(m, ks, redis_client)
    assert m.lookup(ks) == LookupResult(0, pending=True)
    (promotion,) = m.take_transfers()
    assert named(promotion.src) == TierBlocks(Medium.DISK, tuple(ks[:2]), (2,))


def test_on_evict_disk_beside_write_through_remote(make: Any, redis_client: Any) -> None:
    m = make(host_slots=4, disk_policy=WritePolicy.ON_EVICT)  # low water 1: 3 dirty blocks allowed
    ks = keys(3)
    store(m, ks)
    (write,) = m.take_transfers()
    assert write.dst == TierBlocks(Medium.REMOTE, tuple(ks), (3,))  # the remote tier at once, the disk not yet
    Workers(redis_client).finish(m, write)
    store(m, keys(1, salt=1))
    writes = m.take_transfers()
    assert sorted((w.dst.medium.value, len(w.dst.keys)) for w in writes  # type: ignore[attr-defined]
                  ) == [("disk", 1), ("remote", 1)]
    m.check_integrity()


@pytest.mark.parametrize("below", [
    pytest.param(lambda d, r: [], id="none"),
    pytest.param(lambda d, r: [Below(d), Below(d)], id="one-medium-twice"),
    pytest.param(lambda d, r: [Below(d, WritePolicy.ON_EVICT), Below(r, WritePolicy.ON_EVICT)], id="two-on-evict"),
])  # fmt: skip
def test_bad_stacks_are_refused(make: Any, below: Any) -> None:
    m = make()
    with pytest.raises(ValueError, match="TieredIndex"):
        TieredIndex(SlotIndex(4), below(*m.lower_indexes))


@pytest.mark.parametrize("disk_policy", list(WritePolicy))
def test_random_workload_keeps_all_three_tiers_consistent(make: Any, redis_client: Any,
                                                          disk_policy: WritePolicy) -> None:
    rng = random.Random(11)
    m = make(host_slots=6, disk_blocks=8, disk_policy=disk_policy)
    workers = Workers(redis_client)
    pending: list[TierTransfer] = []
    promoted = 0
    for step in range(300):
        workers.fail = [None, Medium.DISK, Medium.REMOTE][step // 20 % 3]  # each tier has a bad spell
        ks = keys(rng.randint(1, 4), salt=rng.randrange(12))
        found = m.lookup(ks)
        promoted += found.pending
        if found.hits:
            m.touch(ks[:found.hits])
            m.prepare_load(ks[:found.hits])
            m.complete_load(ks[:found.hits], success=rng.random() > 0.1)
        out = m.prepare_store(ks)
        if out is not None:
            m.complete_store(out.keys_to_store, success=rng.random() > 0.1)
        pending += m.take_transfers()
        rng.shuffle(pending)
        while pending and rng.random() < 0.6:
            workers.finish(m, pending.pop(), rng.random() > 0.1)
        m.check_integrity()
    workers.fail = None
    for t in pending:
        workers.finish(m, t)
    workers.finish_all(m)
    m.check_integrity()
    assert promoted > 10  # the workload did exercise promotions
    assert FILES.checked > 3  # and disk loads, each from where its block was written (9-23 of them in 30 runs: the
    # remote tier answers lookups on a thread, so how many hits go to the disk depends on timing)


def test_disk_and_remote_configured_together_build_host_over_both(tmp_path: Path, redis_server: Any) -> None:
    from kvoffload.testing import layouts
    from kvoffload.tiers.stack import build_index

    layout, _ = layouts.attention_layout(num_blocks=8, block_size=4)
    config = OffloadConfig.from_dict({"host_bytes": 1 << 20, "disk_path": str(tmp_path), "disk_bytes": 1 << 24,
                                      "remote_url": redis_server.url})
    manager = build_index(config, TierContext(NS, layout, 1))
    try:
        assert isinstance(manager, TieredIndex)
        assert [u.medium for u in manager.usage()] == [Medium.HOST, Medium.DISK, Medium.REMOTE]
    finally:
        manager.close()
