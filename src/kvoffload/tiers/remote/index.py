"""Scheduler side of the remote tier: which values a Redis-protocol store holds, and this engine's budget there.

The lower tier of ``TieredManager`` when ``remote_url`` is set (host RAM stays the hub: values move only to and
from the host pool, in the workers' ``RemoteHandler``). Unlike the disk tier, this index cannot know what the tier
holds: the server evicts on its own (``maxmemory`` with an LRU policy), a TTL may expire values, and other engines
write and delete there. So:

- lookups ask the server (``RemoteProbe.leading_run``: ``EXISTS`` of every rank's value name, bounded by the
  timeout). A failed or slow answer is a miss, never an exception, never "pending". Answers are remembered for
  ``cache_s`` (``LOOKUP_CACHE_S``), so the lookups of one step and of a request that waits for room cost one
  round trip. That is safe because a promotion is only ever a try: a value that vanished after it was seen fails
  its promotion (the worker verifies every value), the engine recomputes those tokens, and the failed keys are
  remembered as misses. A value written meanwhile by another engine is seen ``cache_s`` late: a recompute.
- the budget is this engine's own: an index (a ``SlotIndex`` over ``capacity_bytes // value size`` logical
  slots, medium REMOTE) of the values this engine wrote, with the configured eviction policy, pins and in-flight
  stores as on every tier. A key that leaves it (its victim, a failed load or store, a reset, a value found gone)
  has every rank's value deleted (``DEL``). Values other engines wrote are never in it, so this engine never
  deletes them: it reads them (a promotion pins nothing of theirs) and leaves them to their writers and to the
  server. A value two engines wrote at once (``SET NX`` keeps one) is in both budgets: whichever drops it first
  deletes it, and the other one's next load of it is a recompute.
- events (STORED / REMOVED, medium REMOTE) are those of the own index: what this engine wrote and deleted, and
  its own values that a lookup found gone.

Not thread-safe, like every manager: the scheduler half calls it from one thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvoffload.config import ConfigError, EvictionPolicy, RemoteTierConfig
from kvoffload.keys import Namespace, OffloadKey
from kvoffload.manager.base import (
    EventKind,
    IntegrityError,
    LookupResult,
    OffloadEvent,
    PrepareStoreOutput,
    ResidencyManager,
    TierUsage,
)
from kvoffload.manager.slot_index import SlotIndex
from kvoffload.specs import BlockSpec, Medium, RemoteBlocks
from kvoffload.tiers.lower.block_format import BlockFormat
from kvoffload.tiers.remote.client import connect
from kvoffload.tiers.remote.probe import Breaker, RemoteProbe, ValueNames

logger = logging.getLogger(__name__)

LOOKUP_CACHE_S = 1.0
"""How long an answer of the server (a value exists, or not) is trusted without asking again."""
SEEN_MAX = 1 << 16
"""Answers remembered at most, the oldest forgotten first."""


def remote_blocks(keys: Sequence[OffloadKey], slots: Sequence[int]) -> RemoteBlocks:
    """The remote tier's spec: values named by key, one group (the logical slots stay in the index)."""
    return RemoteBlocks(keys=tuple(keys), group_sizes=(len(keys),))


class RemoteIndex(ResidencyManager):
    """Index of the remote tier: the server's answers, and this engine's own values.

    Args:
        probe: asks the server.
        capacity_blocks: how many values this engine may have written there at once.
        policy: eviction policy among this engine's ready, unpinned values.
        cache_s: how long an answer is trusted (0: ask every time).
        clock: monotonic seconds.
    Raises:
        ValueError: ``capacity_blocks`` is not positive.
    """

    def __init__(self, probe: RemoteProbe, capacity_blocks: int, policy: EvictionPolicy = EvictionPolicy.LRU,
                 cache_s: float = LOOKUP_CACHE_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.probe = probe
        self._own = SlotIndex(capacity_blocks, policy, Medium.REMOTE, remote_blocks)
        self._cache_s = cache_s
        self._clock = clock
        self._seen: dict[OffloadKey, tuple[bool, float]] = {}  # key -> (its values exist, answer's expiry)
        self._events: list[OffloadEvent] = []

    @classmethod
    def create(cls, config: RemoteTierConfig, namespace: Namespace, value_bytes: int, *,
               client: Any | None = None) -> RemoteIndex:
        """The scheduler's remote index; one ``PING`` tells whether the server is there (if not: misses for now).

        Args:
            value_bytes: size of one value (the disk tier's block encoding of the largest group's entry).
            client: a redis-py client to use (tests); None: ``tiers.remote.client.connect(config)``.
        Raises:
            ConfigError: ``remote_bytes`` is below one value.
        """
        capacity = config.capacity_bytes // value_bytes
        if capacity < 1:
            raise ConfigError(f"remote_bytes={config.capacity_bytes} is below one value ({value_bytes} bytes)")
        names = ValueNames(namespace, BlockFormat.of(config.secret))
        breaker = Breaker(config.breaker_errors, config.breaker_cooldown_s)
        probe = RemoteProbe((lambda: client) if client is not None else (lambda: connect(config)), names,
                            cluster=config.cluster, timeout_s=config.timeout_s, breaker=breaker)
        if not probe.check():
            logger.warning("remote tier (scheduler): %s does not answer; lookups are misses until it is asked "
                           "again in %.0f s", ", ".join(config.urls), config.breaker_cooldown_s)
        logger.info("remote tier: this engine may keep %d values of %d bytes per rank on %s", capacity, value_bytes,
                    ", ".join(config.urls))
        return cls(probe, capacity, config.policy)

    @property
    def medium(self) -> Medium:
        return Medium.REMOTE

    @property
    def capacity(self) -> int:
        return self._own.capacity

    def lookup(self, keys: Sequence[OffloadKey]) -> LookupResult:
        if not keys or not self.probe.available:
            return LookupResult(0)
        now = self._clock()
        known = self._known_run(keys, now)
        if known == len(keys) or self._answer(keys[known], now) is False:
            return LookupResult(known)
        run = self.probe.leading_run(keys[known:])
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
        # Only this engine's values are pinned (against its own budget's deletes); others' are read as they are.
        own = self._own
        own.prepare_load([key for key in keys if own.lookup((key,)).hits])
        return remote_blocks(keys, ())

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        self._own.touch(keys)

    def complete_load(self, keys: Sequence[OffloadKey], success: bool = True) -> None:
        self._own.complete_load(keys, success)  # a key it did not pin (another engine's value) is ignored
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
            self.probe.delete(keys)  # the ranks that did write their value must not keep an unindexed one
        self._collect()

    def take_events(self) -> list[OffloadEvent]:
        events, self._events = self._events, []
        return events

    def reset(self) -> None:
        self._own.reset()
        self._seen.clear()
        self._collect()

    def check_integrity(self) -> None:
        """The own index's laws, and: no more answers remembered than ``SEEN_MAX``."""
        self._own.check_integrity()
        if len(self._seen) > SEEN_MAX:
            raise IntegrityError(f"remote tier: {len(self._seen)} answers remembered, more than {SEEN_MAX}")

    def usage(self) -> list[TierUsage]:
        return self._own.usage()

    def _known_run(self, keys: Sequence[OffloadKey], now: float) -> int:
        """Leading keys whose values the server said exist, less than ``cache_s`` ago."""
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
        """``key``'s values are not all there: if it is this engine's, it leaves the index (as a failed load)."""
        if self._own.lookup((key,)).hits:
            self._own.prepare_load((key,))
            self._own.complete_load((key,), success=False)
            self._collect()

    def _collect(self) -> None:
        """Forward the own index's events; a key that left it has its values deleted."""
        for event in self._own.take_events():
            if event.kind is EventKind.REMOVED:
                self.probe.delete(event.keys)
                now = self._clock()
                for key in event.keys:
                    self._remember(key, False, now)
            self._events.append(event)
