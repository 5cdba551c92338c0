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
dictionary update); a key moving from S to M spends its use. As in every policy here, a key that ``can_evict``
refuses keeps its place and its use bit, and ``remove`` forgets a key without remembering it in G.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator
from itertools import repeat

from kvoffload.keys import OffloadKey
from kvoffload.manager.base import IntegrityError
from kvoffload.manager.policies.base import CanEvict, Policy

SMALL_SHARE = 10
"""S's share of the tier: victims come from S while it holds at least 1/SMALL_SHARE of the capacity."""

_Queue = OrderedDict[OffloadKey, None]


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
        # Every resident key -> whether it was used since it entered its queue or last came round in M: one
        # dict answers both "resident?" and "used?", at C speed for a batch of uses.
        self._used: dict[OffloadKey, bool] = {}

    def insert(self, key: OffloadKey) -> None:
        used = self._used
        if key in used:
            used[key] = True
            return
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = None
        else:
            self._small[key] = None
        used[key] = False

    def touch(self, key: OffloadKey) -> None:
        if key in self._used:
            self._used[key] = True

    def touch_all(self, keys: Iterable[OffloadKey]) -> None:
        used = self._used
        used.update(zip(filter(used.__contains__, keys), repeat(True)))

    def remove(self, key: OffloadKey) -> None:
        if self._used.pop(key, None) is None:
            return
        if key in self._small:
            del self._small[key]
        else:
            del self._main[key]

    def victims(self, n: int, can_evict: CanEvict) -> list[OffloadKey] | None:
        if n <= 0:
            return []
        if n > len(self._used):
            return None
        sweep = _Sweep(self, can_evict)
        while len(sweep.chosen) < n:
            from_small = sweep.small_left >= self._small_target
            if not (sweep.step_small() if from_small else sweep.step_main()) and \
                    not (sweep.step_main() if from_small else sweep.step_small()):
                return None  # nothing changed: the sweep only planned
        self._apply(sweep)
        return sweep.chosen

    def _apply(self, sweep: _Sweep) -> None:
        small, main, used, ghost = self._small, self._main, self._used, self._ghost
        for key in sweep.chosen:
            del used[key]
            if key in sweep.evicted_small:
                del small[key]
                ghost[key] = None
            else:
                main.pop(key, None)  # a key promoted from S in this sweep and chosen in M is in neither yet
        for key in sweep.promoted:
            small.pop(key, None)
        for key in sweep.back:  # another round, or promoted: to M's back, use spent
            if key in used:
                used[key] = False
                main[key] = None
                main.move_to_end(key)
        for _ in range(len(ghost) - self._capacity):
            ghost.popitem(last=False)

    def __contains__(self, key: object) -> bool:
        return key in self._used

    def __len__(self) -> int:
        return len(self._used)

    def check_integrity(self) -> None:
        small, main, ghost = self._small.keys(), self._main.keys(), self._ghost.keys()
        if small & main or len(small) + len(main) != len(self._used) or not self._used.keys() >= small | main:
            raise IntegrityError(f"S3-FIFO: S ({len(small)}) and M ({len(main)}) are not a partition of the "
                                 f"{len(self._used)} resident keys")
        if ghost & self._used.keys() or len(ghost) > self._capacity:
            raise IntegrityError(f"S3-FIFO: the ghost queue ({len(ghost)} keys) holds resident keys or exceeds "
                                 f"the capacity {self._capacity}")


class _Sweep:
    """One ``victims`` call, planned before anything changes (so that a call that cannot find enough victims
    changes nothing): which keys go, which move from S to M and which get another round in M.

    S is read front to back once. M is read front to back, then the keys the plan sends to its back, in order: a
    key that came round once (use spent) is evictable on its second visit. Refused keys are passed over and keep
    their place.
    """

    __slots__ = ("back", "can_evict", "chosen", "evicted_small", "main", "promoted", "small", "small_left",
                 "spent", "used", "visited_back")

    def __init__(self, policy: S3FIFOPolicy, can_evict: CanEvict) -> None:
        self.can_evict = can_evict
        self.used = policy._used
        self.small: Iterator[OffloadKey] = iter(policy._small)
        self.main: Iterator[OffloadKey] = iter(policy._main)
        self.small_left = len(policy._small)
        self.chosen: list[OffloadKey] = []
        self.evicted_small: set[OffloadKey] = set()
        self.promoted: list[OffloadKey] = []
        self.back: list[OffloadKey] = []
        self.spent: set[OffloadKey] = set()
        self.visited_back = 0

    def step_small(self) -> bool:
        """Take S's next evictable key: to M if used, else a victim. False when S has none left."""
        for key in self.small:
            if not self.can_evict(key):
                continue
            self.small_left -= 1
            if self.used[key]:
                self.promoted.append(key)
                self._send_back(key)
            else:
                self.chosen.append(key)
                self.evicted_small.add(key)
            return True
        return False

    def step_main(self) -> bool:
        """Visit M's next evictable key: another round if used, else a victim. False when M has none left."""
        for key in self._main_order():
            if not self.can_evict(key):
                continue
            if self.used[key] and key not in self.spent:
                self._send_back(key)
            else:
                self.chosen.append(key)
            return True
        return False

    def _main_order(self) -> Iterator[OffloadKey]:
        yield from self.main
        back = self.back
        while self.visited_back < len(back):
            self.visited_back += 1
            yield back[self.visited_back - 1]

    def _send_back(self, key: OffloadKey) -> None:
        self.spent.add(key)
        self.back.append(key)
