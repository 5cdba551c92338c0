"""Belady's offline optimum as an eviction policy, so the bound runs through the same tier index and replay loop.

The policy reads the future from a ``NextUse`` table built in one backward pass over the trace: for every block
reference, the index of the next request that references the same key. It evicts the resident key whose next use is
farthest; between equal next uses, the deeper block (further along its prompt) first. With prefix chains an
ancestor's next use is never later than a descendant's (every request that uses a block uses its ancestors), so this
tie break keeps the cache prefix-closed: no block stays resident without its ancestors, and every resident block of
a request is a prefix hit. ``bypass`` adds the other half of the optimum: a missed block is not stored when every
resident block is used sooner than it.

Optimal for block hits (Belady with bypass is optimal for demand caching, and prefix closure makes each of its
hits a prefix hit); token hit rates can differ from the best possible by partial last blocks, which count fewer
tokens than full ones.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from kvoffload.index.policies.base import CanEvict, Policy
from kvoffload.keys import OffloadKey
from kvoffload.tools.replay.trace import Trace

NEVER = 1 << 40
"""The next use of a key that is never used again (later than any request index)."""


class NextUse(NamedTuple):
    """The future of a trace: per request, the next use of each of its blocks, and each key's depth."""

    after: tuple[tuple[int, ...], ...]
    """``after[i][j]``: the index of the next request after ``i`` that references block ``j`` of request ``i``, or
    ``NEVER``."""
    depth: dict[OffloadKey, int]
    """A key's position in its prompt (0 for the first block); the first seen for a key found at two depths."""


def next_uses(trace: Trace) -> NextUse:
    """Build the ``NextUse`` table of ``trace`` in one backward pass."""
    last: dict[OffloadKey, int] = {}
    after: list[tuple[int, ...]] = []
    get = last.get
    for index in range(len(trace.requests) - 1, -1, -1):
        keys = trace.requests[index].keys
        after.append(tuple([get(key, NEVER) for key in keys]))
        last.update(dict.fromkeys(keys, index))
    after.reverse()
    depth: dict[OffloadKey, int] = {}
    for request in trace.requests:
        for position, key in enumerate(request.keys):
            depth.setdefault(key, position)
    return NextUse(tuple(after), depth)


class OptimumPolicy(Policy):
    """Evicts the resident key used farthest in the future (an offline policy: the replay loop must call
    ``advance`` at the start of every request, before the index sees it).

    A max-heap of (priority, key) with lazy deletion: a key's entry is current when its priority matches
    ``_priority``; touching a key pushes a new entry and leaves the old one to be skipped.
    """

    __slots__ = ("_current", "_depth", "_heap", "_next", "_spread")

    def __init__(self, future: NextUse) -> None:
        self._depth = future.depth
        self._spread = max(future.depth.values(), default=0) + 1
        self._next: dict[OffloadKey, int] = {}
        """Each key's next use after the current request (only keys referenced so far)."""
        self._current: dict[OffloadKey, int] = {}
        """Resident keys and their current priority (larger is evicted first)."""
        self._heap: list[tuple[int, OffloadKey]] = []

    def advance(self, keys: Sequence[OffloadKey], after: Sequence[int]) -> None:
        """Request with blocks ``keys`` is next; ``after`` are their next uses (``NextUse.after`` of it).

        Resident keys of the request that the index will not touch (past the first miss, if the cache were not
        prefix-closed) get their new future here too.
        """
        self._next.update(zip(keys, after, strict=True))
        current = self._current
        for key in keys:
            if key in current:
                self._push(key)

    def bypass(self, keys: Sequence[OffloadKey], free_slots: int) -> int:
        """How many leading ``keys`` (missed blocks of the current request, in prompt order) to store.

        Storing them evicts as many resident blocks beyond ``free_slots``; a missed block whose priority is above
        all those victims' is worth less than any of them and is bypassed. Counts each bypass or eviction against
        the room needed, taking the larger priority each time (a new block on ties: bypassing it saves a store).
        """
        current = self._current
        new = [key for key in dict.fromkeys(keys) if key not in current]
        need = len(new) - free_slots
        if need <= 0:
            return len(keys)
        incoming = sorted((self._priority(key) for key in new), reverse=True)
        residents = self._peek_largest(need, set(keys))
        bypassed, evicted = 0, 0
        for _ in range(need):
            if bypassed < len(incoming) and (evicted >= len(residents) or incoming[bypassed] >= residents[evicted]):
                bypassed += 1
            else:
                evicted += 1
        if bypassed == 0:
            return len(keys)
        # The bypassed blocks are the ``bypassed`` largest priorities; store the keys before the first of them.
        cut = incoming[bypassed - 1]
        for count, key in enumerate(keys):
            if key not in current and self._priority(key) >= cut:
                return count
        return len(keys)

    def _peek_largest(self, n: int, excluded: set[OffloadKey]) -> list[int]:
        """The ``n`` largest priorities among resident keys not in ``excluded``, largest first; changes nothing."""
        heap, current = self._heap, self._current
        popped: list[tuple[int, OffloadKey]] = []
        found: list[int] = []
        seen: set[OffloadKey] = set()
        while heap and len(found) < n:
            entry = heapq.heappop(heap)
            popped.append(entry)
            priority, key = -entry[0], entry[1]
            if current.get(key) == priority and key not in excluded and key not in seen:
                seen.add(key)
                found.append(priority)
        for entry in popped:
            heapq.heappush(heap, entry)
        return found

    def _priority(self, key: OffloadKey) -> int:
        # One integer orders by next use, then depth: the deeper of two blocks used at the same time goes first.
        return self._next.get(key, NEVER) * self._spread + self._depth.get(key, 0)

    def _push(self, key: OffloadKey) -> None:
        priority = self._priority(key)
        self._current[key] = priority
        heapq.heappush(self._heap, (-priority, key))
        if len(self._heap) > 4 * len(self._current) + 1024:
            self._heap = [(-p, k) for k, p in self._current.items()]
            heapq.heapify(self._heap)

    def insert(self, key: OffloadKey) -> None:
        self._push(key)

    def insert_all(self, keys: Iterable[OffloadKey]) -> None:
        for key in keys:
            self._push(key)

    def touch(self, key: OffloadKey) -> None:
        if key in self._current:
            self._push(key)

    def remove(self, key: OffloadKey) -> None:
        self._current.pop(key, None)

    def victims(self, n: int, can_evict: CanEvict) -> list[OffloadKey] | None:
        if n <= 0:
            return []
        heap, current = self._heap, self._current
        chosen: list[tuple[int, OffloadKey]] = []
        refused: list[tuple[int, OffloadKey]] = []
        while heap and len(chosen) < n:
            entry = heapq.heappop(heap)
            key = entry[1]
            if current.get(key) != -entry[0]:
                continue  # stale: touched since, or gone
            if can_evict(key):
                chosen.append(entry)
                del current[key]
            else:
                refused.append(entry)
                del current[key]  # back below; keeps a refused key from being offered twice
        for entry in refused:
            current[entry[1]] = -entry[0]
            heapq.heappush(heap, entry)
        if len(chosen) < n:
            for entry in chosen:
                current[entry[1]] = -entry[0]
                heapq.heappush(heap, entry)
            return None
        return [key for _, key in chosen]

    def __contains__(self, key: object) -> bool:
        return key in self._current

    def __len__(self) -> int:
        return len(self._current)
