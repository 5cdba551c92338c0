"""Scheduler side of the object tier: which objects the bucket holds, and this engine's budget there.

The lower tier of ``TieredIndex`` when ``object_url`` is set (host RAM stays the hub: objects move only to and
from the host pool, in the workers' ``ObjectHandler``). Like the remote tier's, this index cannot know what the
bucket holds (lifecycle rules expire objects, other engines write and delete): ``tiers.lower.probed_index`` says
how such an index works. Here its probe searches a prompt's stored prefix with rounds of parallel
existence requests (``ObjectProbe``) and deletes with ``DeleteObjects``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvoffload.blocks import Medium, TierBlocks
from kvoffload.config import ConfigError, EvictionPolicy, ObjectTierConfig
from kvoffload.index.policies.base import Policy
from kvoffload.index.tenants import PolicyOf, no_tenants
from kvoffload.keys import Namespace, OffloadKey
from kvoffload.tiers.lower.block_format import BlockFormat
from kvoffload.tiers.lower.breaker import CircuitBreaker
from kvoffload.tiers.lower.probed_index import LOOKUP_CACHE_S, ProbedIndex
from kvoffload.tiers.object.client import ObjectNames, connect, request_s, where_of
from kvoffload.tiers.object.probe import ObjectProbe

logger = logging.getLogger(__name__)


def object_blocks(keys: Sequence[OffloadKey], slots: Sequence[int]) -> TierBlocks:
    """The object tier's spec: objects named by key, one group (the logical slots stay in the index)."""
    return TierBlocks(Medium.OBJECT, keys=tuple(keys), group_sizes=(len(keys),))


class ObjectIndex(ProbedIndex):
    """Index of the object tier: the bucket's answers, and this engine's own objects.

    Args:
        probe: asks the bucket.
        capacity_blocks: how many objects this engine may have written there at once.
        policy: eviction policy among this engine's ready, unpinned objects.
        cache_s: how long an answer is trusted (0: ask every time).
        clock: monotonic seconds.
    """

    def __init__(self, probe: ObjectProbe, capacity_blocks: int, policy: EvictionPolicy | Policy = EvictionPolicy.LRU,
                 cache_s: float = LOOKUP_CACHE_S, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(probe, capacity_blocks, Medium.OBJECT, object_blocks, policy, cache_s, clock)
        self.probe: ObjectProbe = probe

    @classmethod
    def create(cls, config: ObjectTierConfig, namespace: Namespace, object_bytes: int,
               policy: PolicyOf = no_tenants, *,
               client: Any | None = None) -> ObjectIndex:
        """The scheduler's object index; the start-up check (``ObjectProbe.check``) tells whether the store is there
        and is one (if not: misses).

        Args:
            object_bytes: size of one object (the shared block encoding of the largest group's entry).
            client: a boto3 S3 client to use (tests); None: ``tiers.object.client.connect(config)``.
        Raises:
            ConfigError: ``object_bytes`` (the setting) is below one object, or boto3 is missing.
        """
        capacity = config.capacity_bytes // object_bytes
        if capacity < 1:
            raise ConfigError(f"object_bytes={config.capacity_bytes} is below one object ({object_bytes} bytes)")
        names = ObjectNames(config, namespace, BlockFormat.of(config.secret))
        breaker = CircuitBreaker(config.breaker_errors, config.breaker_cooldown_s, tier="object tier (scheduler)")
        client = client if client is not None else connect(config, pool_size=config.lookup_fanout * names.copies)
        probe = ObjectProbe(client, config.bucket, names, fanout=config.lookup_fanout, timeout_s=config.timeout_s,
                            breaker=breaker, request_s=request_s(config), where=where_of(config))
        probe.check()
        logger.info("object tier: this engine may keep %d objects of %d bytes per rank in bucket %s", capacity,
                    object_bytes, config.bucket)
        return cls(probe, capacity, policy(config.policy, capacity, "object"))
