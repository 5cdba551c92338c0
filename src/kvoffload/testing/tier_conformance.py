"""A conformance suite for the scheduler-side index of a tier under host (a ``LowerIndex``), ours and third parties'.

``TieredIndex`` trusts a lower tier's index to keep the rules of ``index.base.BlockIndex`` as the
``LowerIndex`` docstring (``index/base.py``) narrows them. A tier's author writes an ``IndexHarness`` (fresh
indexes of a known capacity, fresh keys, and what the tier's workers leave behind after a store) and runs every
check against it::

    from kvoffload.testing.tier_conformance import ALL_INDEX_CHECKS

    @pytest.mark.parametrize("check", ALL_INDEX_CHECKS, ids=lambda c: c.__name__)
    def test_my_index_conforms(check):
        check(MyIndexHarness())

Each check builds its own index and raises ``TierConformanceError`` naming the broken rule: a stored key is found
and an in-flight one is not; a failed store leaves nothing loadable and frees its room; keys held are not stored
again; the specs name the tier's medium, one entry per key, and a load reads where the store wrote; a pinned entry
is not evicted while pinned, pins are counted and ``complete_load`` unpins; a failed load drops the entry; the
index never holds more than its capacity and ``usage`` says what it holds; ``lookup`` counts only leading hits;
``reset`` forgets the ready, unpinned entries and keeps the pinned and in-flight ones; events name the tier's
medium and the keys stored and evicted; ``check_integrity`` passes after every call. Only what every built-in
index does is asked: nothing about which entry the eviction policy picks. A tier whose lookups cross a network
answers ``pending`` first (``LowerIndex``); the checks then wait with the index's ``wait_answers(timeout_s)`` and
ask again (``answered_lookup``), as the engine asks again at a later step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

from kvoffload.blocks import BlockSpec, DeviceBlocks, HostBlocks
from kvoffload.index.base import EventKind, IntegrityError, LookupResult, LowerIndex, PrepareStoreOutput
from kvoffload.keys import OffloadKey
from kvoffload.testing.conformance import ConformanceError

MIN_CAPACITY = 4
"""The smallest capacity a harness may give its indexes: the checks pin some entries and store past the others."""


ANSWER_WAIT_S = 10.0
"""How long ``answered_lookup`` waits for a tier's answer that is on its way."""


class TierConformanceError(ConformanceError):
    """A tier's index broke a rule of the ``LowerIndex`` interface; the message says which."""


def answered_lookup(index: LowerIndex, keys: Sequence[OffloadKey]) -> LookupResult:
    """``index.lookup(keys)``, asked again while it answers ``pending`` after waiting with the index's
    ``wait_answers(timeout_s)``, the method a tier that searches in the background offers tests. A tier without
    it answers at once: its ``pending`` (a store in flight) is the answer.

    Raises:
        TierConformanceError: no answer in time.
    """
    for _ in range(4):
        result = index.lookup(keys)
        wait_answers: Callable[[float], bool] | None = getattr(index, "wait_answers", None)
        if not result.pending or wait_answers is None:
            return result
        if not wait_answers(ANSWER_WAIT_S):
            raise _fail(f"a pending lookup had no answer within {ANSWER_WAIT_S} s")
    raise _fail("lookup of the same keys still answered pending after its answer came")


class IndexHarness(ABC):
    """What a tier's author provides to run the suite."""

    @property
    @abstractmethod
    def capacity(self) -> int:
        """Entries an index from ``new_index`` holds at most (at least ``MIN_CAPACITY``; the checks store up to
        three times as many keys, so keep it small)."""

    @abstractmethod
    def new_index(self) -> LowerIndex:
        """A fresh, empty index of ``capacity`` entries, sharing nothing with the indexes made before."""

    @abstractmethod
    def keys(self, n: int) -> list[OffloadKey]:
        """``n`` distinct keys this harness never handed out before."""

    def written(self, keys: Sequence[OffloadKey]) -> None:  # noqa: B027 (a hook: an index-only tier needs nothing)
        """Do what the tier's workers do for a store of ``keys`` before it is completed (write the files, the
        values), for an index that looks at the tier itself; nothing by default."""


IndexCheck = Callable[[IndexHarness], None]


def _fail(rule: str) -> TierConformanceError:
    return TierConformanceError(f"LowerIndex rule broken: {rule}")


def _checked(index: LowerIndex, after: str) -> None:
    """``check_integrity`` must pass after every call."""
    try:
        index.check_integrity()
    except IntegrityError as e:
        raise _fail(f"check_integrity() failed after {after}: {e}") from e


def _new(harness: IndexHarness) -> LowerIndex:
    if harness.capacity < MIN_CAPACITY:
        raise ValueError(f"IndexHarness.capacity {harness.capacity} is below {MIN_CAPACITY}")
    index = harness.new_index()
    _checked(index, "creation")
    index.take_events()  # what an index announces of what it found at start-up is not asked about
    return index


def _reserve(index: LowerIndex, keys: Sequence[OffloadKey]) -> PrepareStoreOutput:
    out = index.prepare_store(keys)
    _checked(index, f"prepare_store of {len(keys)} keys")
    if out is None:
        raise _fail(f"prepare_store refused {len(keys)} keys while enough entries were ready and unpinned")
    return out


def _complete(harness: IndexHarness, index: LowerIndex, out: PrepareStoreOutput, success: bool = True) -> None:
    harness.written(out.keys_to_store)  # even for a failed store: some workers may have written theirs
    index.complete_store(out.keys_to_store, success)
    _checked(index, f"complete_store(success={success})")


def _store(harness: IndexHarness, index: LowerIndex, keys: Sequence[OffloadKey]) -> PrepareStoreOutput:
    out = _reserve(index, keys)
    _complete(harness, index, out)
    return out


def _found(index: LowerIndex, keys: Sequence[OffloadKey]) -> list[OffloadKey]:
    """The keys of ``keys`` a lookup of each alone finds."""
    found = [k for k in keys if answered_lookup(index, [k]).hits == 1]
    _checked(index, "lookup")
    return found


def _load(index: LowerIndex, keys: Sequence[OffloadKey]) -> BlockSpec:
    spec = index.prepare_load(keys)
    _checked(index, f"prepare_load of {len(keys)} keys")
    return spec


def _unpin(index: LowerIndex, keys: Sequence[OffloadKey], success: bool = True) -> None:
    index.complete_load(keys, success)
    _checked(index, f"complete_load(success={success})")


def _used(index: LowerIndex) -> int:
    usage = index.usage()
    if len(usage) != 1 or usage[0].medium != index.medium:
        raise _fail(f"usage() of a lower tier must be one entry of its medium {index.medium.value!r}, got {usage}")
    return usage[0].used_blocks


def _entries(spec: BlockSpec) -> list[object]:
    """What locates each entry of a spec: its slot, its key, or both."""
    if isinstance(spec, HostBlocks):
        return list(spec.slots)
    if isinstance(spec, DeviceBlocks):
        return list(spec.block_ids)
    return list(zip(spec.keys, spec.slots, strict=True)) if spec.slots else list(spec.keys)


def _one_entry_per_key(index: LowerIndex, spec: BlockSpec, keys: Sequence[OffloadKey], call: str) -> None:
    if spec.medium != index.medium:
        raise _fail(f"{call} answered a spec of medium {spec.medium.value!r}, not the tier's {index.medium.value!r}")
    if spec.group_sizes != (len(keys),) or len(_entries(spec)) != len(keys):
        raise _fail(f"{call} of {len(keys)} keys answered {len(_entries(spec))} entries in groups "
                    f"{spec.group_sizes}, not one group of one entry per key")
    named = getattr(spec, "keys", None)
    if named is not None and tuple(named) != tuple(keys):
        raise _fail(f"{call} answered a spec naming other keys than asked, or in another order")


def check_stored_keys_are_found(harness: IndexHarness) -> None:
    """A key is not found while its store is in flight, and is found once the store completes."""
    index = _new(harness)
    keys = harness.keys(3)
    out = _reserve(index, keys)
    if out.keys_to_store != tuple(keys):
        raise _fail(f"prepare_store of {len(keys)} new keys must store them all, in order: got {out.keys_to_store}")
    if answered_lookup(index, keys).hits:
        raise _fail("a key whose store is still in flight was a lookup hit")
    _complete(harness, index, out)
    if answered_lookup(index, keys).hits != len(keys):
        raise _fail(f"lookup found {answered_lookup(index, keys).hits} of {len(keys)} keys just stored")
    index.touch([*keys, *harness.keys(1)])  # unknown keys are ignored
    _checked(index, "touch")


def check_failed_store_is_not_found(harness: IndexHarness) -> None:
    """``complete_store(success=False)`` leaves nothing loadable and gives the room back."""
    index = _new(harness)
    keys = harness.keys(harness.capacity)
    _complete(harness, index, _reserve(index, keys), success=False)
    if _found(index, keys):
        raise _fail("a key whose store failed was a lookup hit")
    if _used(index):
        raise _fail(f"usage() counts {_used(index)} entries after every store failed")
    out = _reserve(index, keys)  # the whole capacity is free again
    if out.keys_to_store != tuple(keys) or out.evicted_keys:
        raise _fail("keys whose store failed are not stored again, or their room was not freed")


def check_held_keys_are_not_stored_again(harness: IndexHarness) -> None:
    """``prepare_store`` leaves out the keys already held or in flight, and repeated keys, keeping input order."""
    index = _new(harness)
    held = harness.keys(1)
    _store(harness, index, held)
    flying = harness.keys(1)
    in_flight = _reserve(index, flying)
    new = harness.keys(2)  # with the others, exactly MIN_CAPACITY: nothing need be evicted
    out = _reserve(index, [new[0], *held, *flying, new[1], new[0]])
    if out.keys_to_store != tuple(new):
        raise _fail(f"prepare_store must store only the new keys, once each, in order: got {out.keys_to_store}")
    _complete(harness, index, in_flight)
    _complete(harness, index, out)
    if answered_lookup(index, [*held, *flying, *new]).hits != 4:
        raise _fail("a key left out of a store because it was held is no longer found")


def check_specs_name_the_tier(harness: IndexHarness) -> None:
    """Store and load specs are of the tier's medium, one group of one entry per key, and a load reads each entry
    where its store wrote it."""
    index = _new(harness)
    keys = harness.keys(3)
    out = _reserve(index, keys)
    _one_entry_per_key(index, out.store_spec, out.keys_to_store, "prepare_store")
    _complete(harness, index, out)
    where = dict(zip(out.keys_to_store, _entries(out.store_spec), strict=True))
    subset = [keys[2], keys[0]]
    spec = _load(index, subset)
    _one_entry_per_key(index, spec, subset, "prepare_load")
    if _entries(spec) != [where[k] for k in subset]:
        raise _fail("prepare_load names other entries than prepare_store gave the same keys")
    _unpin(index, subset)


def check_pinned_entries_are_not_evicted(harness: IndexHarness) -> None:
    """While pinned by ``prepare_load``, entries are not evicted: a store that needs their room is refused and
    changes nothing; ``complete_load`` unpins them."""
    index = _new(harness)
    full = harness.keys(harness.capacity)
    _store(harness, index, full)
    _load(index, full)
    if index.prepare_store(harness.keys(1)) is not None:
        raise _fail("prepare_store reserved room in an index whose every entry is pinned")
    _checked(index, "a refused prepare_store")
    if _found(index, full) != full:
        raise _fail("a refused prepare_store evicted pinned entries")
    pinned = full[:2]
    _unpin(index, full[2:])
    for key in harness.keys(harness.capacity - 2):  # one at a time: each takes an unpinned entry's room
        _store(harness, index, [key])
    if _found(index, pinned) != pinned:
        raise _fail("an entry pinned by prepare_load was evicted by a later store")
    _unpin(index, pinned)
    _store(harness, index, harness.keys(harness.capacity))  # needs every entry: the unpinned ones too
    if _found(index, pinned):
        raise _fail("entries unpinned by complete_load were not evicted by a store needing their room")


def check_pins_are_counted(harness: IndexHarness) -> None:
    """An entry pinned by two loads stays pinned until both complete."""
    index = _new(harness)
    full = harness.keys(harness.capacity)
    _store(harness, index, full)
    twice = full[:1]
    _load(index, twice)
    _load(index, twice)
    _unpin(index, twice)
    if index.prepare_store(harness.keys(harness.capacity)) is not None:
        raise _fail("an entry pinned by two loads was evictable after only one of them completed")
    _checked(index, "a refused prepare_store")
    _unpin(index, twice)
    _store(harness, index, harness.keys(harness.capacity))
    if _found(index, twice):
        raise _fail("an entry whose two loads completed was not evicted by a store needing its room")


def check_failed_load_drops_the_entry(harness: IndexHarness) -> None:
    """``complete_load(success=False)`` of an entry no other load pins drops it; the others stay."""
    index = _new(harness)
    keys = harness.keys(3)
    _store(harness, index, keys)
    _load(index, keys[:1])
    _unpin(index, keys[:1], success=False)
    if answered_lookup(index, keys[:1]).hits or _found(index, keys[1:]) != keys[1:]:
        raise _fail("a failed load did not drop its entry, or dropped others")
    if _used(index) != 2:
        raise _fail(f"usage() counts {_used(index)} entries, not the 2 left after a failed load")


def check_capacity_is_bounded(harness: IndexHarness) -> None:
    """The index never holds more than its capacity: a store of more new keys than that is refused, and storing
    key after key evicts (only as needed) while ``usage`` counts what is held and the evicted keys are gone."""
    index = _new(harness)
    cap = harness.capacity
    usage = index.usage()
    if [(u.medium, u.used_blocks, u.capacity_blocks) for u in usage] != [(index.medium, 0, cap)]:
        raise _fail(f"usage() of a fresh index of capacity {cap} is {usage}")
    if index.prepare_store(harness.keys(cap + 1)) is not None:
        raise _fail(f"prepare_store reserved room for {cap + 1} new keys in an index of capacity {cap}")
    _checked(index, "a refused prepare_store")
    stored: list[OffloadKey] = []
    for key in harness.keys(3 * cap):
        out = _store(harness, index, [key])
        stored.append(key)
        held = _found(index, stored)
        if len(held) != min(len(stored), cap) or _used(index) != len(held):
            raise _fail(f"after {len(stored)} stores into capacity {cap}: {len(held)} keys found and usage() "
                        f"counts {_used(index)} (want both {min(len(stored), cap)})")
        if key not in held or set(out.evicted_keys) & set(held):
            raise _fail("the key just stored is not found, or an evicted key still is")


def check_lookup_counts_leading_hits(harness: IndexHarness) -> None:
    """``lookup`` counts the keys found before the first miss, never those after it."""
    index = _new(harness)
    keys = harness.keys(4)
    _store(harness, index, [keys[0], keys[1], keys[3]])
    answers = [answered_lookup(index, ks).hits for ks in (keys, keys[:2], keys[2:], keys[3:], [])]
    _checked(index, "lookup")
    if answers != [2, 2, 0, 1, 0]:
        raise _fail(f"lookups of stored, stored, missing, stored keys answered hits {answers}, want [2, 2, 0, 1, 0]")


def check_reset_forgets_ready_entries(harness: IndexHarness) -> None:
    """``reset`` forgets every ready, unpinned entry; pinned and in-flight ones stay until completed."""
    index = _new(harness)
    ready, pinned, flying = harness.keys(2), harness.keys(1), harness.keys(1)
    _store(harness, index, [*ready, *pinned])
    _load(index, pinned)
    in_flight = _reserve(index, flying)
    index.reset()
    _checked(index, "reset")
    if _found(index, ready):
        raise _fail("an entry that was ready and unpinned is still found after reset()")
    if _found(index, pinned) != pinned:
        raise _fail("reset() dropped an entry pinned by a load in progress")
    _unpin(index, pinned)
    _complete(harness, index, in_flight)
    if answered_lookup(index, flying).hits != 1 or _used(index) != 2:
        raise _fail("a store in flight across reset() is not found once completed, or usage() miscounts")


def check_events_name_the_tier(harness: IndexHarness) -> None:
    """Events are of the tier's medium: STORED for the keys of each completed store, REMOVED for each evicted key."""
    index = _new(harness)
    keys = harness.keys(harness.capacity)
    _store(harness, index, keys)
    announced = _event_keys(index, EventKind.STORED)
    if not set(keys) <= announced:
        raise _fail("a completed store's keys were not announced STORED")
    out = _store(harness, index, harness.keys(2))
    if not out.evicted_keys or not set(out.evicted_keys) <= _event_keys(index, EventKind.REMOVED):
        raise _fail("the keys a store evicted were not announced REMOVED")


def _event_keys(index: LowerIndex, kind: EventKind) -> set[OffloadKey]:
    events = index.take_events()
    strangers = [e for e in events if e.medium != index.medium]
    if strangers:
        raise _fail(f"an event names medium {strangers[0].medium.value!r}, not the tier's {index.medium.value!r}")
    return {k for e in events if e.kind is kind for k in e.keys}


ALL_INDEX_CHECKS: tuple[IndexCheck, ...] = (
    check_stored_keys_are_found,
    check_failed_store_is_not_found,
    check_held_keys_are_not_stored_again,
    check_specs_name_the_tier,
    check_pinned_entries_are_not_evicted,
    check_pins_are_counted,
    check_failed_load_drops_the_entry,
    check_capacity_is_bounded,
    check_lookup_counts_leading_hits,
    check_reset_forgets_ready_entries,
    check_events_name_the_tier,
)


def check_tier_index(harness: IndexHarness) -> None:
    """Run every check against ``harness``.

    Raises:
        TierConformanceError: the first broken rule.
    """
    for check in ALL_INDEX_CHECKS:
        check(harness)
