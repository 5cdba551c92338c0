"""TieredIndex: host over a lower tier behind one face (promotion, write-through, on-evict, failures, events).

Every test runs over both lower tiers, disk and remote (a real redis-server): the conformance of a ``LowerIndex``.
The workers' part is played by ``Tier.run``: over the disk it keeps what each slot of the slot file holds, so a
load the index sends to a slot that does not hold its key's block fails the test.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from kvoffload.blocks import BlockSpec, HostBlocks, Medium, TierBlocks
from kvoffload.config import DiskTierConfig, RemoteTierConfig, WritePolicy
from kvoffload.index.base import EventKind, LookupResult, TierTransfer
from kvoffload.index.slot_index import SlotIndex
from kvoffload.index.tiered import Below, TieredIndex
from kvoffload.keys import Namespace, OffloadKey, offload_key
from kvoffload.tiers.disk.slot_file import ENTRY_BYTES, PAGE, split_location
from kvoffload.tiers.disk.slot_file import Layout as SlotLayout
from kvoffload.tiers.disk.spec import DiskTierSpec
from kvoffload.tiers.lower.block_format import PLAIN, file_bytes
from kvoffload.tiers.remote.client import value_name
from kvoffload.tiers.spec import TierContext

NS = Namespace(model="m", dtype="bf16", layout="pages=64")
VALUE = file_bytes(2 * 256)


def disk_bytes(blocks: int) -> int:
    """The ``disk_bytes`` whose slot file holds exactly ``blocks`` blocks of ``VALUE`` bytes (with its header and
    table)."""
    budget = 2 * PAGE + blocks * (VALUE + ENTRY_BYTES)
    layout = SlotLayout.for_budget(budget, VALUE)
    assert layout is not None and layout.capacity == blocks
    return budget


@dataclass(frozen=True)
class Layout:
    groups: tuple[str, ...] = ("attn",)

    def group_block_bytes(self, group: int) -> int:
        return 256


def keys(n: int, salt: int = 0) -> list[OffloadKey]:
    return [offload_key(bytes([salt, i]) * 8, 0) for i in range(n)]  # type: ignore[arg-type]


@dataclass
class SlotFiles:
    """What the disk tier's slot files hold, as its workers would leave them: the key whose block each (engine,
    slot) location holds. A write that fails leaves its slots holding nothing loadable."""

    held: dict[int, OffloadKey] = field(default_factory=dict)
    checked: int = 0
    """Blocks whose load ``read`` checked."""

    def write(self, spec: TierBlocks, success: bool) -> None:
        assert len(spec.slots) == len(spec.keys) == len(set(spec.slots)), f"a store needs a slot per key: {spec}"
        assert all(split_location(place)[0] == 0 for place in spec.slots)  # the only engine here: number 0
        for key, place in zip(spec.keys, spec.slots, strict=True):
            if success:
                self.held[place] = key
            else:
                self.held.pop(place, None)

    def read(self, spec: TierBlocks, success: bool) -> None:
        """A load that succeeds must read each key's own block: where it was written, not since overwritten."""
        if success:
            assert len(spec.slots) == len(spec.keys), f"a load needs a slot per key: {spec}"
            for key, place in zip(spec.keys, spec.slots, strict=True):
                assert self.held.get(place) == key, f"the index sent {key.hex()}'s load to {place}: it holds " \
                                                    f"{self.held.get(place)!r}"
            self.checked += len(spec.keys)


def named(spec: BlockSpec) -> BlockSpec:
    """``spec`` without the disk tier's slots (which ``Tier.run`` checks against where each block was written)."""
    return replace(spec, slots=()) if isinstance(spec, TierBlocks) else spec


@dataclass
class Tier:
    """A lower tier to run these tests over, and what its workers do when a transfer succeeds."""

    medium: Medium
    tmp_path: Path
    client: Any = None
    url: str = ""
    files: SlotFiles = field(default_factory=SlotFiles)
    made: list[TieredIndex] = field(default_factory=list)
    """Every index made, closed at the end of the test (a disk index holds a thread and an engine number)."""

    def make(self, host_slots: int = 4, lower_blocks: int = 16,
             policy: WritePolicy = WritePolicy.WRITE_THROUGH) -> TieredIndex:
        host = SlotIndex(host_slots)
        if self.medium == Medium.DISK:
            config = DiskTierConfig(path=self.tmp_path, capacity_bytes=disk_bytes(lower_blocks), write_policy=policy)
            made = TieredIndex(host, [Below(DiskTierSpec(config).make_index(TierContext(NS, Layout(), 2)), policy)])
        else:
            from kvoffload.tiers.remote.index import RemoteIndex

            remote = RemoteTierConfig(urls=(self.url,), capacity_bytes=lower_blocks * VALUE)
            made = TieredIndex(host, [Below(RemoteIndex.create(remote, NS, VALUE), policy)])
        self.made.append(made)
        return made

    def blocks(self, ks: list[OffloadKey]) -> BlockSpec:
        """The tier's spec of ``ks``, compared with ``named`` specs."""
        return TierBlocks(self.medium, tuple(ks), (len(ks),))

    def run(self, transfer: TierTransfer, success: bool) -> None:
        """A worker's part: a disk write that succeeds leaves its blocks at their slots, a disk read checks it finds
        them there; a remote write that succeeds leaves a value."""
        src, dst = transfer.src, transfer.dst
        if isinstance(dst, TierBlocks) and dst.medium == Medium.DISK:
            self.files.write(dst, success)
        if isinstance(src, TierBlocks) and src.medium == Medium.DISK:
            self.files.read(src, success)
        if success and isinstance(dst, TierBlocks) and dst.medium == Medium.REMOTE:
            for key in dst.keys:
                self.client.set(value_name(NS, PLAIN, key), b"v")

    def close(self) -> None:
        for made in self.made:
            made.close()


@pytest.fixture(params=[Medium.DISK, Medium.REMOTE], ids=["disk", "remote"])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Tier]:
    if request.param == Medium.DISK:
        made = Tier(Medium.DISK, tmp_path)
    else:
        client = request.getfixturevalue("redis_client")
        made = Tier(Medium.REMOTE, tmp_path, client, request.getfixturevalue("redis_server").url)
    yield made
    made.close()


def store(m: TieredIndex, ks: list[OffloadKey], success: bool = True) -> None:
    out = m.prepare_store(ks)
    assert out is not None
    m.complete_store(out.keys_to_store, success)


def finish(tier: Tier, m: TieredIndex, transfer: TierTransfer, success: bool = True) -> None:
    tier.run(transfer, success)
    m.complete_transfer(transfer, success)


def finish_all(tier: Tier, m: TieredIndex, success: bool = True) -> list[TierTransfer]:
    """Run every queued tier transfer to completion, as the connector would (until none is left)."""
    done: list[TierTransfer] = []
    while transfers := m.take_transfers():
        for t in transfers:
            finish(tier, m, t, success)
        done += transfers
    return done


def test_write_through_writes_each_stored_block_and_pins_its_host_slot_meanwhile(tier: Tier) -> None:
    m = tier.make(host_slots=2)
    ks = keys(2)
    store(m, ks)
    (write,) = m.take_transfers()
    assert write.src == HostBlocks((0, 1), (2,)) and named(write.dst) == tier.blocks(ks)
    assert m.prepare_store(keys(1, salt=1)) is None  # both host slots are pinned by the write
    finish(tier, m, write)
    assert m.lower_indexes[0].lookup(ks).hits == 2
    assert m.prepare_store(keys(1, salt=1)) is not None  # unpinned: evictable again
    m.check_integrity()


def test_block_evicted_from_host_is_promoted_from_disk_while_lookup_says_pending(tier: Tier) -> None:
    m = tier.make(host_slots=2)
    old = keys(2)
    store(m, old)
    finish_all(tier, m)
    store(m, keys(2, salt=1))  # evicts ``old`` from the host
    finish_all(tier, m)
    assert m.host.lookup(old).hits == 0
    result = m.lookup(old)
    assert (result.hits, result.pending) == (0, True)
    (promotion,) = m.take_transfers()
    assert named(promotion.src) == tier.blocks(old) and isinstance(promotion.dst, HostBlocks)
    assert m.lookup(old).pending and m.take_transfers() == []  # in flight: no second promotion
    finish(tier, m, promotion)
    assert m.lookup(old).hits == 2
    assert m.prepare_load(old) == promotion.dst
    m.check_integrity()


def test_lookup_counts_host_hits_before_the_disk_run(tier: Tier) -> None:
    m = tier.make(host_slots=3)
    ks = keys(3)
    store(m, ks)
    finish_all(tier, m)
    store(m, keys(2, salt=1))  # a prefix's last blocks are evicted first: ks[0] stays on the host
    finish_all(tier, m)
    assert m.lookup(ks) == LookupResult(1, pending=True)  # ks[1:] is being promoted
    (promotion,) = m.take_transfers()
    assert named(promotion.src) == tier.blocks(ks[1:])


def test_failed_promotion_is_a_miss_and_forgets_the_disk_block(tier: Tier) -> None:
    m = tier.make(host_slots=1)
    (old,) = keys(1)
    store(m, [old])
    finish_all(tier, m)
    store(m, keys(1, salt=1))
    finish_all(tier, m)
    assert m.lookup([old]).pending
    finish_all(tier, m, success=False)  # e.g. the block was corrupt: the worker emptied its entry
    assert m.lookup([old]) == m.lookup([old]) and m.lookup([old]).hits == 0
    assert not m.lookup([old]).pending
    assert m.lower_indexes[0].lookup([old]).hits == 0
    m.check_integrity()


def test_failed_write_through_leaves_the_block_on_host_only(tier: Tier) -> None:
    m = tier.make()
    ks = keys(2)
    store(m, ks)
    finish_all(tier, m, success=False)
    assert m.host.lookup(ks).hits == 2 and m.lower_indexes[0].lookup(ks).hits == 0
    m.check_integrity()


def test_events_name_the_medium_of_each_tier(tier: Tier) -> None:
    m = tier.make()
    ks = keys(1)
    store(m, ks)
    finish_all(tier, m)
    events = m.take_events()
    assert [(e.kind, e.medium) for e in events] == [(EventKind.STORED, Medium.HOST),
                                                    (EventKind.STORED, tier.medium)]


def test_usage_lists_host_then_disk(tier: Tier) -> None:
    m = tier.make(host_slots=4, lower_blocks=16)
    store(m, keys(3))
    finish_all(tier, m)
    assert [(u.medium, u.used_blocks, u.capacity_blocks) for u in m.usage()] == [
        (Medium.HOST, 3, 4), (tier.medium, 3, 16)]


def test_on_evict_writes_only_blocks_crowding_the_host_and_evicts_only_written_ones(tier: Tier) -> None:
    m = tier.make(host_slots=4, policy=WritePolicy.ON_EVICT)  # low water 1: 3 dirty blocks allowed
    first = keys(3)
    store(m, first)
    assert m.take_transfers() == []  # all fit: nothing written yet
    store(m, keys(1, salt=1))
    (write,) = m.take_transfers()
    assert named(write.dst) == tier.blocks(first[:1])  # the least recently used dirty block
    finish(tier, m, write)
    store(m, keys(1, salt=2))  # needs room: the only evictable host block is the one on disk
    assert m.host.lookup([first[0]]).hits == 0 and m.lower_indexes[0].lookup([first[0]]).hits == 1
    assert m.host.lookup(first[1:]).hits == 2
    m.check_integrity()


def test_on_evict_refuses_a_low_water_mark_outside_the_host(tier: Tier) -> None:
    with pytest.raises(ValueError, match="low_water"):
        TieredIndex(SlotIndex(4), [Below(tier.make().lower_indexes[0], WritePolicy.ON_EVICT)], low_water=4)


def test_reset_forgets_both_tiers(tier: Tier) -> None:
    m = tier.make()
    ks = keys(2)
    store(m, ks)
    finish_all(tier, m)
    m.reset()
    assert m.lookup(ks).hits == 0 and not m.lookup(ks).pending
    m.check_integrity()


def test_a_transfer_the_index_did_not_hand_out_or_already_saw_complete_is_a_key_error(tier: Tier) -> None:
    m = tier.make()
    with pytest.raises(KeyError):
        m.complete_transfer(TierTransfer(HostBlocks((0,), (1,)), tier.blocks(keys(1))), True)
    store(m, keys(2))
    (transfer,) = m.take_transfers()  # the write-through of the stored blocks
    same = TierTransfer(transfer.src, transfer.dst)
    with pytest.raises(KeyError):  # equal specs are not the same transfer
        m.complete_transfer(same, True)
    finish(tier, m, transfer)
    with pytest.raises(KeyError):
        m.complete_transfer(transfer, True)


def test_the_workers_check_catches_a_disk_load_sent_to_another_blocks_slot(tmp_path: Path) -> None:
    """The control for ``SlotFiles.read``, which every disk promotion above goes through: slots swapped fail it."""
    tier = Tier(Medium.DISK, tmp_path)
    try:
        m = tier.make(host_slots=2)
        old = keys(2)
        store(m, old)
        finish_all(tier, m)
        store(m, keys(2, salt=1))
        finish_all(tier, m)
        assert m.lookup(old).pending
        (promotion,) = m.take_transfers()
        assert isinstance(promotion.src, TierBlocks)
        with pytest.raises(AssertionError, match="holds"):
            tier.files.read(replace(promotion.src, slots=promotion.src.slots[::-1]), True)
        finish(tier, m, promotion)  # the slots as the index gave them pass
    finally:
        tier.close()


@pytest.mark.parametrize("policy", list(WritePolicy))
def test_random_workload_keeps_both_tiers_consistent(tier: Tier, policy: WritePolicy) -> None:
    rng = random.Random(7)
    m = tier.make(host_slots=6, lower_blocks=12, policy=policy)
    pending: list[TierTransfer] = []
    for _ in range(400):
        ks = keys(rng.randint(1, 4), salt=rng.randrange(12))
        found = m.lookup(ks)
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
            finish(tier, m, pending.pop(), rng.random() > 0.1)
        m.check_integrity()
    for t in pending:
        finish(tier, m, t)
    finish_all(tier, m)
    m.check_integrity()
    assert tier.medium != Medium.DISK or tier.files.checked > 20  # promotions read where the blocks were written
