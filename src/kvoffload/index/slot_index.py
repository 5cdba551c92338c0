"""Residency index of one fixed-capacity tier: which key sits in which slot, in which state, pinned by whom.

The host tier's pool is ``num_slots`` offload blocks; this index hands out slot numbers for stores, tells
loads where blocks are, and picks victims through an eviction policy. It moves no bytes: the worker half
copies into and out of the slots named in the specs it returns.

Per key, one of:

- in flight: ``prepare_store`` reserved a slot, the copy has not completed; not loadable, not evictable. It is in
  the policy already (which never gets to evict it), so that completing a store is cheap.
- ready: loadable; evictable unless pinned. Every ready key is in the policy.
- doomed: a load of it failed while another load still pins it; not loadable, dropped when the last pin
  goes.

A pin count per key counts the loads in progress. Conservation law, checked by ``check_integrity``: free
slots + ready + in flight + doomed == capacity.

Cost: every call is O(len(keys)) plus, for ``prepare_store``, the victims the policy skips; ``reset`` and
``check_integrity`` are O(slots in use). ``lookup`` runs over a whole prompt's keys on every scheduler step, so
state is plain dicts of key -> slot with no per-key objects. Nothing is allocated per slot up front: slots never
used yet are a counter, and only slots given back are listed (a 64 GiB disk tier of small blocks has a hundred
million slots, which as a list cost 4 GB and seconds before the engine served anything).

Other tiers reuse this index with their own spec type through ``spec_factory`` (the disk tier names files by
key).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from kvoffload.blocks import BlockSpec, HostBlocks, Medium
from kvoffload.config import EvictionPolicy
from kvoffload.index.base import (
    EventKind,
    HostIndex,
    IntegrityError,
    LookupResult,
    OffloadEvent,
    PrepareStoreOutput,
    TierUsage,
)
from kvoffload.index.policies.base import Policy
from kvoffload.index.policies.registry import make_policy
from kvoffload.keys import OffloadKey

logger = logging.getLogger(__name__)

SpecFactory = Callable[[Sequence[OffloadKey], Sequence[int]], BlockSpec]
"""Builds the spec of ``keys`` held in ``slots`` (same order), as one group."""


def host_blocks(keys: Sequence[OffloadKey], slots: Sequence[int]) -> HostBlocks:
    """The host tier's spec: the slots of the pool, one group."""
    return HostBlocks(slots=tuple(slots), group_sizes=(len(slots),))


class SlotIndex(HostIndex):
    """A fixed number of slots, indexed by key.

    Args:
        num_slots: capacity in offload blocks.
        policy: eviction policy among ready, unpinned keys: a kind ``make_policy`` builds, or a policy object
            (an offline one, as ``kvoffload replay``'s optimum, which knows the trace's future).
        medium: the medium named in events and usage.
        spec_factory: builds the specs returned by ``prepare_load`` and ``prepare_store`` from (keys, slots);
            ``host_blocks`` by default.
    Raises:
        ValueError: ``num_slots`` is not a positive integer.
    """

    __slots__ = ("_doomed", "_events", "_free", "_fresh", "_in_flight", "_pins", "_policy", "_ready", "_spec",
                 "capacity", "medium")

    def __init__(
        self,
        num_slots: int,
        policy: EvictionPolicy | Policy = EvictionPolicy.LRU,
        medium: Medium = Medium.HOST,
        spec_factory: SpecFactory = host_blocks,
    ) -> None:
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots <= 0:
            raise ValueError(f"SlotIndex: num_slots {num_slots!r} must be a positive integer")
        self.capacity = num_slots
        self.medium = medium
        self._spec = spec_factory
        self._policy = policy if isinstance(policy, Policy) else make_policy(policy, num_slots)
        # Slots given back, reused last in first out; then never-used slots from ``_fresh`` up, so slot 0 is
        # handed out first, which keeps small pools easy to read in tests.
        self._free: list[int] = []
        self._fresh = 0
        self._ready: dict[OffloadKey, int] = {}
        self._in_flight: dict[OffloadKey, int] = {}
        self._doomed: dict[OffloadKey, int] = {}
        self._pins: dict[OffloadKey, int] = {}
        self._events: list[OffloadEvent] = []

    @property
    def host_policy(self) -> Policy:
        return self._policy

    def lookup(self, keys: Sequence[OffloadKey]) -> LookupResult:
        ready = self._ready
        hits = 0
        for key in keys:
            if key not in ready:
                return LookupResult(hits, key in self._in_flight)
            hits += 1
        return LookupResult(hits)

    def prepare_load(self, keys: Sequence[OffloadKey]) -> BlockSpec:
        try:
            slots = [self._ready[key] for key in keys]
        except KeyError as e:
            raise KeyError(f"prepare_load: key {e.args[0]!r} is not ready on {self.medium.value}") from None
        pins = self._pins
        for key in keys:
            pins[key] = pins.get(key, 0) + 1
        return self._spec(keys, slots)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        # Back to front, so that a prefix's first blocks end up most recent: a later block is useless without
        # the blocks before it, so it should be evicted first.
        self._policy.touch_all(reversed(keys))

    def complete_load(self, keys: Sequence[OffloadKey], success: bool = True) -> None:
        pins = self._pins
        dropped: list[OffloadKey] = []
        for key in keys:
            count = pins.get(key)
            if count is None:
                continue  # not pinned: a repeated completion; nothing left to undo
            if count > 1:
                pins[key] = count - 1
                if not success and key in self._ready:
                    self._doom(key)
                continue
            del pins[key]
            if not success or key in self._doomed:
                self._drop(key)
                dropped.append(key)
        if dropped:
            logger.debug("dropped %d keys from %s after a failed load", len(dropped), self.medium.value)
            self._emit(EventKind.REMOVED, dropped)

    def prepare_store(self, keys: Sequence[OffloadKey]) -> PrepareStoreOutput | None:
        ready, in_flight, doomed = self._ready, self._in_flight, self._doomed
        # dict.fromkeys drops repeated keys and keeps order. A doomed key counts as held: it is stored again
        # once its last load completes and drops it.
        new = [key for key in dict.fromkeys(keys) if key not in ready and key not in in_flight
               and key not in doomed]
        missing = len(new) - self._num_free()
        if missing > 0:
            self._policy.entering(new)
        evicted = self._evict(missing, keys)
        if evicted is None:
            return None
        slots = self._take(len(new))
        in_flight.update(zip(new, slots, strict=True))
        # The policy hears of a store when room is reserved for it (ARC adapts to a key's return then: the miss
        # that made the engine compute it again), so that completing it only moves keys from in flight to ready.
        # In-flight keys are never offered as victims. Back to front for the same reason as ``touch``.
        self._policy.insert_all(reversed(new))
        return PrepareStoreOutput(tuple(new), self._spec(new, slots), tuple(evicted))

    def complete_store(self, keys: Sequence[OffloadKey], success: bool = True) -> None:
        self.complete_store_keys(keys, success)

    def complete_store_keys(self, keys: Sequence[OffloadKey], success: bool = True) -> list[OffloadKey]:
        """``complete_store``, answering the keys that became ready (those still in flight, once each)."""
        in_flight, ready = self._in_flight, self._ready
        if not success:
            self._fail_stores(keys)
            return []
        stored: list[OffloadKey] = []
        for key in keys:
            slot = in_flight.pop(key, None)
            if slot is not None:  # else not in flight: a repeated key or completion
                ready[key] = slot
                stored.append(key)
        if stored:
            self._emit(EventKind.STORED, stored)
        return stored

    def _fail_stores(self, keys: Sequence[OffloadKey]) -> None:
        in_flight, free, policy = self._in_flight, self._free, self._policy
        for key in keys:
            slot = in_flight.pop(key, None)
            if slot is not None:
                free.append(slot)
                policy.remove(key)

    def restore(self, placed: Sequence[tuple[OffloadKey, int]]) -> None:
        """Make an empty index hold ``placed`` (key, slot) pairs as ready: a tier whose slots are places on a
        medium (the disk tier's slot file) finds them there at start-up. No events: they were there before.

        Raises:
            ValueError: the index is not empty, or a key or slot repeats, or a slot is out of range.
        """
        if self._ready or self._in_flight or self._doomed or self._fresh:
            raise ValueError("SlotIndex.restore: the index is not empty")
        keys = [key for key, _ in placed]
        slots = {slot for _, slot in placed}
        if len(set(keys)) != len(keys) or len(slots) != len(keys) or not all(0 <= s < self.capacity for s in slots):
            raise ValueError("SlotIndex.restore: keys and slots must be distinct, slots within the capacity")
        self._ready.update(placed)
        self._policy.insert_all(reversed(keys))
        # Slots above the highest restored one stay never-used (a counter, as in a new index); only the holes below
        # it are listed, so restoring a few blocks into a huge file allocates little.
        self._fresh = max(slots) + 1 if slots else 0
        self._free = [s for s in range(self._fresh - 1, -1, -1) if s not in slots]  # slot 0 is handed out first

    def placed(self) -> dict[OffloadKey, int]:
        """Every ready key's slot (a copy)."""
        return dict(self._ready)

    def slot_of(self, key: OffloadKey) -> int | None:
        """The slot of a ready key (None if it is not ready)."""
        return self._ready.get(key)

    def take_events(self) -> list[OffloadEvent]:
        events, self._events = self._events, []
        return events

    def reset(self) -> None:
        pins = self._pins
        removed = [key for key in self._ready if key not in pins]
        for key in removed:
            self._drop(key)
        if removed:
            logger.info("reset %s tier: dropped %d blocks", self.medium.value, len(removed))
            self._emit(EventKind.REMOVED, removed)

    def usage(self) -> list[TierUsage]:
        return [TierUsage(self.medium, self._fresh - len(self._free), self.capacity)]

    def check_integrity(self) -> None:
        """Check the laws below; raise ``IntegrityError`` naming the first that does not hold.

        - free + ready + in flight + doomed == capacity (pinned keys are among ready and doomed);
        - every slot ever handed out appears exactly once among given-back and held slots; no key in two states;
        - pins are positive and only on ready or doomed keys; every doomed key is pinned;
        - the policy tracks exactly the ready and in-flight keys (pinned ones included; doomed ones not).
        """
        ready, in_flight, doomed, free = self._ready, self._in_flight, self._doomed, self._free
        counts = (f"free {self._num_free()}, ready {len(ready)}, in flight {len(in_flight)}, "
                  f"doomed {len(doomed)}")
        if len(free) + len(ready) + len(in_flight) + len(doomed) != self._fresh or self._fresh > self.capacity:
            raise IntegrityError(f"{self.medium.value} tier: {counts} do not add up to {self.capacity} slots")
        slots = [*free, *ready.values(), *in_flight.values(), *doomed.values()]
        if sorted(slots) != list(range(self._fresh)):
            raise IntegrityError(f"{self.medium.value} tier: slots are repeated or out of range ({counts})")
        if len(ready.keys() | in_flight.keys() | doomed.keys()) != len(ready) + len(in_flight) + len(doomed):
            raise IntegrityError(f"{self.medium.value} tier: a key is in two states ({counts})")
        self._check_pins()
        self._check_policy()

    def _check_pins(self) -> None:
        bad = [key for key, count in self._pins.items()
               if count <= 0 or (key not in self._ready and key not in self._doomed)]
        if bad:
            raise IntegrityError(f"{self.medium.value} tier: {len(bad)} pin counts are not positive or on "
                                 f"keys neither ready nor doomed (first {bad[0]!r})")
        unpinned = [key for key in self._doomed if key not in self._pins]
        if unpinned:
            raise IntegrityError(f"{self.medium.value} tier: {len(unpinned)} doomed keys are not pinned")

    def _check_policy(self) -> None:
        policy, tracked = self._policy, len(self._ready) + len(self._in_flight)
        if len(policy) != tracked or not all(key in policy for key in (*self._ready, *self._in_flight)):
            raise IntegrityError(f"{self.medium.value} tier: policy tracks {len(policy)} keys, "
                                 f"not the {tracked} ready and in-flight ones")
        policy.check_integrity()

    def _num_free(self) -> int:
        return len(self._free) + self.capacity - self._fresh

    def _take(self, n: int) -> list[int]:
        """``n`` free slots (the caller checked there are enough): given-back ones first, then never-used ones."""
        free = self._free
        slots = [free.pop() for _ in range(min(n, len(free)))]
        fresh = self._fresh
        self._fresh = fresh + n - len(slots)
        slots.extend(range(fresh, self._fresh))
        return slots

    def _evict(self, n: int, storing: Sequence[OffloadKey]) -> list[OffloadKey] | None:
        """Evict ``n`` ready, unpinned keys not in ``storing``; None (no change) when there are too few."""
        if n <= 0:
            return []
        ready, free, pins = self._ready, self._free, self._pins
        # Pinned keys are the ready ones in ``pins`` (the doomed ones are pinned too): a full tier of pinned
        # blocks says no in O(1) instead of walking the whole policy.
        if n > len(ready) - (len(pins) - len(self._doomed)):
            return None
        protected = set(storing)
        in_flight = self._in_flight
        victims = self._policy.victims(
            n, lambda key: key not in pins and key not in protected and key not in in_flight)
        if victims is None:
            return None
        for key in victims:
            free.append(ready.pop(key))
        self._emit(EventKind.REMOVED, victims)
        return victims

    def _doom(self, key: OffloadKey) -> None:
        self._doomed[key] = self._ready.pop(key)
        self._policy.remove(key)

    def _drop(self, key: OffloadKey) -> None:
        """Forget a ready or doomed key and free its slot."""
        slot = self._doomed.pop(key, None)
        if slot is None:
            slot = self._ready.pop(key)
            self._policy.remove(key)
        self._free.append(slot)

    def _emit(self, kind: EventKind, keys: list[OffloadKey]) -> None:
        self._events.append(OffloadEvent(kind, tuple(keys), self.medium))
