"""The eviction-policy interface: which resident keys a tier gives up first when it needs room.

A policy only orders keys; it knows nothing of slots, pins or in-flight stores. The tier's index inserts a
key when a store reserves room for it, touches it when it is used, removes it when it is dropped for another
reason (failed store or load, reset), and asks for victims when a store needs room. Keys that must not go now
(still in flight, pinned by a load, part of the store being prepared) are refused through ``victims``'
``can_evict`` and keep their place in the order.

Policies are not thread-safe (the scheduler half calls its indexes from one thread).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterable, Sequence

from kvoffload.keys import OffloadKey

CanEvict = Callable[[OffloadKey], bool]
"""Says whether a resident key may be evicted right now."""

consume: Callable[[Iterable[object]], None] = deque[object](maxlen=0).extend
"""Run an iterator to its end, discarding what it yields: ``consume(map(od.move_to_end, keys))`` is a loop of C
calls with no Python step per key (a prompt's touch is thousands of keys, every scheduler step)."""


def counting(can_evict: CanEvict, allowed: set[OffloadKey]) -> CanEvict:
    """``can_evict``, remembering the keys it allowed (a policy that cannot give a run has offered every key it may
    give: the caller then knows how many it can)."""
    def check(key: OffloadKey) -> bool:
        if can_evict(key):
            allowed.add(key)
            return True
        return False
    return check


def any_key(_: OffloadKey) -> bool:
    """A ``CanEvict`` that refuses nothing (for tiers of keys only, where nothing is in flight or pinned)."""
    return True


class Policy(ABC):
    """Orders a tier's resident keys for eviction. Every method is O(1) amortized except ``victims``.

    Whatever else a policy weighs, keys a fresh policy only had inserted (never used) leave in insertion order,
    and a refused key stays first in line. ``kvoffload.testing.policy_conformance`` checks these rules and those
    of each method below.
    """

    __slots__ = ()

    @abstractmethod
    def insert(self, key: OffloadKey) -> None:
        """Make ``key`` resident (a store reserved room for it). Inserting a resident key counts as a use.

        Args:
            key: the key to track.
        """

    def insert_all(self, keys: Iterable[OffloadKey]) -> None:
        """``insert`` each key in turn (policies may do their bookkeeping once for the batch)."""
        for key in keys:
            self.insert(key)

    @abstractmethod
    def touch(self, key: OffloadKey) -> None:
        """Record a use of ``key``. A key that is not resident stays so (a policy may remember the use: TinyLFU
        counts every use, as its sketch does).

        Args:
            key: the key that was used (looked up and loaded).
        """

    def touch_all(self, keys: Iterable[OffloadKey]) -> None:
        """``touch`` each key in turn (policies may do it without a Python call per key)."""
        for key in keys:
            self.touch(key)

    @abstractmethod
    def remove(self, key: OffloadKey) -> None:
        """Stop tracking ``key`` without treating it as evicted (no history is kept for it).

        Args:
            key: the key dropped by its tier; a key that is not resident is ignored.
        """

    @abstractmethod
    def victims(self, n: int, can_evict: CanEvict) -> list[OffloadKey] | None:
        """Choose and remove ``n`` resident keys to evict, skipping those ``can_evict`` refuses.

        Atomic: either exactly ``n`` keys are chosen and stop being resident, or nothing changes.
        Cost: O(n + keys skipped).

        Args:
            n: how many keys to evict (0 returns an empty list).
            can_evict: called on candidates in eviction order; False keeps a key resident, in its place.
        Returns:
            The evicted keys in eviction order, or None when fewer than ``n`` resident keys may be evicted.
        """

    @abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is resident (history such as ARC's ghost lists does not count)."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of resident keys."""

    def entering(self, keys: Sequence[OffloadKey]) -> None:  # noqa: B027 (optional hook)
        """The keys new to the tier that the store about to ask for ``victims`` makes room for. Tenants' shares
        (``index/tenants.py``) count them for whoever stores; other policies ignore it."""

    def check_integrity(self) -> None:  # noqa: B027 (optional hook: most policies have nothing to check)
        """Check the policy's own invariants (the tier's index's ``check_integrity`` calls it).

        Raises:
            IntegrityError: the policy's bookkeeping is inconsistent.
        """
