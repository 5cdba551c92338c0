"""W-TinyLFU (Einziger, Friedman and Manes, "TinyLFU: a highly efficient cache admission policy", 2017), the policy
of Caffeine: frequency-based admission in front of an LRU main space.

Every key enters a small LRU window (a hundredth of the tier). When the window overflows and the main LRU is full,
the window's oldest key (the candidate) meets the main LRU's oldest (the victim): the candidate is admitted to the
main space, and the victim evicted, only if its estimated frequency is higher; else the candidate is evicted. So a
block is kept past the window only if it is likely to be used more than what it would replace, and a scan or a
loop larger than the tier flows through the window without flushing the main space.

Frequency: how often a key was inserted or used in the current sample period plus half as often in the previous
one (sample periods of ``SAMPLE_PERIODS`` times the capacity in counted events; the paper halves its counters,
swapping periods keeps each aging step O(1)). Evicted keys keep their counts until they age out, so a key that comes
back is known; the counts hold at most two periods' keys.

Differences from Caffeine: exact counts in a dictionary instead of a count-min sketch (nothing is allocated per slot
up front, and a batch of uses is counted at C speed), an LRU main space instead of a segmented one, a fixed window.
A block whose parent is evicted is useless, and frequency alone does not see that: on workloads of long prefix
chains that loop, the duels leave holes in the chains (see docs/configuration.md for when to pick it).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Iterator

from kvoffload.keys import OffloadKey
from kvoffload.manager.base import IntegrityError
from kvoffload.manager.policies.base import CanEvict, Policy, consume

WINDOW_SHARE = 100
"""The window holds 1/WINDOW_SHARE of the capacity (at least one key), as in Caffeine."""
SAMPLE_PERIODS = 4
"""Counted events per sample period, in multiples of the capacity."""

_Queue = OrderedDict[OffloadKey, None]


class TinyLFUPolicy(Policy):
    """Args: capacity: the most keys the tier holds (sizes the window and the sample period).

    Raises:
        ValueError: ``capacity`` is not positive.
    """

    __slots__ = ("_counted", "_counts", "_main", "_main_target", "_old_counts", "_period", "_resident",
                 "_window", "_window_target")

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"TinyLFUPolicy: capacity {capacity} must be positive")
        self._window_target = max(1, capacity // WINDOW_SHARE)
        self._main_target = max(0, capacity - self._window_target)
        self._period = SAMPLE_PERIODS * capacity
        self._window: _Queue = OrderedDict()
        self._main: _Queue = OrderedDict()
        self._resident: dict[OffloadKey, None] = {}
        """Window and main keys together: a C-level ``__contains__`` for batches of uses."""
        self._counts: Counter[OffloadKey] = Counter()
        self._old_counts: dict[OffloadKey, int] = {}
        self._counted = 0

    def frequency(self, key: OffloadKey) -> int:
        """The estimated frequency the duels compare (this period's count plus half the previous one's)."""
        return self._counts.get(key, 0) + self._old_counts.get(key, 0) // 2

    def insert(self, key: OffloadKey) -> None:
        if key in self._resident:
            self.touch(key)
            return
        self._resident[key] = None
        self._window[key] = None
        self._counts[key] += 1
        self._counted += 1

    def touch(self, key: OffloadKey) -> None:
        if key not in self._resident:
            return
        if key in self._main:
            self._main.move_to_end(key)
        else:
            self._window.move_to_end(key)
        self._counts[key] += 1
        self._counted += 1

    def touch_all(self, keys: Iterable[OffloadKey]) -> None:
        # A prompt's shared prefix is in the main space: one C call per key, then one Counter update for all of
        # them. A key in the window ends a run with a KeyError (the failed move consumed it).
        used = list(filter(self._resident.__contains__, keys))
        self._counts.update(used)
        self._counted += len(used)
        rest = iter(used)
        while True:
            try:
                consume(map(self._main.move_to_end, rest))
                return
            except KeyError as miss:
                self._window.move_to_end(miss.args[0])

    def remove(self, key: OffloadKey) -> None:
        if key in self._resident:
            self._forget(key)

    def _forget(self, key: OffloadKey) -> None:
        """Drop a resident key from its queue (its counts stay: they age out)."""
        del self._resident[key]
        if key in self._main:
            del self._main[key]
        else:
            del self._window[key]

    def victims(self, n: int, can_evict: CanEvict) -> list[OffloadKey] | None:
        if n <= 0:
            return []
        if n > len(self._resident):
            return None
        duel = _Duel(self, can_evict)
        while len(duel.chosen) < n:
            if not duel.step(n - len(duel.chosen)):
                return None  # nothing changed: the duel only planned
        for key in duel.admitted:
            del self._window[key]
            self._main[key] = None
        for key in duel.chosen:
            self._forget(key)
        if self._counted >= self._period:
            # Counts age here only (not in touch), so that a batch of uses counts as the same uses one by one.
            self._old_counts, self._counts, self._counted = self._counts, Counter(), 0
        return duel.chosen

    def __contains__(self, key: object) -> bool:
        return key in self._resident

    def __len__(self) -> int:
        return len(self._resident)

    def check_integrity(self) -> None:
        window, main = self._window.keys(), self._main.keys()
        if window & main or len(window) + len(main) != len(self._resident) or \
                not self._resident.keys() >= window | main:
            raise IntegrityError(f"TinyLFU: window ({len(window)}) and main ({len(main)}) are not a partition of "
                                 f"the {len(self._resident)} resident keys")
        if any(count <= 0 for count in self._counts.values()):
            raise IntegrityError("TinyLFU: a frequency count is not positive")


class _Duel:
    """One ``victims`` call, planned before anything changes (so that a call that cannot find enough victims
    changes nothing). Refused keys are passed over and keep their place."""

    __slots__ = ("admitted", "blocked", "can_evict", "chosen", "main", "main_left", "main_next", "policy",
                 "window", "window_left")

    def __init__(self, policy: TinyLFUPolicy, can_evict: CanEvict) -> None:
        self.policy = policy
        self.can_evict = can_evict
        self.window: Iterator[OffloadKey] = iter(policy._window)
        self.main: Iterator[OffloadKey] = iter(policy._main)
        self.main_next: OffloadKey | None = None
        self.window_left = len(policy._window)
        self.main_left = len(policy._main)
        self.chosen: list[OffloadKey] = []
        self.admitted: list[OffloadKey] = []
        self.blocked = False

    def step(self, needed: int) -> bool:
        """Free one slot or move one key from the window to the main space; False when nothing can go."""
        policy = self.policy
        # The keys about to be inserted enter the window: its oldest leave while it would overflow.
        candidate = self._candidate() if self.window_left + needed > policy._window_target else None
        if candidate is None:
            victim = self._victim() or self._next(self.window)
            if victim is None:
                return False
            self._evict(victim)
            return True
        self.window_left -= 1
        if self.main_left < policy._main_target:
            self._admit(candidate)
            return True
        victim = self._victim()
        if victim is not None and policy.frequency(candidate) > policy.frequency(victim):
            self._admit(candidate)
            self._evict(victim)
        else:
            self.chosen.append(candidate)
        return True

    def _candidate(self) -> OffloadKey | None:
        """The window's oldest key, if it may leave. A refused one stops the flow into the main space for this
        call, so that younger keys do not pass it there (it stays first in line)."""
        if self.blocked:
            return None
        key = next(self.window, None)
        if key is not None and not self.can_evict(key):
            self.blocked = True
            return None
        return key

    def _next(self, keys: Iterator[OffloadKey]) -> OffloadKey | None:
        return next(filter(self.can_evict, keys), None)

    def _victim(self) -> OffloadKey | None:
        """The main space's next evictable key, left in place until ``_evict`` takes it; then the admitted ones."""
        if self.main_next is None:
            self.main_next = self._next(self.main)
        if self.main_next is None:
            admitted = [k for k in self.admitted if k not in self.chosen]
            self.main_next = next(filter(self.can_evict, admitted), None)
        return self.main_next

    def _evict(self, key: OffloadKey) -> None:
        if key == self.main_next:
            self.main_next = None
            self.main_left -= 1
        else:
            self.window_left -= 1
        self.chosen.append(key)

    def _admit(self, key: OffloadKey) -> None:
        self.admitted.append(key)
        self.main_left += 1
