"""Least-recently-used eviction: one ordered dict, oldest use first."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from itertools import islice

from kvoffload.index.policies.base import CanEvict, Policy, consume
from kvoffload.keys import OffloadKey


class LRUPolicy(Policy):
    __slots__ = ("_order",)

    def __init__(self) -> None:
        self._order: OrderedDict[OffloadKey, None] = OrderedDict()

    def insert(self, key: OffloadKey) -> None:
        order = self._order
        if key in order:
            order.move_to_end(key)
        else:
            order[key] = None

    def insert_all(self, keys: Iterable[OffloadKey]) -> None:
        order = self._order
        for key in keys:
            if key in order:
                order.move_to_end(key)
            else:
                order[key] = None

    def touch(self, key: OffloadKey) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def touch_all(self, keys: Iterable[OffloadKey]) -> None:
        move, rest = self._order.move_to_end, iter(keys)
        try:
            consume(map(move, rest))
        except KeyError:
            # A key that is not resident (the failed move consumed it, and it needs nothing): from here on such
            # keys are filtered out, still without a Python step per key.
            consume(map(move, filter(self._order.__contains__, rest)))

    def remove(self, key: OffloadKey) -> None:
        self._order.pop(key, None)

    def victims(self, n: int, can_evict: CanEvict) -> list[OffloadKey] | None:
        if n <= 0:
            return []
        order = self._order
        chosen = list(islice(filter(can_evict, order), n))
        if len(chosen) < n:
            return None
        for key in chosen:
            del order[key]
        return chosen

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)
