"""Scheduler side of the remote tier: which values a Redis-protocol store holds, and this engine's budget there.

The lower tier of ``TieredIndex`` when ``remote_url`` is set (host RAM stays the hub: values move only to and
from the host pool, in the workers' ``RemoteHandler``). Unlike the disk tier, this index cannot know what the tier
holds: the server evicts on its own (``maxmemory`` with an LRU policy), a TTL may expire values, and other engines
write and delete there. ``tiers.lower.probed_index.ProbedIndex`` says how such an index works; here its probe asks
the server with ``EXISTS`` (``RemoteProbe``) and deletes with ``DEL``. A value two engines wrote at once (``SET NX``
keeps one) is in both budgets.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvoffload.blocks import Medium, TierBlocks
from kvoffload.config import ConfigError, EvictionPolicy, RemoteTierConfig
from kvoffload.index.policies.base import Policy
from kvoffload.index.tenants import PolicyOf, no_tenants
from kvoffload.keys import Namespace, OffloadKey
from kvoffload.tiers.lower.block_format import BlockFormat
from kvoffload.tiers.lower.breaker import CircuitBreaker
from kvoffload.tiers.lower.probed_index import LOOKUP_CACHE_S, ProbedIndex
from kvoffload.tiers.remote.client import connect
from kvoffload.tiers.remote.probe import RemoteProbe, ValueNames

logger = logging.getLogger(__name__)


def remote_blocks(keys: Sequence[OffloadKey], slots: Sequence[int]) -> TierBlocks:
    """The remote tier's spec: values named by key, one group (the logical slots stay in the index)."""
    return TierBlocks(Medium.REMOTE, keys=tuple(keys), group_sizes=(len(keys),))


class RemoteIndex(ProbedIndex):
    """Index of the remote tier: the server's answers, and this engine's own values.

    Args:
        probe: asks the server.
        capacity_blocks: how many values this engine may have written there at once.
        policy: eviction policy among this engine's ready, unpinned values.
        cache_s: how long an answer is trusted (0: ask every time).
        clock: monotonic seconds.
    Raises:
        ValueError: ``capacity_blocks`` is not positive.
    """

    def __init__(self, probe: RemoteProbe, capacity_blocks: int, policy: EvictionPolicy | Policy = EvictionPolicy.LRU,
                 cache_s: float = LOOKUP_CACHE_S, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(probe, capacity_blocks, Medium.REMOTE, remote_blocks, policy, cache_s, clock)
        self.probe: RemoteProbe = probe

    @classmethod
    def create(cls, config: RemoteTierConfig, namespace: Namespace, value_bytes: int,
               policy: PolicyOf = no_tenants, *,
               client: Any | None = None) -> RemoteIndex:
        """The scheduler's remote index; one ``PING`` tells whether the server is there (if not: misses for now).

        Args:
            value_bytes: size of one value (the disk tier's block encoding of the largest group's entry).
            client: a redis-py client to use (tests); None: ``tiers.remote.client.connect(config)``.
        Raises:
            ConfigError: ``remote_bytes`` is below one value.
        """
        capacity = config.capacity_bytes // value_bytes
        if capacity < 1:
            raise ConfigError(f"remote_bytes={config.capacity_bytes} is below one value ({value_bytes} bytes)")
        names = ValueNames(namespace, BlockFormat.of(config.secret))
        breaker = CircuitBreaker(config.breaker_errors, config.breaker_cooldown_s, tier="remote tier (scheduler)")
        probe = RemoteProbe((lambda: client) if client is not None else (lambda: connect(config)), names,
                            cluster=config.cluster, timeout_s=config.timeout_s, breaker=breaker,
                            connect_timeout_s=config.connect_timeout_s)
        if not probe.check():
            logger.warning("remote tier (scheduler): %s does not answer; lookups are misses until it is asked "
                           "again in %.0f s", ", ".join(config.urls), config.breaker_cooldown_s)
        logger.info("remote tier: this engine may keep %d values of %d bytes per rank on %s", capacity, value_bytes,
                    ", ".join(config.urls))
        return cls(probe, capacity, policy(config.policy, capacity, "remote"))
