"""S3-FIFO (Yang et al., "FIFO queues are all you need for cache eviction", SOSP 2023).

Three FIFO queues. A new key enters the small queue S. While S holds at least a tenth of the tier, victims come
from S: its oldest key leaves, into the main queue M if it was used while in S, else out of the tier and into the
ghost queue G, which remembers evicted keys (without data, as many as the tier holds). A key inserted while G
remembers it goes straight to M. M is a CLOCK: its oldest key goes unless it was used since it last came round,
in which case it gets another round at the back (its use spent). Most blocks are used once (on our traces, three
out of four), so they leave through the small queue quickly, and neither a one-time scan nor a loop larger than
the tier flushes the blocks that are used again.

Differences from the paper: one use bit per key instead of a two-bit counter (the same hit rates on the Mooncake
conversation trace and on synthetic recency, loop and Zipf traces, and a batch of uses is then one C-level
set update); a key moving from S to M spends its use. As in every policy here, a key that ``can_evict``
refuses keeps its place and its use bit, and ``remove`` forgets a key without remembering it in G.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator
from itertools import islice, repeat

from kvoffload.index.base import IntegrityError
from kvoffload.index.policies.base import CanEvict, Policy, consume
from kvoffload.index.policies.clock import ClockPlan
from kvoffload.keys import OffloadKey

SMALL_SHARE = 10
"""S's share of the tier: victims come from S while it holds at least 1/SMALL_SHARE of the capacity."""

_Queue = OrderedDict[OffloadKey, None]

_PRUNE_SLACK = 64
"""Uses of keys that are not resident tolerated beyond twice the resident keys before they are pruned."""


class S3FIFOPolicy(Policy):
    """Args: capacity: the most keys the tier holds (sizes S's share and G).

    Raises:
        ValueError: ``capacity`` is not positive.
    """

    __slots__ = ("_capacity", "_ghost", "_main", "_small", "_small_target", "_used")

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"S3FIFOPolicy: capacity {capacity} must be positive")
        self._capacity = capacity
        self._small_target = max(1, capacity // SMALL_SHARE)
        self._small: _Queue = OrderedDict()
        self._main: _Queue = OrderedDict()
        self._ghost: _Queue = OrderedDict()
        self._used: set[OffloadKey] = set()
        """Resident keys used since they entered their queue or last came round in M. Uses of keys that are not
        resident land here too (a batch of uses is then one C-level set update) and do not count: a key's bit is
        cleared when it becomes resident, and they are pruned once they outnumber the resident keys."""

    def insert(self, key: OffloadKey) -> None:
        if key in self:
            self._used.add(key)
            return
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = None
        else:
            self._small[key] = None
        self._used.discard(key)

    def insert_all(self, keys: Iterable[OffloadKey]) -> None:
        ks = list(keys)
        new = dict.fromkeys(ks)
        if len(new) < len(ks) or not (self._small.keys().isdisjoint(new) and self._main.keys().isdisjoint(new)
                                      and self._ghost.keys().isdisjoint(new)):
            for key in ks:
                self.insert(key)
            return
        # The common case, a store's new keys: all to S, as one by one, with C-level updates.
        self._small.update(new)
        self._used.difference_update(new)

    def touch(self, key: OffloadKey) -> None:
        self._used.add(key)
        self._prune()

    def touch_all(self, keys: Iterable[OffloadKey]) -> None:
        self._used.update(keys)
        self._prune()

    def _prune(self) -> None:
        # The tier's index only uses resident keys: this runs for callers that do not, and at most once per as
        # many uses of non-resident keys as there are resident keys (O(1) amortized).
        if len(self._used) > 2 * len(self) + _PRUNE_SLACK:
            self._used = {key for key in self._used if key in self}

    def remove(self, key: OffloadKey) -> None:
        if key not in self:
            return
        self._used.discard(key)
        if key in self._small:
            del self._small[key]
        else:
            del self._main[key]

    def victims(self, n: int, can_evict: CanEvict) -> list[OffloadKey] | None:
        if n <= 0:
            return []
        if n > len(self):
            return None
        small = self._small
        if len(small) - n >= self._small_target - 1:
            # The common case: S stays at its share through every pick, so the victims are S's first n keys that
            # may go, if none of them was used (found by a C-level scan).
            chosen = list(islice(filter(can_evict, small), n))
            if len(chosen) == n and self._used.isdisjoint(chosen):
                self._evict_small(chosen)
                return chosen
        sweep = _Sweep(self, can_evict)
        while len(sweep.chosen) < n:
            from_small = sweep.small_left >= self._small_target
            if not (sweep.step_small() if from_small else sweep.step_main()) and \
                    not (sweep.step_main() if from_small else sweep.step_small()):
                return None  # nothing changed: the sweep only planned
        self._apply(sweep)
        return sweep.chosen

    def _evict_small(self, keys: list[OffloadKey]) -> None:
        """Evict unused keys of S into the ghost queue."""
        ghost = self._ghost
        consume(map(self._small.__delitem__, keys))
        ghost.update(dict.fromkeys(keys))
        consume(map(ghost.popitem, repeat(False, len(ghost) - self._capacity)))  # the oldest ghosts go

    def _apply(self, sweep: _Sweep) -> None:
        small, used = self._small, self._used
        for key in sweep.promoted:
            del small[key]
        used.difference_update(sweep.main.taken)

        def spend(key: OffloadKey) -> None:
            used.discard(key)

        sweep.main.apply(self._main, spend)  # promoted keys join M's back; keys given another round go there
        self._evict_small(sweep.from_small)

    def __contains__(self, key: object) -> bool:
        return key in self._small or key in self._main

    def __len__(self) -> int:
        return len(self._small) + len(self._main)

    def check_integrity(self) -> None:
        small, main, ghost = self._small.keys(), self._main.keys(), self._ghost.keys()
        if small & main:
            raise IntegrityError(f"S3-FIFO: {len(small & main)} keys are in both S and M")
        if len(self._used) > 2 * len(self) + _PRUNE_SLACK:
            raise IntegrityError(f"S3-FIFO: {len(self._used)} use bits for {len(self)} resident keys")
        if ghost & (small | main) or len(ghost) > self._capacity:
            raise IntegrityError(f"S3-FIFO: the ghost queue ({len(ghost)} keys) holds resident keys or exceeds "
                                 f"the capacity {self._capacity}")


class _Sweep:
    """One ``victims`` call, planned before anything changes (so that a call that cannot find enough victims
    changes nothing): which keys go, which move from S to M, which get another round in M (``ClockPlan``).
    S is read front to back once; refused keys are passed over and keep their place."""

    __slots__ = ("can_evict", "chosen", "from_small", "main", "promoted", "small", "small_left", "used")

    def __init__(self, policy: S3FIFOPolicy, can_evict: CanEvict) -> None:
        self.can_evict = can_evict
        self.used = policy._used
        self.small: Iterator[OffloadKey] = iter(policy._small)
        self.main = ClockPlan(policy._main, self._used_many, can_evict)
        self.small_left = len(policy._small)
        self.chosen: list[OffloadKey] = []
        """Every victim, in the order chosen."""
        self.from_small: list[OffloadKey] = []
        self.promoted: list[OffloadKey] = []

    def _used_many(self, keys: list[OffloadKey]) -> list[bool]:
        return list(map(self.used.__contains__, keys))

    def step_small(self) -> bool:
        """Take S's next evictable key: to M if used, else a victim. False when S has none left."""
        for key in self.small:
            if not self.can_evict(key):
                continue
            self.small_left -= 1
            if key in self.used:
                self.promoted.append(key)
                self.main.join(key)
            else:
                self.chosen.append(key)
                self.from_small.append(key)
            return True
        return False

    def step_main(self) -> bool:
        """Take M's next victim (giving used keys another round on the way). False when M has none left."""
        key = self.main.take()
        if key is None:
            return False
        self.chosen.append(key)
        return True
