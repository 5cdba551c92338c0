"""W-TinyLFU (Einziger, Friedman and Manes, "TinyLFU: a highly efficient cache admission policy", 2017), the policy
of Caffeine: frequency-based admission in front of a main space.

Every key enters a small window (a hundredth of the tier). While the main space has room, the window's oldest key
moves on into it; once it is full, the window's oldest key (the candidate) meets the main space's next victim: the
candidate is admitted, and the victim evicted, only if the candidate's estimated frequency is higher; else the
candidate is evicted. So a block is kept past the window only if it is likely to be used more than what it would
replace, and a scan or a loop larger than the tier flows through the window without flushing the main space.

Frequency: how often a key was inserted or used in the current sample period plus half as often in the previous
one, each count capped at ``MAX_COUNT`` (Caffeine's 4-bit counters). A period ends once ``SAMPLE_PERIODS`` times the
capacity distinct keys were counted in it; the paper halves its counters, swapping periods keeps each aging step
O(1). Like TinyLFU's sketch, the counts see every use, of keys not resident too, and keep evicted keys until they
age out, so a key that comes back is known; they hold at most two periods' keys.

Differences from Caffeine, so that a batch of uses is one C-level ``Counter`` update and nothing else (a prompt's
touch is thousands of keys, every scheduler step): exact counts in a dictionary instead of a count-min sketch
(nothing is allocated per slot up front); a FIFO window and a CLOCK main space (``clock.py``: a main key goes unless
its count grew since it joined or last came round) instead of LRU segments; a fixed window. A block whose parent is
evicted is useless, and frequency alone does not see that: on long prefix chains that loop, the duels leave holes in
the chains (docs/configuration.md says when to pick it).
"""

from __future__ import annotations

import sys
from collections import Counter, OrderedDict
from collections.abc import Iterable, Iterator
from itertools import chain, islice, repeat, takewhile
from operator import add, floordiv, gt

from kvoffload.index.base import IntegrityError
from kvoffload.index.policies.base import CanEvict, Policy, consume
from kvoffload.index.policies.clock import ClockPlan
from kvoffload.keys import OffloadKey

WINDOW_SHARE = 100
"""The window holds 1/WINDOW_SHARE of the capacity (at least one key), as in Caffeine."""
SAMPLE_PERIODS = 4
"""Distinct keys counted per sample period, in multiples of the capacity."""
MAX_COUNT = 15
"""A count above this reads as this, so that a once-hot key fades within a few periods."""




class TinyLFUPolicy(Policy):
    """Args: capacity: the most keys the tier holds (sizes the window and the sample period).

    Raises:
        ValueError: ``capacity`` is not positive.
    """

    __slots__ = ("_counts", "_main", "_main_target", "_old_counts", "_period_keys", "_resident", "_window",
                 "_window_target")

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"TinyLFUPolicy: capacity {capacity} must be positive")
        self._window_target = max(1, capacity // WINDOW_SHARE)
        self._main_target = max(0, capacity - self._window_target)
        self._period_keys = SAMPLE_PERIODS * capacity
        self._window: OrderedDict[OffloadKey, None] = OrderedDict()
        self._main: OrderedDict[OffloadKey, int] = OrderedDict()
        """Main key -> its count in this period when it joined or last came round (-1: it was used after that in
        the previous period, see ``_age``); used since means a higher count now."""
        self._resident: dict[OffloadKey, None] = {}
        """Window and main keys together."""
        self._counts: Counter[OffloadKey] = Counter()
        self._old_counts: dict[OffloadKey, int] = {}

    def frequency(self, key: OffloadKey) -> int:
        """The estimated frequency the duels compare (this period's count plus half the previous one's)."""
        return min(self._counts.get(key, 0), MAX_COUNT) + min(self._old_counts.get(key, 0), MAX_COUNT) // 2

    def insert(self, key: OffloadKey) -> None:
        counts = self._counts
        counts[key] = counts.get(key, 0) + 1  # not ``+= 1``: a Counter's __missing__ is a Python call
        if key in self._resident:
            return
        self._resident[key] = None
        window = self._window
        window[key] = None
        # While the main space has room, the window's oldest key moves on without a duel (as Caffeine's does on
        # every write), so that a tier that never evicted has its older keys in the main space too.
        if len(window) > self._window_target and len(self._main) < self._main_target:
            oldest = window.popitem(last=False)[0]
            self._main[oldest] = self._counts.get(oldest, 0)

    def insert_all(self, keys: Iterable[OffloadKey]) -> None:
        ks = list(keys)
        new = dict.fromkeys(ks)
        resident, window, main = self._resident, self._window, self._main
        if len(new) < len(ks) or not resident.keys().isdisjoint(new):
            for key in ks:
                self.insert(key)
            return
        # The common case, a store's new keys: the same counts, queues and moves on as one by one (each insert
        # moves at most one key on, once the window is full), with C-level updates.
        self._counts.update(ks)
        moves = min(max(0, len(ks) - max(0, self._window_target - len(window))),
                    max(0, self._main_target - len(main)))
        resident.update(new)
        window.update(new)
        oldest = list(islice(window, moves))
        consume(map(window.__delitem__, oldest))
        main.update(zip(oldest, map(self._counts.get, oldest, repeat(0)), strict=True))

    def touch(self, key: OffloadKey) -> None:
        counts = self._counts
        counts[key] = counts.get(key, 0) + 1

    def touch_all(self, keys: Iterable[OffloadKey]) -> None:
        self._counts.update(keys)

    def remove(self, key: OffloadKey) -> None:
        if key in self._resident:
            del self._resident[key]
            if key in self._window:
                del self._window[key]
            else:
                del self._main[key]

    def victims(self, n: int, can_evict: CanEvict) -> list[OffloadKey] | None:
        if n <= 0:
            return []
        if n > len(self._resident):
            return None
        duel = _Duel(self, can_evict)
        if not duel.run(n):
            return None  # nothing changed: the duel only planned
        window, resident = self._window, self._resident
        for key in duel.leave_window:
            del window[key]
        duel.main.apply(self._main, self._count)  # admitted keys join the main space, used ones go round
        for key in duel.chosen:
            del resident[key]
        if len(self._counts) >= self._period_keys:
            self._age()
        return duel.chosen

    def _count(self, key: OffloadKey) -> int:
        return self._counts.get(key, 0)

    def _age(self) -> None:
        """Start a sample period. Counts age here only (not in touch), so that a batch of uses counts as the same
        uses one by one; main keys' marks restart from the new period's zero: -1 for those used since they last
        came round (any count then reads as a use), 0 for the others. O(main keys), once per period."""
        old, main = self._counts, self._main
        self._old_counts, self._counts = old, Counter()
        for key, then in main.items():
            main[key] = -1 if old.get(key, 0) > then else 0

    def _used(self, keys: list[OffloadKey]) -> list[bool]:
        """For main keys, whether each one's count grew since it joined or last came round (at C speed). Keys that
        join during a duel are not in the main space yet: they read as unused (their use is spent anyway)."""
        return list(map(gt, map(self._counts.get, keys, repeat(0)), map(self._main.get, keys, repeat(sys.maxsize))))

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
    changes nothing). Refused keys are passed over and keep their place; a refused window key also stops the flow
    out of the window for the call, so that younger keys do not pass it into the main space."""

    __slots__ = ("can_evict", "chosen", "leave_window", "main", "main_left", "policy", "window", "window_closed",
                 "window_left")

    def __init__(self, policy: TinyLFUPolicy, can_evict: CanEvict) -> None:
        self.policy = policy
        self.can_evict = can_evict
        self.window: Iterator[OffloadKey] = iter(policy._window)
        self.main = ClockPlan(policy._main, policy._used, can_evict)
        self.window_left = len(policy._window)
        self.main_left = len(policy._main)
        self.chosen: list[OffloadKey] = []
        self.leave_window: list[OffloadKey] = []
        self.window_closed = False

    def run(self, n: int) -> bool:
        """Plan until ``n`` keys are chosen; False when there are not enough that may go."""
        chosen, target = self.chosen, self.policy._window_target
        while len(chosen) < n:
            # The keys about to be inserted enter the window: its oldest leave while it would overflow. While each
            # leaves for good, the overflow shrinks by two per candidate (one fewer in the window, one fewer to go).
            overflow = self.window_left + n - len(chosen) - target
            candidates = self._candidates(min(n - len(chosen), (overflow + 1) // 2)) if overflow > 0 else []
            if not candidates:
                if not self._evict(n - len(chosen)):
                    return False
                continue
            self.window_left -= len(candidates)
            self.leave_window += candidates
            if not self._all_lose(candidates):
                for candidate in candidates:
                    self._duel(candidate)
            else:
                chosen += candidates
        return True

    def _candidates(self, k: int) -> list[OffloadKey]:
        """The window's next ``k`` oldest keys, up to the first one refused (which closes the window)."""
        if self.window_closed:
            return []
        keys = list(islice(self.window, k))
        allowed = list(takewhile(self.can_evict, keys))
        if len(allowed) < len(keys):
            self.window_closed = True
            # The keys after the refused one may still be evicted outright (``_evict_one``).
            self.window = chain(keys[len(allowed) + 1:], self.window)
        return allowed

    def _all_lose(self, candidates: list[OffloadKey]) -> bool:
        """Whether the main space is full and no candidate is used more than its next victim (the common case,
        checked at C speed): then every candidate is evicted and the victim stays."""
        policy = self.policy
        if self.main_left < policy._main_target:
            return False
        victim = self.main.peek()
        if victim is None:
            return True
        counts = map(min, map(policy._counts.get, candidates, repeat(0)), repeat(MAX_COUNT))
        old = map(min, map(policy._old_counts.get, candidates, repeat(0)), repeat(MAX_COUNT))
        return max(map(add, counts, map(floordiv, old, repeat(2)))) <= policy.frequency(victim)

    def _duel(self, candidate: OffloadKey) -> None:
        """The candidate joins the main space if it has room or the candidate is used more than its next
        victim (which then goes); else the candidate goes."""
        policy = self.policy
        if self.main_left < policy._main_target:
            self._admit(candidate)
            return
        victim = self.main.peek()
        if victim is not None and policy.frequency(candidate) > policy.frequency(victim):
            self._admit(candidate)
        else:
            self.chosen.append(candidate)

    def _admit(self, candidate: OffloadKey) -> None:
        """The candidate joins the main space; if the main space is full, its victim goes."""
        if self.main_left >= self.policy._main_target:
            victim = self.main.take()
            assert victim is not None  # the duel peeked it
            self.chosen.append(victim)
            self.main_left -= 1
        self.main.join(candidate)
        self.main_left += 1

    def _evict(self, k: int) -> bool:
        """Evict up to ``k`` of the main space's next victims, else the window's next key that may go; False when
        neither has one."""
        taken = self.main.take_many(k)
        if taken:
            self.main_left -= len(taken)
            self.chosen += taken
            return True
        for key in self.window:
            if self.can_evict(key):
                self.window_left -= 1
                self.leave_window.append(key)
                self.chosen.append(key)
                return True
        return False
