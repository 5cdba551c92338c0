"""A CLOCK queue's share of a ``victims`` call, planned before anything changes (S3-FIFO's main queue, TinyLFU's
main space).

A CLOCK is a FIFO whose oldest key goes unless it was used since it last came round; a used one gets another round
at the back, its use spent. ``ClockPlan`` reads the queue front to back, then the keys the plan sends to its back
(those given another round and those that join during the plan), so that a key that came round once is evictable on
its second visit. Keys that ``can_evict`` refuses are passed over and keep their place. Nothing changes until
``apply``: a ``victims`` call that cannot find enough keys drops its plans and changes nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from itertools import chain, islice
from typing import Any

from kvoffload.index.policies.base import CanEvict
from kvoffload.keys import OffloadKey


class ClockPlan:
    """Args: queue: the CLOCK, oldest first; used: for a list of its keys, whether each was used since it last
    came round (or joined), in one call so that a policy can answer at C speed; can_evict: the ``victims`` call's."""

    __slots__ = ("_back", "_can_evict", "_front", "_next", "_order", "_spent", "_used", "_visited_back", "taken")

    def __init__(self, queue: OrderedDict[OffloadKey, Any], used: Callable[[list[OffloadKey]], list[bool]],
                 can_evict: CanEvict) -> None:
        self._front: Iterator[OffloadKey] = iter(queue)
        self._used = used
        self._can_evict = can_evict
        self._back: list[OffloadKey] = []
        self._spent: set[OffloadKey] = set()
        self._visited_back = 0
        self._next: OffloadKey | None = None
        self._order: Iterator[OffloadKey] = chain(self._front, self._back_keys())
        self.taken: list[OffloadKey] = []
        """The victims taken, in order."""

    def peek(self) -> OffloadKey | None:
        """The next victim, left in place until ``take``; None when the queue has no evictable key left."""
        while self._next is None:
            for key in self._order:
                if not self._can_evict(key):
                    continue
                if key not in self._spent and self._used([key])[0]:
                    self._spent.add(key)
                    self._back.append(key)
                    continue
                self._next = key
                break
            else:
                if not self._resume():
                    return None
        return self._next

    def take(self) -> OffloadKey | None:
        """Take the next victim (``peek``'s); None when there is none."""
        key = self.peek()
        if key is not None:
            self._next = None
            self.taken.append(key)
        return key

    def take_many(self, k: int) -> list[OffloadKey]:
        """Take up to ``k`` next victims (fewer when the queue runs out of evictable keys): ``take`` in a loop,
        at C speed while the keys met were not used (the store path evicts a batch per store)."""
        out: list[OffloadKey] = []
        if k > 0 and self._next is not None:
            out.append(self._next)
            self._next = None
        spent, back = self._spent, self._back
        while len(out) < k:
            batch = list(islice(filter(self._can_evict, self._order), k - len(out)))
            if not batch:
                if self._resume():
                    continue
                break
            used = self._used(batch)
            if not any(used):
                out += batch
                continue
            for key, was_used in zip(batch, used, strict=True):
                if was_used and key not in spent:
                    spent.add(key)
                    back.append(key)
                else:
                    out.append(key)
        self.taken += out
        return out

    def join(self, key: OffloadKey) -> None:
        """``key`` joins the queue's back during the plan (it counts as having come round: its use is spent)."""
        self._spent.add(key)
        self._back.append(key)

    def apply(self, queue: OrderedDict[OffloadKey, Any], value: Callable[[OffloadKey], Any]) -> None:
        """Carry the plan out on ``queue``: taken keys leave, keys sent to the back go there in order with
        ``value(key)`` as their value. Taken keys that joined during the plan are not added."""
        taken = set(self.taken)
        for key in self.taken:
            queue.pop(key, None)
        for key in self._back:
            if key not in taken:
                queue[key] = value(key)
                queue.move_to_end(key)

    def _resume(self) -> bool:
        """The keys to visit ran out: go on with keys sent to the back since (False when there are none)."""
        if self._visited_back == len(self._back):
            return False
        self._order = self._back_keys()
        return True

    def _back_keys(self) -> Iterator[OffloadKey]:
        back = self._back
        while self._visited_back < len(back):
            self._visited_back += 1
            yield back[self._visited_back - 1]
