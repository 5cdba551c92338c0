"""The scheduler half of a shared store under host that only its server knows the contents of (remote, object).

A store that many engines write, that evicts or expires on its own, cannot be indexed by any one engine. So an
index of such a tier (``RemoteIndex``, ``ObjectIndex``):

- asks the store on lookups (``StoreProbe.leading_run``: how many leading keys it holds), off the engine step
  (``tiers.lower.background.Searches``): the first lookup of a prompt's keys starts the search and answers
  ``pending`` (the engine asks again at a later step), a later lookup of the same keys takes the answer, and a
  search past ``deadline_s`` is a miss. A failed answer is a miss too, never an exception. Answers are remembered
  for ``cache_s`` (``LOOKUP_CACHE_S``), so the lookups of one step and of a request that waits for room cost one
  search. That is safe because a promotion is only ever a try: a block that vanished after it was seen fails its
  promotion (the worker verifies every block), the engine recomputes those tokens, and the failed keys are
  remembered as misses. A block written meanwhile by another engine is seen ``cache_s`` late: a recompute.
- keeps this engine's own budget: an index (a ``SlotIndex`` over ``capacity_bytes // block size`` logical slots)
  of the blocks this engine wrote, with the configured eviction policy, pins and in-flight stores as on every tier.
  A key that leaves it (its victim, a failed load or store, a reset, a block found gone) has every rank's copy
  deleted (``StoreProbe.delete``), in the background and never waited for (``tiers.lower.background.Deletes``).
  Blocks other engines wrote are never in it, so this engine never deletes them: it reads them (a promotion pins
  nothing of theirs) and leaves them to their writers and to the store's own expiry. A block two engines wrote at
  once is in both budgets: whichever drops it first deletes it, and the other one's next load of it is a recompute.
- events (STORED / REMOVED, the tier's medium) are those of the own index: what this engine wrote and deleted, and
  its own blocks that a lookup found gone.

Not thread-safe, like every index: the scheduler half calls it from one thread (the searches' and deletes' threads
only call the probe).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

from kvoffload.blocks import BlockSpec, Medium
from kvoffload.config import EvictionPolicy
from kvoffload.index.base import (
    BlockIndex,
    EventKind,
    IntegrityError,
    LookupResult,
    OffloadEvent,
    PrepareStoreOutput,
    StoreCounts,
    TierUsage,
)
from kvoffload.index.policies.base import Policy
from kvoffload.index.slot_index import SlotIndex
from kvoffload.keys import OffloadKey
from kvoffload.tiers.lower.background import MAX_SEARCHES, Deletes, Searches

LOOKUP_CACHE_S = 1.0
"""How long an answer of the store (a block exists, or not) is trusted without asking again."""
SEEN_MAX = 1 << 16
"""Answers remembered at most, the oldest forgotten first."""
SEARCH_DEADLINE_S = 3.0
"""How long a search may take before its lookup is a miss (the tiers pass their connect and request timeouts)."""


class StoreProbe(Protocol):
    """The scheduler's questions to a shared store (``RemoteProbe``, ``ObjectProbe``); failures are answers.

    ``leading_run`` and ``delete`` run on background threads, concurrently with each other and with ``available``
    on the scheduler thread: they must be thread-safe, and each bounded by the store's timeouts.
    """

    @property
    def available(self) -> bool:
        """Whether the store may be asked now (its breaker is closed, or the cool-down is over)."""

    def leading_run(self, keys: Sequence[OffloadKey]) -> int | None:
        """How many leading ``keys`` have every rank's copy in the store; None: the store did not answer."""

    def delete(self, keys: Sequence[OffloadKey]) -> bool:
        """Delete every rank's copy of ``keys``; False if it failed or was skipped."""


class ProbedIndex(BlockIndex):
    """Index of a shared store: the store's answers, and this engine's own blocks.

    Args:
        probe: asks the store.
        capacity_blocks: how many blocks this engine may have written there at once.
        medium: the tier's medium.
        spec_of: the tier's block spec of keys (and the own index's logical slots, which the store does not use).
        policy: eviction policy among this engine's ready, unpinned blocks.
        cache_s: how long an answer is trusted (0: ask every time).
        clock: monotonic seconds.
        deadline_s: how long a search may take before its lookup is a miss.
    Raises:
        ValueError: ``capacity_blocks`` is not positive.
    """

    def __init__(self, probe: StoreProbe, capacity_blocks: int, medium: Medium,
                 spec_of: Callable[[Sequence[OffloadKey], Sequence[int]], BlockSpec],
                 policy: EvictionPolicy | Policy = EvictionPolicy.LRU, cache_s: float = LOOKUP_CACHE_S,
                 clock: Callable[[], float] = time.monotonic, deadline_s: float = SEARCH_DEADLINE_S) -> None:
        self.probe = probe
        self.searches = Searches(probe, deadline_s, clock)
        self._switched_off = 0  # lookups answered a miss while the store's breaker was open
        self.deletes = Deletes(probe, f"{medium.value} tier")
        self._medium = medium
        self._spec_of = spec_of
        self._own = SlotIndex(capacity_blocks, policy, medium, spec_of)
        self._cache_s = cache_s
        self._clock = clock
        self._seen: dict[OffloadKey, tuple[bool, float]] = {}  # key -> (its blocks exist, answer's expiry)
        self._events: list[OffloadEvent] = []

    @property
    def medium(self) -> Medium:
        return self._medium

    @property
    def capacity(self) -> int:
        return self._own.capacity

    def lookup(self, keys: Sequence[OffloadKey]) -> LookupResult:
        if not keys:
            return LookupResult(0)
        if not self.probe.available:
            self._switched_off += 1
            return LookupResult(0)
        now = self._clock()
        known = self._known_run(keys, now)
        if known == len(keys) or self._answer(keys[known], now) is False:
            return LookupResult(known)
        answer = self.searches.answer(keys[known:])
        if answer is None:
            return LookupResult(known, pending=True)
        run = answer.run
        if run is None:
            return LookupResult(0)  # the server is failing: what it said a moment ago is worth nothing now
        hits = known + run
        for key in keys[known:hits]:
            self._remember(key, True, now)
        if hits < len(keys):
            self._remember(keys[hits], False, now)
            self._forget_own(keys[hits])
        return LookupResult(hits)

    def prepare_load(self, keys: Sequence[OffloadKey]) -> BlockSpec:
        # Only this engine's blocks are pinned (against its own budget's deletes); others' are read as they are.
        own = self._own
        own.prepare_load([key for key in keys if own.lookup((key,)).hits])
        return self._spec_of(keys, ())

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        self._own.touch(keys)

    def complete_load(self, keys: Sequence[OffloadKey], success: bool = True) -> None:
        self._own.complete_load(keys, success)  # a key it did not pin (another engine's block) is ignored
        if not success:
            now = self._clock()
            for key in keys:
                self._remember(key, False, now)  # gone or damaged: not promoted again until asked anew
        self._collect()

    def prepare_store(self, keys: Sequence[OffloadKey]) -> PrepareStoreOutput | None:
        if not self.probe.available:
            return None  # the workers' stores would fail too: the blocks stay host-only
        out = self._own.prepare_store(keys)
        self._collect()
        return out

    def complete_store(self, keys: Sequence[OffloadKey], success: bool = True) -> None:
        self._own.complete_store(keys, success)
        now = self._clock()
        for key in keys:
            self._remember(key, success, now)
        if not success:
            self.deletes.submit(keys)  # the ranks that did write their copy must not keep an unindexed one
        self._collect()

    def take_events(self) -> list[OffloadEvent]:
        events, self._events = self._events, []
        return events

    def reset(self) -> None:
        self._own.reset()
        self._seen.clear()
        self._collect()

    def check_integrity(self) -> None:
        """The own index's laws, and: no more answers remembered than ``SEEN_MAX``, no more searches open than
        ``MAX_SEARCHES``."""
        self._own.check_integrity()
        if len(self._seen) > SEEN_MAX:
            raise IntegrityError(f"{self._medium.value} tier: {len(self._seen)} answers remembered, more than "
                                 f"{SEEN_MAX}")
        if self.searches.open > MAX_SEARCHES:
            raise IntegrityError(f"{self._medium.value} tier: {self.searches.open} searches open, more than "
                                 f"{MAX_SEARCHES}")

    def store_counts(self) -> StoreCounts:
        searches, deletes = self.searches, self.deletes
        return StoreCounts(searches.unanswered + self._switched_off, deletes.failed + deletes.dropped)

    def wait_answers(self, timeout_s: float) -> bool:
        """Wait until every search started has its answer, for the next lookup to take (tests, benches); False if
        ``timeout_s`` passed first."""
        return self.searches.wait(timeout_s)

    def close(self) -> None:
        """Stop the search and delete threads (deletes queued are still sent; nothing waits for them)."""
        self.searches.close()
        self.deletes.close()

    def usage(self) -> list[TierUsage]:
        return self._own.usage()

    def _known_run(self, keys: Sequence[OffloadKey], now: float) -> int:
        """Leading keys whose blocks the store said exist, less than ``cache_s`` ago."""
        seen = self._seen
        for i, key in enumerate(keys):
            answer = seen.get(key)
            if answer is None or not answer[0] or answer[1] <= now:
                return i
        return len(keys)

    def _answer(self, key: OffloadKey, now: float) -> bool | None:
        answer = self._seen.get(key)
        return None if answer is None or answer[1] <= now else answer[0]

    def _remember(self, key: OffloadKey, exists: bool, now: float) -> None:
        if self._cache_s <= 0:
            return
        seen = self._seen
        if seen.pop(key, None) is None and len(seen) >= SEEN_MAX:
            del seen[next(iter(seen))]
        seen[key] = (exists, now + self._cache_s)

    def _forget_own(self, key: OffloadKey) -> None:
        """``key``'s copies are not all there: if it is this engine's, it leaves the index (as a failed load)."""
        if self._own.lookup((key,)).hits:
            self._own.prepare_load((key,))
            self._own.complete_load((key,), success=False)
            self._collect()

    def _collect(self) -> None:
        """Forward the own index's events; a key that left it has its copies deleted."""
        for event in self._own.take_events():
            if event.kind is EventKind.REMOVED:
                self.deletes.submit(event.keys)
                now = self._clock()
                for key in event.keys:
                    self._remember(key, False, now)
            self._events.append(event)
