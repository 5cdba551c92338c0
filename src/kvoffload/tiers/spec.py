"""``TierSpec`` and ``HostSpec``: what binds one tier, from its configuration section to both halves.

vLLM binds the two halves of one medium in one ``OffloadingSpec``; this is ours. A spec is made from one
configuration section (``DiskTierConfig``, ``RemoteTierConfig``, a ``PluginTierConfig``'s options) and makes:

- ``make_index``, in the scheduler process: the tier's index (a ``LowerIndex``, ``index/base.py``), which decides
  what the tier holds;
- ``make_handler``, in each worker process: the tier's ``TransferHandler``, which moves the bytes between the host
  pool and the tier as the index's jobs say;
- ``routes``: the copy directions its handler serves (host -> tier and tier -> host).

The host tier has a spec of its own shape (``HostSpec``): private (``tiers/host``) or the node pool
(``tiers/node``). It makes the host index, each worker's host pool and the device<->host handler, and guards every
handler that reads or writes the pool's slots.

A spec module imports its index and its handler only inside these methods, so neither half loads the other's code
(the scheduler half never loads torch). ``tiers.stack`` assembles every configured tier, in one place, for both
halves.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvoffload.blocks import Medium
from kvoffload.config import EvictionPolicy, OffloadConfig, WritePolicy
from kvoffload.keys import Namespace
from kvoffload.tiers.sizing import GroupedLayout, entry_bytes_of

if TYPE_CHECKING:
    from kvoffload.canonical import CanonicalKV
    from kvoffload.index.base import HostIndex, LowerIndex
    from kvoffload.index.policies.base import Policy
    from kvoffload.index.retention import RetentionBook
    from kvoffload.index.tenants import TenantBook
    from kvoffload.transfer.base import TransferHandler
    from kvoffload.transfer.host_pool import HostPool


@dataclass(frozen=True)
class TierContext:
    """What a tier is made for: one engine's KV layout, its offload block size and this rank's namespace."""

    namespace: Namespace
    layout: GroupedLayout
    factor: int
    """Engine blocks per offload block."""
    tenants: TenantBook | None = None
    """The scheduler half's tenants' book, shared by every tier's index (None: tenants off, or a worker)."""
    retention: RetentionBook | None = None
    """The scheduler half's retention deadlines, shared by every tier's index (None: hints off, or a worker)."""

    def policy(self, kind: EvictionPolicy, capacity: int, tier: str) -> EvictionPolicy | Policy:
        """The eviction policy of a tier of ``capacity`` blocks named ``tier`` in figures: ``kind``, per tenant
        when tenants are on (docs/tenants.md), around retained keys when hints are on (docs/sessions.md); what a
        ``SlotIndex`` takes."""
        from kvoffload.index.tier_policies import tier_policy

        return tier_policy(self.tenants, self.retention, kind, capacity, tier)

    @property
    def entry_bytes(self) -> tuple[int, ...]:
        """Payload bytes of one offload block of each KV-cache group (what one tier entry holds)."""
        return entry_bytes_of(self.layout, self.factor)


class TierSpec(ABC):
    """One tier under host, bound: its medium, how blocks reach it, and both halves' parts.

    Both halves make the same specs from the same configuration, so they agree on every tier's medium and size.
    ``make_index`` and ``make_handler`` raise ``ConfigError`` for a tier that cannot be used as configured (a bad
    path, a missing package); never for a data-path failure, which the index and handler turn into misses.
    """

    @property
    @abstractmethod
    def medium(self) -> Medium:
        """The tier's medium: distinct for every tier of one stack."""

    @property
    def write_policy(self) -> WritePolicy:
        """When blocks are written to the tier: write-through (default) or on evict from host."""
        return WritePolicy.WRITE_THROUGH

    @property
    def shared_by_ranks(self) -> bool:
        """Whether the ranks of a replicated namespace share one copy here (then only rank 0 writes it); False for a
        tier each worker keeps in its own process."""
        return False

    @abstractmethod
    def make_index(self, context: TierContext) -> LowerIndex:
        """The scheduler side: the tier's index (what it holds), rebuilt from what the tier already holds."""

    @abstractmethod
    def make_handler(self, context: TierContext, pool: HostPool) -> TransferHandler:
        """The worker side: the handler moving bytes between ``pool``'s slots and the tier, for ``routes``."""

    def routes(self) -> tuple[tuple[Medium, Medium], ...]:
        """The copy directions ``make_handler``'s handler serves."""
        return ((Medium.HOST, self.medium), (self.medium, Medium.HOST))


class HostSpec(ABC):
    """The host tier, bound: its index (scheduler side), each worker's pool and the device<->host handler.

    ``tiers.stack.host_spec`` picks one from ``host_scope``: the only place that asks which. Like a ``TierSpec``,
    ``make_index`` and ``make_pool`` raise ``ConfigError`` for a host tier that cannot be used as configured.
    """

    medium = Medium.HOST

    def __init__(self, config: OffloadConfig) -> None:
        self._config = config

    @property
    def shared_by_engines(self) -> bool:
        """Whether every engine on the machine shares the pool (its counters are then the pool's, not this
        engine's)."""
        return False

    @abstractmethod
    def make_index(self, context: TierContext) -> HostIndex:
        """The scheduler side: the host tier's index."""

    @abstractmethod
    def make_pool(self, context: TierContext, pin_memory: bool) -> HostPool:
        """The worker side: this rank's host slots."""

    def make_handler(self, context: TierContext, kv: CanonicalKV, pool: HostPool) -> TransferHandler:
        """The worker side: the handler copying between the engine's KV cache and ``pool``, both directions."""
        from kvoffload.transfer.host_copier import HostCopier

        return HostCopier(kv, pool, context.factor, threads=self._config.host.copy_threads)

    def guard(self, handler: TransferHandler, pool: HostPool) -> TransferHandler:
        """``handler`` as it must run on ``pool`` (every handler reading or writing its slots passes here)."""
        return handler
