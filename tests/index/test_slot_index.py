"""The host tier index: lookups, pins, stores with eviction, failures, events, reset, integrity (its model check:
test_slot_index_model.py)."""

from __future__ import annotations

import tracemalloc

import pytest
from tests.index.workloads import held, key, keys, stored

from kvoffload.blocks import HostBlocks, Medium, TierBlocks
from kvoffload.config import EvictionPolicy
from kvoffload.index.base import EventKind, IntegrityError, LookupResult, OffloadEvent, TierUsage
from kvoffload.index.slot_index import SlotIndex


def test_rejects_a_capacity_that_is_not_a_positive_integer() -> None:
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="num_slots"):
            SlotIndex(bad)  # type: ignore[arg-type]


def test_lookup_counts_leading_ready_keys() -> None:
    manager = stored(SlotIndex(8), 1, 2, 3)
    assert manager.lookup(keys(1, 2, 3, 4)) == LookupResult(3)
    assert manager.lookup(keys(1, 9, 3)) == LookupResult(1)
    assert manager.lookup(keys(9)) == LookupResult(0)
    assert manager.lookup([]) == LookupResult(0)


def test_lookup_is_pending_when_the_first_miss_is_in_flight() -> None:
    manager = stored(SlotIndex(8), 1)
    manager.prepare_store(keys(2, 3))
    assert manager.lookup(keys(1, 2, 3)) == LookupResult(1, pending=True)
    assert manager.lookup(keys(1, 9, 2)) == LookupResult(1, pending=False)


def test_prepare_load_returns_the_slots_in_key_order() -> None:
    manager = stored(SlotIndex(8), 1, 2, 3)
    spec = manager.prepare_load(keys(3, 1))
    assert spec == HostBlocks(slots=(2, 0), group_sizes=(2,))


def test_prepare_load_of_a_key_not_ready_raises_and_pins_nothing() -> None:
    manager = stored(SlotIndex(2), 1)
    manager.prepare_store(keys(2))
    with pytest.raises(KeyError, match="not ready"):
        manager.prepare_load(keys(1, 2))
    manager.complete_store(keys(2))
    assert manager.prepare_store(keys(3)) is not None  # key 1 was not left pinned: it could be evicted
    manager.check_integrity()


def test_store_skips_held_and_repeated_keys() -> None:
    manager = stored(SlotIndex(8), 1)
    manager.prepare_store(keys(2))
    out = manager.prepare_store(keys(1, 2, 3, 3, 4))
    assert out is not None
    assert out.keys_to_store == tuple(keys(3, 4))
    assert out.store_spec == HostBlocks(slots=(2, 3), group_sizes=(2,))
    assert out.evicted_keys == ()


def test_store_evicts_the_tail_of_the_least_recent_prefix_first() -> None:
    manager = stored(SlotIndex(4), 1, 2)
    stored(manager, 3, 4)
    manager.touch(keys(1, 2))
    out = manager.prepare_store(keys(5, 6, 7))
    assert out is not None
    assert out.evicted_keys == tuple(keys(4, 3, 2))
    assert manager.lookup(keys(1)) == LookupResult(1)


def test_pinned_keys_are_not_evicted() -> None:
    manager = stored(SlotIndex(3), 1, 2, 3)
    manager.prepare_load(keys(1, 2))
    out = manager.prepare_store(keys(4))
    assert out is not None and out.evicted_keys == tuple(keys(3))
    assert manager.prepare_store(keys(5)) is None


def test_keys_of_the_same_store_are_not_evicted_for_it() -> None:
    manager = stored(SlotIndex(2), 1, 2)
    assert manager.prepare_store(keys(1, 3, 4)) is None
    out = manager.prepare_store(keys(1, 3))
    assert out is not None and out.evicted_keys == tuple(keys(2))


def test_store_returns_none_and_changes_nothing_when_full_of_pinned_and_in_flight_keys() -> None:
    manager = stored(SlotIndex(3), 1, 2)
    manager.prepare_load(keys(1, 2))
    manager.prepare_store(keys(3))
    assert manager.prepare_store(keys(4)) is None
    assert manager.take_events() == []
    assert manager.lookup(keys(1, 2, 3)) == LookupResult(2, pending=True)
    assert held(manager) == 3
    manager.check_integrity()


def test_failed_store_frees_its_slot_and_emits_nothing() -> None:
    manager = SlotIndex(2)
    manager.prepare_store(keys(1, 2))
    manager.complete_store(keys(1, 2), success=False)
    assert manager.take_events() == []
    assert held(manager) == 0
    assert manager.lookup(keys(1)) == LookupResult(0)
    manager.check_integrity()


def test_completing_a_store_twice_or_for_unknown_keys_is_ignored() -> None:
    manager = stored(SlotIndex(4), 1)
    manager.complete_store(keys(1, 9))
    manager.complete_store(keys(1), success=False)
    assert manager.lookup(keys(1)) == LookupResult(1)
    assert manager.take_events() == []
    manager.check_integrity()


def test_complete_store_keys_answers_the_keys_that_became_ready_once() -> None:
    manager = SlotIndex(4)
    manager.prepare_store(keys(1, 2))
    assert manager.complete_store_keys(keys(2, 9, 1, 2)) == keys(2, 1)  # unknown and repeated keys are not
    assert manager.complete_store_keys(keys(1)) == []
    manager.prepare_store(keys(3))
    assert manager.complete_store_keys(keys(3), success=False) == []
    manager.check_integrity()


def test_failed_load_drops_the_keys() -> None:
    manager = stored(SlotIndex(4), 1, 2)
    manager.prepare_load(keys(1, 2))
    manager.complete_load(keys(1, 2), success=False)
    assert manager.lookup(keys(1)) == LookupResult(0)
    assert held(manager) == 0
    assert manager.take_events() == [OffloadEvent(EventKind.REMOVED, tuple(keys(1, 2)), Medium.HOST)]
    manager.check_integrity()


def test_failed_load_drops_a_key_only_after_its_other_loads_complete() -> None:
    manager = stored(SlotIndex(4), 1)
    manager.prepare_load(keys(1))
    manager.prepare_load(keys(1))
    manager.complete_load(keys(1), success=False)
    assert manager.lookup(keys(1)) == LookupResult(0)  # not loadable any more
    assert held(manager) == 1  # but its slot is still read by the other load
    assert manager.take_events() == []
    manager.check_integrity()
    manager.complete_load(keys(1), success=True)
    assert held(manager) == 0
    assert manager.take_events() == [OffloadEvent(EventKind.REMOVED, tuple(keys(1)), Medium.HOST)]
    manager.check_integrity()


def test_successful_load_unpins() -> None:
    manager = stored(SlotIndex(1), 1)
    manager.prepare_load(keys(1))
    manager.complete_load(keys(1))
    manager.complete_load(keys(1))  # a repeated completion is ignored
    out = manager.prepare_store(keys(2))
    assert out is not None and out.evicted_keys == tuple(keys(1))


def test_events_are_one_per_operation_oldest_first_then_cleared() -> None:
    manager = SlotIndex(2, medium=Medium.DISK)
    manager.complete_store(manager.prepare_store(keys(1, 2)).keys_to_store)  # type: ignore[union-attr]
    manager.complete_store(manager.prepare_store(keys(3)).keys_to_store)  # type: ignore[union-attr]
    assert manager.take_events() == [
        OffloadEvent(EventKind.STORED, tuple(keys(1, 2)), Medium.DISK),
        OffloadEvent(EventKind.REMOVED, tuple(keys(2)), Medium.DISK),
        OffloadEvent(EventKind.STORED, tuple(keys(3)), Medium.DISK),
    ]
    assert manager.take_events() == []


def test_reset_drops_ready_unpinned_keys_only() -> None:
    manager = stored(SlotIndex(4), 1, 2)
    manager.prepare_load(keys(1))
    manager.prepare_store(keys(3))
    manager.reset()
    assert manager.take_events() == [OffloadEvent(EventKind.REMOVED, tuple(keys(2)), Medium.HOST)]
    assert manager.lookup(keys(1)) == LookupResult(1)
    assert manager.lookup(keys(3)) == LookupResult(0, pending=True)
    assert held(manager) == 2
    manager.check_integrity()


def test_usage_counts_every_held_slot() -> None:
    manager = stored(SlotIndex(5), 1, 2)
    manager.prepare_store(keys(3))
    assert manager.usage() == [TierUsage(Medium.HOST, 3, 5)]


SCAN_RESISTANT = [p for p in EvictionPolicy if p not in (EvictionPolicy.LRU, EvictionPolicy.ADAPTIVE)]
"""The adaptive policy is LRU until shadow tiers steer it."""


@pytest.mark.parametrize("policy", SCAN_RESISTANT, ids=lambda p: p.value)
def test_a_scan_resistant_manager_keeps_loaded_keys_through_a_scan(policy: EvictionPolicy) -> None:
    for kind, kept in ((EvictionPolicy.LRU, 0), (policy, 2)):
        manager = stored(SlotIndex(10, policy=kind), *range(1, 6))
        manager.touch(keys(1, 2))
        for i in range(100, 130):
            stored(manager, i)
        assert manager.lookup(keys(1, 2)) == LookupResult(kept)
        manager.check_integrity()


def test_spec_factory_builds_the_specs_of_another_medium() -> None:
    def disk_blocks(ks, slots) -> TierBlocks:  # type: ignore[no-untyped-def]
        return TierBlocks(Medium.DISK, keys=tuple(ks), group_sizes=(len(ks),))

    manager = SlotIndex(4, medium=Medium.DISK, spec_factory=disk_blocks)
    out = manager.prepare_store(keys(1, 2))
    assert out is not None and out.store_spec == TierBlocks(Medium.DISK, tuple(keys(1, 2)), (2,))
    manager.complete_store(out.keys_to_store)
    assert manager.prepare_load(keys(2)) == TierBlocks(Medium.DISK, tuple(keys(2)), (1,))


@pytest.mark.parametrize("corrupt, message", [
    (lambda m: m._free.append(0), "add up"),
    (lambda m: m._ready.__setitem__(key(1), 1), "slots are repeated"),
    (lambda m: m._pins.__setitem__(key(9), 1), "pin counts"),
    (lambda m: m._pins.__setitem__(key(1), 0), "pin counts"),
    (lambda m: m._policy.remove(key(1)), "policy tracks"),
    (lambda m: m._in_flight.__setitem__(key(1), m._take(1)[0]), "two states"),
])
def test_check_integrity_raises_on_corrupted_bookkeeping(corrupt, message) -> None:  # type: ignore[no-untyped-def]
    manager = stored(SlotIndex(4), 1, 2)
    manager.check_integrity()
    corrupt(manager)
    with pytest.raises(IntegrityError, match=message):
        manager.check_integrity()


@pytest.mark.parametrize("policy", list(EvictionPolicy), ids=lambda p: p.value)
def test_a_hundred_million_slot_tier_allocates_little_until_its_slots_are_used(policy: EvictionPolicy) -> None:
    tracemalloc.start()
    try:
        manager = SlotIndex(100_000_000, policy)
        stored(manager, 1, 2, 3)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024
    assert manager.usage() == [TierUsage(Medium.HOST, 3, 100_000_000)]
    manager.check_integrity()


# ---- a tier whose slots are places on a medium: restore, placed, slot_of ----------------------------------------

def test_restore_makes_the_keys_ready_at_their_slots_without_events() -> None:
    manager = SlotIndex(8, medium=Medium.DISK)
    manager.restore([(key(1), 5), (key(2), 0), (key(3), 2)])
    assert manager.lookup(keys(1, 2, 3)) == LookupResult(3)
    assert manager.prepare_load(keys(3, 1)) == HostBlocks(slots=(2, 5), group_sizes=(2,))
    assert manager.take_events() == []
    assert manager.usage() == [TierUsage(Medium.DISK, 3, 8)]
    manager.check_integrity()


def test_stores_after_a_restore_take_the_free_slots_lowest_first_and_never_a_restored_one() -> None:
    manager = SlotIndex(6)
    manager.restore([(key(1), 1), (key(2), 3)])
    out = manager.prepare_store(keys(4, 5, 6, 7))
    assert out is not None and out.evicted_keys == ()
    assert out.store_spec == HostBlocks(slots=(0, 2, 4, 5), group_sizes=(4,))
    manager.complete_store(out.keys_to_store)
    manager.check_integrity()
    before = manager.placed()
    out = manager.prepare_store(keys(8))  # full: the policy evicts, and the victim's slot is the one reused
    assert out is not None and len(out.evicted_keys) == 1
    assert out.store_spec == HostBlocks(slots=(before[out.evicted_keys[0]],), group_sizes=(1,))
    manager.complete_store(out.keys_to_store)
    assert len(manager.placed()) == 6 and set(manager.placed().values()) == set(range(6))
    manager.check_integrity()


def test_restored_keys_are_evicted_by_the_policy_like_stored_ones() -> None:
    manager = SlotIndex(2)
    manager.restore([(key(1), 0), (key(2), 1)])
    manager.touch(keys(1))
    out = manager.prepare_store(keys(3))
    assert out is not None and out.evicted_keys == tuple(keys(2))
    assert out.store_spec == HostBlocks(slots=(1,), group_sizes=(1,))


@pytest.mark.parametrize("placed", [
    [(key(1), 0), (key(1), 1)],
    [(key(1), 0), (key(2), 0)],
    [(key(1), 4)],
    [(key(1), -1)],
], ids=["repeated-key", "repeated-slot", "beyond-capacity", "negative"])
def test_restore_refuses_repeated_keys_or_slots_and_slots_out_of_range(placed) -> None:  # type: ignore[no-untyped-def]
    manager = SlotIndex(4)
    with pytest.raises(ValueError, match="distinct"):
        manager.restore(placed)
    assert manager.usage() == [TierUsage(Medium.HOST, 0, 4)]
    manager.check_integrity()


def test_restore_refuses_an_index_that_is_not_empty() -> None:
    in_flight = SlotIndex(4)
    in_flight.prepare_store(keys(1))
    for manager in (stored(SlotIndex(4), 1), in_flight):
        with pytest.raises(ValueError, match="not empty"):
            manager.restore([(key(2), 3)])
        manager.check_integrity()
    manager = SlotIndex(4)
    manager.restore([])  # nothing was there: as new
    manager.restore([(key(2), 3)])
    assert manager.slot_of(key(2)) == 3


def test_placed_is_a_copy_of_the_ready_keys_slots() -> None:
    manager = stored(SlotIndex(4), 1, 2)
    manager.prepare_store(keys(3))
    placed = manager.placed()
    assert placed == {key(1): 0, key(2): 1}
    placed[key(9)] = 3
    del placed[key(1)]
    assert manager.placed() == {key(1): 0, key(2): 1}
    manager.check_integrity()


def test_slot_of_answers_only_for_a_ready_key() -> None:
    manager = stored(SlotIndex(4), 1, 2)
    manager.prepare_store(keys(3))
    assert manager.slot_of(key(2)) == 1
    assert manager.slot_of(key(3)) is None and manager.slot_of(key(9)) is None  # in flight; unknown
    manager.prepare_load(keys(1))
    manager.prepare_load(keys(1))
    manager.complete_load(keys(1), success=False)  # doomed: still pinned, no longer loadable
    assert manager.slot_of(key(1)) is None


@pytest.mark.parametrize("policy", list(EvictionPolicy), ids=lambda p: p.value)
def test_restoring_a_few_keys_into_a_hundred_million_slots_allocates_little(policy: EvictionPolicy) -> None:
    tracemalloc.start()
    try:
        manager = SlotIndex(100_000_000, policy)
        manager.restore([(key(1), 0), (key(2), 1000), (key(3), 7)])
        stored(manager, 4, 5)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024
    assert manager.slot_of(key(4)) == 1 and manager.slot_of(key(5)) == 2  # the holes below first
    assert manager.usage() == [TierUsage(Medium.HOST, 5, 100_000_000)]
    manager.check_integrity()
