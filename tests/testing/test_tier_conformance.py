"""The tier-index conformance suite (``kvoffload.testing.tier_conformance``) on the built-in lower tiers' indexes
(``DiskIndex`` over a temporary directory, its stores written into its slot file as a worker writes them;
``RemoteIndex`` over a real redis-server) and on a plain ``SlotIndex``; and each of several deliberately broken
indexes fails the check of the rule it breaks, naming it."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvoffload.blocks import BlockSpec, Medium, TierBlocks
from kvoffload.config import DiskTierConfig, RemoteTierConfig
from kvoffload.index.base import LookupResult, LowerIndex, PrepareStoreOutput
from kvoffload.index.slot_index import SlotIndex
from kvoffload.keys import BlockHash, Namespace, OffloadKey, offload_key
from kvoffload.testing.tier_conformance import (
    ALL_INDEX_CHECKS,
    IndexHarness,
    TierConformanceError,
    check_capacity_is_bounded,
    check_failed_store_is_not_found,
    check_lookup_counts_leading_hits,
    check_pinned_entries_are_not_evicted,
    check_specs_name_the_tier,
    check_stored_keys_are_found,
    check_tier_index,
)
from kvoffload.tiers.disk.file_io import FileOps, open_slot_file, write_run
from kvoffload.tiers.disk.foreign import ForeignTables
from kvoffload.tiers.disk.index import DiskIndex
from kvoffload.tiers.disk.paths import rank_directory, slot_file_path
from kvoffload.tiers.disk.slot_file import ENTRY_BYTES, PAGE, split_location
from kvoffload.tiers.lower.block_format import PLAIN, file_bytes

NS = Namespace(model="m", dtype="bf16", layout="tier-conformance")
PAYLOAD = 1000
CAPACITY = 5
MEDIUM = Medium("slots")


class KeyedHarness(IndexHarness):
    """Fresh keys from a counter; the index is the subclass's."""

    def __init__(self) -> None:
        self._ids = itertools.count()

    @property
    def capacity(self) -> int:
        return CAPACITY

    def keys(self, n: int) -> list[OffloadKey]:
        return [offload_key(BlockHash(next(self._ids).to_bytes(8, "little")), 0) for _ in range(n)]


class SlotHarness(KeyedHarness):
    """A ``SlotIndex`` as a tier's index (what a memory tier needs), or a broken variant of it."""

    def __init__(self, make: Callable[[int], LowerIndex] = lambda n: SlotIndex(n, medium=MEDIUM,
                                                                                 spec_factory=tier_spec)) -> None:
        super().__init__()
        self._make = make

    def new_index(self) -> LowerIndex:
        return self._make(CAPACITY)


def tier_spec(keys: Sequence[OffloadKey], slots: Sequence[int]) -> BlockSpec:
    from kvoffload.blocks import TierBlocks

    return TierBlocks(MEDIUM, tuple(keys), (len(keys),), tuple(slots))


class PlacedDiskIndex(DiskIndex):
    """A ``DiskIndex`` that remembers the (engine, slot) location each store was given, where a worker writes it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.places: dict[OffloadKey, int] = {}

    def prepare_store(self, keys: Sequence[OffloadKey]) -> PrepareStoreOutput | None:
        out = super().prepare_store(keys)
        if out is not None:
            assert isinstance(out.store_spec, TierBlocks)
            self.places.update(zip(out.keys_to_store, out.store_spec.slots, strict=True))
        return out


class DiskHarness(KeyedHarness):
    """``DiskIndex`` in a directory of its own per index; a store leaves what a worker writes: each block and its
    table entry at the slot the index gave it (``file_io.write_run``). ``close`` closes every index it made (each
    holds a thread and an engine number)."""

    def __init__(self, root: Path, index_type: type[PlacedDiskIndex] = PlacedDiskIndex) -> None:
        super().__init__()
        self._roots = (root / f"index{i}" for i in itertools.count())
        self._type = index_type
        self._made: list[PlacedDiskIndex] = []
        self._directory = root

    def new_index(self) -> LowerIndex:
        root = next(self._roots)
        self._directory = rank_directory(root, NS)
        config = DiskTierConfig(path=root, capacity_bytes=2 * PAGE + CAPACITY * (file_bytes(PAYLOAD) + ENTRY_BYTES))
        index = self._type.create(config, NS, file_bytes(PAYLOAD))
        assert isinstance(index, PlacedDiskIndex) and index.capacity == CAPACITY
        self._made.append(index)
        return index

    def written(self, keys: Sequence[OffloadKey]) -> None:
        index = self._made[-1]
        ops = FileOps()
        for key in keys:
            engine, slot = split_location(index.places[key])
            file = open_slot_file(ops, slot_file_path(self._directory, engine))
            try:
                write_run(ops, file, slot, [key], [memoryview(os.urandom(PAYLOAD))], NS.fingerprint())
            finally:
                ops.close(file.fd)

    def close(self) -> None:
        for index in self._made:
            index.close()


@pytest.fixture
def disk_harnesses(tmp_path: Path) -> Iterator[Callable[..., DiskHarness]]:
    """Makes ``DiskHarness``es under ``tmp_path``; closes their indexes after the test."""
    made: list[DiskHarness] = []

    def make(name: str = "disk", index_type: type[PlacedDiskIndex] = PlacedDiskIndex) -> DiskHarness:
        made.append(DiskHarness(tmp_path / name, index_type))
        return made[-1]
    yield make
    for harness in made:
        harness.close()


class RemoteHarness(KeyedHarness):
    """``RemoteIndex`` as the scheduler half makes it; a store leaves the value a worker writes."""

    def __init__(self, url: str, client: Any) -> None:
        super().__init__()
        self._url = url
        self._client = client

    def new_index(self) -> LowerIndex:
        import redis

        from kvoffload.tiers.remote.index import RemoteIndex

        config = RemoteTierConfig(urls=(self._url,), capacity_bytes=CAPACITY * PAYLOAD)
        return RemoteIndex.create(config, NS, PAYLOAD, client=redis.Redis.from_url(self._url))

    def written(self, keys: Sequence[OffloadKey]) -> None:
        from kvoffload.tiers.remote.client import value_name

        for key in keys:
            self._client.set(value_name(NS, PLAIN, key, 0), b"v")


@pytest.mark.parametrize("check", ALL_INDEX_CHECKS, ids=lambda c: c.__name__)
def test_a_slot_index_conforms(check: Callable[[IndexHarness], None]) -> None:
    check(SlotHarness())


@pytest.mark.parametrize("check", ALL_INDEX_CHECKS, ids=lambda c: c.__name__)
def test_the_disk_index_conforms(check: Callable[[IndexHarness], None],
                                 disk_harnesses: Callable[..., DiskHarness]) -> None:
    check(disk_harnesses())


class ReadsItsOwnTable(PlacedDiskIndex):
    """Looks for the keys it misses in its own slot file's table too, read at every lookup (as it reads the other
    engines' tables, but counting its own engine among them): it finds the entries a failed store's workers left."""

    own_table: ForeignTables | None = None

    def lookup(self, keys: Sequence[OffloadKey]) -> LookupResult:
        if self.own_table is None:
            if self._foreign is not None:
                self._foreign.close()
            self._foreign = self.own_table = ForeignTables(self._directories[0], -1, PLAIN, interval_s=3600.0)
        self.own_table.refresh()
        return super().lookup(keys)


def test_a_disk_index_that_takes_its_own_tables_entries_for_blocks_is_caught(
        disk_harnesses: Callable[..., DiskHarness]) -> None:
    """The entries a harness's ``written`` leaves are what a disk index must not trust after start-up: a worker
    whose store failed may have written some (and failed to empty them). One that reads its own table finds a
    failed store's keys."""
    check_failed_store_is_not_found(disk_harnesses("good"))
    with pytest.raises(TierConformanceError, match="store failed was a lookup hit"):
        check_failed_store_is_not_found(disk_harnesses("broken", ReadsItsOwnTable))


@pytest.mark.parametrize("check", ALL_INDEX_CHECKS, ids=lambda c: c.__name__)
def test_the_remote_index_conforms(check: Callable[[IndexHarness], None], redis_server: Any,
                                   redis_client: Any) -> None:
    check(RemoteHarness(redis_server.url, redis_client))


# ---- broken indexes: each fails the check of the rule it breaks -------------------------------------------------


class ForgetsStores(SlotIndex):
    """Drops every store as it completes."""

    def complete_store(self, keys: Sequence[OffloadKey], success: bool = True) -> None:
        super().complete_store(keys, success=False)


class IgnoresCapacity(SlotIndex):
    """Holds four times the capacity it reports."""

    def __init__(self, num_slots: int) -> None:
        super().__init__(4 * num_slots, medium=MEDIUM, spec_factory=tier_spec)

    def usage(self) -> list[Any]:
        return [type(u)(u.medium, u.used_blocks, self.capacity // 4) for u in super().usage()]


class DoesNotPin(SlotIndex):
    """Tells where entries are without pinning them."""

    def prepare_load(self, keys: Sequence[OffloadKey]) -> BlockSpec:
        spec = super().prepare_load(keys)
        super().complete_load(keys)
        return spec


class CountsEveryHit(SlotIndex):
    """Counts the hits after a miss too."""

    def lookup(self, keys: Sequence[OffloadKey]) -> LookupResult:
        return LookupResult(sum(super(CountsEveryHit, self).lookup([k]).hits for k in keys))


BROKEN: list[tuple[Callable[[int], LowerIndex], Callable[[IndexHarness], None], str]] = [
    (lambda n: ForgetsStores(n, medium=MEDIUM, spec_factory=tier_spec), check_stored_keys_are_found,
     "lookup found 0 of 3 keys just stored"),
    (IgnoresCapacity, check_capacity_is_bounded, "reserved room for 6 new keys in an index of capacity 5"),
    (lambda n: DoesNotPin(n, medium=MEDIUM, spec_factory=tier_spec), check_pinned_entries_are_not_evicted,
     "whose every entry is pinned"),
    (lambda n: CountsEveryHit(n, medium=MEDIUM, spec_factory=tier_spec), check_lookup_counts_leading_hits,
     r"answered hits \[3, 2, 1, 1, 0\]"),
    (lambda n: SlotIndex(n, medium=MEDIUM), check_specs_name_the_tier,  # host slots named as the tier's entries
     "medium 'host', not the tier's 'slots'"),
]


@pytest.mark.parametrize(("make", "check", "message"), BROKEN,
                         ids=["forgets-stores", "ignores-capacity", "does-not-pin", "counts-every-hit", "host-specs"])
def test_a_broken_index_fails_the_check_of_the_rule_it_breaks(make: Callable[[int], LowerIndex],
                                                              check: Callable[[IndexHarness], None],
                                                              message: str) -> None:
    with pytest.raises(TierConformanceError, match=message):
        check(SlotHarness(make))
    with pytest.raises(TierConformanceError, match="LowerIndex rule broken"):
        check_tier_index(SlotHarness(make))


def test_a_failed_store_that_leaves_its_entry_loadable_is_caught() -> None:
    class KeepsFailedStores(SlotIndex):
        def complete_store(self, keys: Sequence[OffloadKey], success: bool = True) -> None:
            super().complete_store(keys, success=True)

    with pytest.raises(TierConformanceError, match="store failed was a lookup hit"):
        check_failed_store_is_not_found(SlotHarness(lambda n: KeepsFailedStores(n, medium=MEDIUM,
                                                                                spec_factory=tier_spec)))


def test_a_harness_of_too_small_an_index_is_refused() -> None:
    class Tiny(SlotHarness):
        @property
        def capacity(self) -> int:
            return 2

    with pytest.raises(ValueError, match="below 4"):
        check_stored_keys_are_found(Tiny())
