"""Adaptive Replacement Cache (Megiddo and Modha, FAST 2003), adapted to tiers that reserve room first.

Resident keys live in T1 (used once since they arrived) or T2 (used again). Evicted keys are remembered,
without their data, in the ghost lists B1 and B2. A key that comes back while still remembered says which
list was too short: back from B1 grows the target size ``p`` of T1 (recency pays), back from B2 shrinks it
(frequency pays). A one-time scan therefore only churns T1 and leaves the frequently used keys in T2 alone.

Differences from the paper, because a tier's index reserves room before the data arrives: the choice of
victims (the paper's REPLACE) happens in ``victims``, separately from the insertion of the new key (which the
index makes when it reserves the key's room, the paper's miss), and it skips keys the index refuses (still in
flight, pinned by a load, part of the same store) without moving them. ``remove``
drops a key without remembering it: a key dropped because its load failed or because the tier was reset says
nothing about the policy.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator
from itertools import islice

from kvoffload.index.base import IntegrityError
from kvoffload.index.policies.base import CanEvict, Policy, consume
from kvoffload.keys import OffloadKey

_Keys = OrderedDict[OffloadKey, None]

_FAST_RUNS = 8
"""How many runs of T2 keys one ``touch_all`` moves at C speed before going key by key for the rest."""


class ARCPolicy(Policy):
    __slots__ = ("_b1", "_b2", "_capacity", "_p", "_seen_max", "_t1", "_t2")

    def __init__(self, capacity: int | None = None) -> None:
        if capacity is not None and capacity <= 0:
            raise ValueError(f"ARCPolicy: capacity {capacity} must be positive")
        self._capacity = capacity
        self._seen_max = 0
        self._p = 0.0
        self._t1: _Keys = OrderedDict()
        self._t2: _Keys = OrderedDict()
        self._b1: _Keys = OrderedDict()
        self._b2: _Keys = OrderedDict()

    @property
    def target_recent(self) -> float:
        """The adaptive target size of T1 (``p`` in the paper)."""
        return self._p

    def insert(self, key: OffloadKey) -> None:
        t1, t2, b1, b2 = self._t1, self._t2, self._b1, self._b2
        if key in t1 or key in t2:
            self.touch(key)
        elif key in b1:
            self._p = min(self._limit(), self._p + max(len(b2) / len(b1), 1.0))
            del b1[key]
            t2[key] = None
        elif key in b2:
            self._p = max(0.0, self._p - max(len(b1) / len(b2), 1.0))
            del b2[key]
            t2[key] = None
        else:
            # Only a new key grows T1 + B1 and the total: only it can push the history past its bounds.
            t1[key] = None
            self._grown()

    def insert_all(self, keys: Iterable[OffloadKey]) -> None:
        # A store reserves room for a batch of new keys: trim the history once for a run of them, not once per
        # key. Any other key trims first: one by one, the new keys before it would have trimmed the history while
        # T1 was as long as it is now (a use shrinks T1, a key from the history may be trimmed away).
        t1, t2, b1, b2 = self._t1, self._t2, self._b1, self._b2
        grew = False
        for key in keys:
            if key in t1 or key in t2 or key in b1 or key in b2:
                if grew:
                    self._grown()
                    grew = False
                self.insert(key)
            else:
                t1[key] = None
                grew = True
        if grew:
            self._grown()

    def _grown(self) -> None:
        """New keys joined T1: follow the largest resident count, and trim the history to its bounds."""
        if self._capacity is None:
            self._seen_max = max(self._seen_max, len(self._t1) + len(self._t2))
        self._trim_history()

    def touch(self, key: OffloadKey) -> None:
        if key in self._t2:
            self._t2.move_to_end(key)
        elif key in self._t1:
            del self._t1[key]
            self._t2[key] = None

    def touch_all(self, keys: Iterable[OffloadKey]) -> None:
        # A prompt's shared prefix is used again and again, so its keys are in T2 and a run of them only moves
        # to T2's end: one C call per key. The first key that is not in T2 ends the run with a KeyError (the
        # failed move consumed it); from it, keys go one by one up to the next T2 key, which starts a new run.
        # The runs are capped so that keys alternating between T1 and T2 cost no more than the plain loop.
        move, rest = self._t2.move_to_end, iter(keys)
        for _ in range(_FAST_RUNS):
            try:
                consume(map(move, rest))
                return
            except KeyError as miss:
                self.touch(miss.args[0])
            if not self._touch_up_to_frequent(rest):
                return
        while self._touch_up_to_frequent(rest):
            pass

    def remove(self, key: OffloadKey) -> None:
        if key in self._t1:
            del self._t1[key]
        else:
            self._t2.pop(key, None)

    def victims(self, n: int, can_evict: CanEvict) -> list[OffloadKey] | None:
        if n <= 0:
            return []
        t1, t2 = self._t1, self._t2
        # The common case: one list is preferred for every pick (T1 stays above its target to the last, or is
        # at or below it from the first) and has ``n`` evictable keys: they are its first ones that may go,
        # found by a C-level scan. Otherwise the picks alternate or fall back, key by key.
        if len(t1) - n + 1 > self._p:
            chosen = list(islice(filter(can_evict, t1), n))
            if len(chosen) == n:
                return self._evict_from(chosen, t1, self._b1)
        elif len(t1) <= self._p:
            chosen = list(islice(filter(can_evict, t2), n))
            if len(chosen) == n:
                return self._evict_from(chosen, t2, self._b2)
        return self._victims_mixed(n, can_evict)

    def _victims_mixed(self, n: int, can_evict: CanEvict) -> list[OffloadKey] | None:
        """``victims`` where the picks may come from both lists."""
        recent = _candidates(self._t1, can_evict)
        frequent = _candidates(self._t2, can_evict)
        from_t1: list[OffloadKey] = []
        from_t2: list[OffloadKey] = []
        while len(from_t1) + len(from_t2) < n:
            # The paper's REPLACE: take from T1 while it is above its target, else from T2; fall back to the
            # other list when the preferred one has nothing evictable left.
            prefer_t1 = len(self._t1) - len(from_t1) > self._p
            first, second = (recent, frequent) if prefer_t1 else (frequent, recent)
            key = next(first, None)
            if key is not None:
                (from_t1 if prefer_t1 else from_t2).append(key)
                continue
            key = next(second, None)
            if key is None:
                return None
            (from_t2 if prefer_t1 else from_t1).append(key)
        self._forget(from_t1, self._t1, self._b1)
        self._forget(from_t2, self._t2, self._b2)
        self._trim_history()
        return from_t1 + from_t2

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def check_integrity(self) -> None:
        lists = (self._t1, self._t2, self._b1, self._b2)
        sizes = [len(keys) for keys in lists]
        if len(set().union(*lists)) != sum(sizes):
            raise IntegrityError(f"ARC: a key is in two of T1, T2, B1, B2 (sizes {sizes})")
        c = self._limit()
        if len(self._t1) + len(self._b1) > max(c, len(self._t1)) or sum(sizes) > 2 * max(c, len(self)):
            raise IntegrityError(f"ARC: history exceeds capacity {c} (T1, T2, B1, B2 sizes {sizes})")
        if not 0.0 <= self._p <= c:
            raise IntegrityError(f"ARC: target size of T1 {self._p} is outside [0, {c}]")

    def _limit(self) -> int:
        return self._capacity if self._capacity is not None else max(self._seen_max, 1)

    def _evict_from(self, keys: list[OffloadKey], resident: _Keys, history: _Keys) -> list[OffloadKey]:
        """Evict ``keys`` from one resident list into its history; returns them."""
        self._forget(keys, resident, history)
        self._trim_history()
        return keys

    @staticmethod
    def _forget(keys: list[OffloadKey], resident: _Keys, history: _Keys) -> None:
        for key in keys:
            del resident[key]
            history[key] = None

    def _touch_up_to_frequent(self, keys: Iterator[OffloadKey]) -> bool:
        """Touch ``keys`` one by one up to the first already in T2 (included); False when they ran out first."""
        t1, t2 = self._t1, self._t2
        for key in keys:
            if key in t2:
                t2.move_to_end(key)
                return True
            if key in t1:
                del t1[key]
                t2[key] = None
        return False

    def _trim_history(self) -> None:
        # The paper's bounds: |T1| + |B1| <= c and |T1| + |T2| + |B1| + |B2| <= 2c (oldest ghosts go first).
        c = self._limit()
        t1, b1, b2 = self._t1, self._b1, self._b2
        for _ in range(min(len(b1), len(t1) + len(b1) - c)):
            b1.popitem(last=False)
        for _ in range(min(len(b1) + len(b2), len(t1) + len(self._t2) + len(b1) + len(b2) - 2 * c)):
            (b2 or b1).popitem(last=False)


def _candidates(keys: _Keys, can_evict: CanEvict) -> Iterator[OffloadKey]:
    return (key for key in keys if can_evict(key))
