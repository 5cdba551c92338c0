"""Every eviction policy by its configuration name: ``make_policy`` builds the one ``EvictionPolicy`` names.

Its own module, above the implementations, so that ``base`` (the interface they import) imports none of them.
"""

from __future__ import annotations

from kvoffload.config import EvictionPolicy
from kvoffload.index.policies.adaptive import AdaptivePolicy
from kvoffload.index.policies.arc import ARCPolicy
from kvoffload.index.policies.base import Policy
from kvoffload.index.policies.lru import LRUPolicy
from kvoffload.index.policies.s3fifo import S3FIFOPolicy
from kvoffload.index.policies.tinylfu import TinyLFUPolicy


def make_policy(kind: EvictionPolicy, capacity: int | None = None) -> Policy:
    """Build the policy ``kind`` names.

    Args:
        kind: which policy.
        capacity: the most keys the tier can hold. ARC bounds its history by it; without it, ARC uses the
            largest resident count it has seen. S3-FIFO and TinyLFU size their queues by it and need it, and so
            does the adaptive policy (its experts include them). LRU ignores it.
    Raises:
        ValueError: ``capacity`` is not positive, or missing where ``kind`` needs it, or ``kind`` is not a known
            policy.
    """
    if capacity is not None and capacity <= 0:
        raise ValueError(f"make_policy: capacity {capacity} must be positive")
    if kind is EvictionPolicy.LRU:
        return LRUPolicy()
    if kind is EvictionPolicy.ARC:
        return ARCPolicy(capacity)
    sized = {EvictionPolicy.S3FIFO: S3FIFOPolicy, EvictionPolicy.TINYLFU: TinyLFUPolicy,
             EvictionPolicy.ADAPTIVE: _adaptive}.get(kind)
    if sized is not None:
        if capacity is None:
            raise ValueError(f"make_policy: {kind.value} needs the tier's capacity")
        return sized(capacity)
    raise ValueError(f"make_policy: unknown eviction policy {kind!r}")


def _adaptive(capacity: int) -> Policy:
    return AdaptivePolicy(lambda expert: make_policy(expert, capacity))
