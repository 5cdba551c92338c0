"""The adaptive policy: one of the fixed policies at a time, switched to whichever the traffic rewards.

``AdaptivePolicy`` orders keys with a live expert (LRU, ARC, S3-FIFO or W-TinyLFU) and does nothing else itself: the
choice is made by ``AdaptiveAdmission`` (index/admission.py), whose shadow tiers replay each request under every
expert and which calls ``follow`` when another expert has led for a while. Every call is forwarded to the live
expert, so its costs are that expert's (LRU's, until the traffic rewards another).

A switch hands the resident keys to the new expert in the old one's eviction order (next to go first), so the
order carries over and what the old expert learnt beyond it (ARC's ghosts, TinyLFU's counts) starts afresh.
Without steering (a tier the shadows do not model, such as a disk tier under host) it stays LRU.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kvoffload.config import EvictionPolicy
from kvoffload.index.policies.base import CanEvict, Policy, any_key
from kvoffload.keys import OffloadKey

EXPERTS = (EvictionPolicy.LRU, EvictionPolicy.ARC, EvictionPolicy.S3FIFO, EvictionPolicy.TINYLFU)
"""The fixed policies the adaptive one chooses among; the first is where it starts. LRU, because until the shadows
have seen a tier's worth of traffic nothing says another would do better, and on short traces of our own (the demo's
conversations) starting on a scan-resistant policy costs hits that no later switch gets back."""


class AdaptivePolicy(Policy):
    """Forwards to the live expert; ``follow`` switches it.

    Args:
        build: makes a fresh expert of a kind, for this tier's capacity.
    """

    __slots__ = ("_build", "_kind", "_live", "switches")

    def __init__(self, build: Callable[[EvictionPolicy], Policy]) -> None:
        self._build = build
        self._kind = EXPERTS[0]
        self._live = build(self._kind)
        self.switches = 0
        """How many times the live expert changed."""

    @property
    def live(self) -> EvictionPolicy:
        """The expert ordering the keys now."""
        return self._kind

    def follow(self, kind: EvictionPolicy) -> None:
        """Order the keys with ``kind`` from now on (nothing happens if it is live already). O(resident keys).

        Raises:
            ValueError: ``kind`` is not one of ``EXPERTS``.
        """
        if kind not in EXPERTS:
            raise ValueError(f"AdaptivePolicy: {kind.value} is not one of its experts")
        if kind is self._kind:
            return
        order = self._live.victims(len(self._live), any_key) or []
        live = self._build(kind)
        live.insert_all(order)
        self._kind, self._live = kind, live
        self.switches += 1

    def insert(self, key: OffloadKey) -> None:
        self._live.insert(key)

    def insert_all(self, keys: Iterable[OffloadKey]) -> None:
        self._live.insert_all(keys)

    def touch(self, key: OffloadKey) -> None:
        self._live.touch(key)

    def touch_all(self, keys: Iterable[OffloadKey]) -> None:
        self._live.touch_all(keys)

    def remove(self, key: OffloadKey) -> None:
        self._live.remove(key)

    def victims(self, n: int, can_evict: CanEvict) -> list[OffloadKey] | None:
        return self._live.victims(n, can_evict)

    def __contains__(self, key: object) -> bool:
        return key in self._live

    def __len__(self) -> int:
        return len(self._live)

    def check_integrity(self) -> None:
        self._live.check_integrity()
