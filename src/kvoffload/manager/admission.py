"""Store admission: which of the full blocks a request would store the connector actually stores.

Storing a block costs device-to-host bandwidth and a tier slot that another block then loses; on production chat
traffic most blocks are never read again (three out of four on the Mooncake conversation trace). An admission
rule sees, per request, the keys of the blocks it would store, in prefix order, and says how many leading ones to
store: a block is useless without the blocks before it, so the admitted part is always a prefix. Declined blocks
are not stored now; a later request with the same prefix offers them again.

The scheduler half asks once per block and request (``ConnectorScheduler``), and ``kvoffload replay`` asks with
the blocks a request missed, through ``make_admission``. Rules are not thread-safe (the scheduler half calls them
from one thread).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from itertools import takewhile

from kvoffload.config import StoreAdmission
from kvoffload.keys import OffloadKey
from kvoffload.manager.policies.base import consume

SIGHTING_MEMORY = 4
"""``SecondSighting`` remembers this many times the tier's capacity in keys. It must outlast the tier: only a
fraction of the keys it sees are admitted, so a block's second sighting comes long after the tier turned over
(on the conversation trace at 3M tokens, LRU behind a memory of 1, 2, 4 and 8 times the capacity reaches 0.38,
0.48, 0.50 and 0.51 of the offline optimum). Each remembered key costs about 100 bytes, against a slot's
kilobytes to megabytes of KV."""


class Admission(ABC):
    """Decides how many leading blocks of a request's store to keep."""

    __slots__ = ()

    @abstractmethod
    def admit(self, keys: Sequence[OffloadKey]) -> int:
        """Record that ``keys`` were offered for storing and say how many leading ones to store.

        Args:
            keys: the blocks one request would store now, in prefix order (each key's parent precedes it or was
                offered before).
        Returns:
            A count from 0 to ``len(keys)``: store ``keys[:count]``, decline the rest.
        """


class AdmitAll(Admission):
    """Stores every block."""

    __slots__ = ()

    def admit(self, keys: Sequence[OffloadKey]) -> int:
        return len(keys)


class SecondSighting(Admission):
    """Stores a block the second time its key is offered: a block computed once and never again is not stored.

    The memory is the most recently offered ``limit`` keys (an offered key becomes the most recent, admitted or
    not), so it is bounded, and a key seen again within it is admitted. Costs O(len(keys)) per call.

    Args:
        limit: how many keys to remember.
    Raises:
        ValueError: ``limit`` is not positive.
    """

    __slots__ = ("_limit", "_seen")

    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ValueError(f"SecondSighting: limit {limit} must be positive")
        self._limit = limit
        self._seen: OrderedDict[OffloadKey, None] = OrderedDict()

    def admit(self, keys: Sequence[OffloadKey]) -> int:
        seen = self._seen
        count = len(list(takewhile(seen.__contains__, keys)))
        seen.update(dict.fromkeys(keys))
        consume(map(seen.move_to_end, keys))
        for _ in range(len(seen) - self._limit):
            seen.popitem(last=False)
        return count

    def __len__(self) -> int:
        """How many keys are remembered."""
        return len(self._seen)


def make_admission(kind: StoreAdmission, capacity_blocks: int) -> Admission:
    """The rule ``kind`` names, for a tier of ``capacity_blocks`` blocks (``SecondSighting`` remembers
    ``SIGHTING_MEMORY * capacity_blocks`` keys).

    Raises:
        ValueError: ``capacity_blocks`` is not positive, or ``kind`` is not a known rule.
    """
    if isinstance(capacity_blocks, bool) or not isinstance(capacity_blocks, int) or capacity_blocks <= 0:
        raise ValueError(f"make_admission: capacity {capacity_blocks!r} blocks must be a positive integer")
    if kind is StoreAdmission.ALL:
        return AdmitAll()
    if kind is StoreAdmission.SECOND_SIGHTING:
        return SecondSighting(SIGHTING_MEMORY * capacity_blocks)
    raise ValueError(f"make_admission: unknown store admission {kind!r}")
