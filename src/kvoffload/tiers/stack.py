"""The one place both halves assemble the tiers: the host tier (private, or the node pool), then every configured
tier under it.

``host_spec`` picks the host tier's ``HostSpec`` (the only branch on ``host_scope``); ``tier_specs`` lists the
``TierSpec`` of each configured tier under host, in the order lookups ask them: disk, remote, object, then the
``extra_tiers`` from other packages. The scheduler half builds its index from them (``build_index``), each worker
half its pool and every handler with its routes (``build_worker``), and the metrics their routes
(``transfer_routes``). Adding a tier adds a spec to ``tier_specs``, nothing else here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from kvoffload.blocks import Medium
from kvoffload.config import KEYS, OffloadConfig
from kvoffload.index.base import BlockIndex
from kvoffload.tiers.registry import plugin_spec
from kvoffload.tiers.spec import HostSpec, TierContext, TierSpec

if TYPE_CHECKING:
    from kvoffload.canonical import CanonicalKV
    from kvoffload.transfer.base import TransferHandler
    from kvoffload.transfer.host_pool import HostPool

logger = logging.getLogger(__name__)

Route = tuple[Medium, Medium]


def tier_specs(config: OffloadConfig) -> tuple[TierSpec, ...]:
    """The configured tiers under host, fastest first.

    Raises:
        ConfigError: an ``extra_tiers`` entry names no installed tier, or its tier refuses its options.
    """
    specs: list[TierSpec] = []
    if config.disk is not None:
        from kvoffload.tiers.disk.spec import DiskTierSpec

        specs.append(DiskTierSpec(config.disk))
    if config.remote is not None:
        from kvoffload.tiers.remote.spec import RemoteTierSpec

        specs.append(RemoteTierSpec(config.remote))
    if config.object is not None:
        from kvoffload.tiers.object.spec import ObjectTierSpec

        specs.append(ObjectTierSpec(config.object))
    specs += [plugin_spec(plugin) for plugin in config.plugin_tiers]
    return tuple(specs)


def host_spec(config: OffloadConfig) -> HostSpec:
    """The host tier's spec: the one place that asks ``host_scope`` (private, or the node pool every engine on the
    machine shares)."""
    if config.host.node is not None:
        from kvoffload.tiers.node.spec import NodeTierSpec

        return NodeTierSpec(config)
    from kvoffload.tiers.host.spec import PrivateHostSpec

    return PrivateHostSpec(config)


def build_index(config: OffloadConfig, context: TierContext) -> BlockIndex:
    """The scheduler half's index: the host tier's, over every configured tier (``TieredIndex``).

    Host RAM is the hub; the tiers under it sit beside each other, asked in order (docs/remote.md says why).

    Raises:
        ConfigError: a tier cannot be sized or used (each spec's ``make_index``).
    """
    if config.tenants is not None and context.tenants is None:
        from kvoffload.index.tenants import TenantBook

        context = replace(context, tenants=TenantBook.of_config(config.tenants))
    host = host_spec(config).make_index(context)
    specs = tier_specs(config)
    if not specs:
        return host
    from kvoffload.index.tiered import Below, TieredIndex  # only when a tier under host is configured

    return TieredIndex(host, [Below(spec.make_index(context), spec.write_policy) for spec in specs])


@dataclass(frozen=True)
class WorkerTiers:
    """One worker's host pool and every handler over it, each with the routes it serves."""

    pool: HostPool
    handlers: tuple[tuple[tuple[Route, ...], TransferHandler], ...]


def build_worker(config: OffloadConfig, context: TierContext, kv: CanonicalKV) -> WorkerTiers:
    """One worker's tiers: its host pool, the device<->host handler (with the fault injection a test asked for)
    and the handlers of the tiers under host, every one guarded as the host tier needs.

    Raises:
        ConfigError: a tier cannot be used as configured; HostPoolAllocationError: no memory for the pool.
    """
    host = host_spec(config)
    pool = host.make_pool(context, pin_memory=kv.views[0].is_cuda)
    device = host.guard(_inject_faults(config, host.make_handler(context, kv, pool), pool, context.factor), pool)
    device_routes: tuple[Route, ...] = ((Medium.DEVICE, Medium.HOST), (Medium.HOST, Medium.DEVICE))
    return WorkerTiers(pool, ((device_routes, device), *build_handlers(config, context, pool)))


def build_handlers(config: OffloadConfig, context: TierContext,
                   pool: HostPool) -> list[tuple[tuple[Route, ...], TransferHandler]]:
    """One worker's handlers of the tiers under host, each with the routes it serves.

    A tier whose copy the ranks of a replicated namespace share is only written by the rank that writes the copy
    (``SkipWrites`` on the others). Each is guarded as the host tier needs (on a node pool, a write reading a slot
    another engine evicted fails).
    """
    from kvoffload.transfer.skip_writes import SkipWrites

    host = host_spec(config)
    handlers: list[tuple[tuple[Route, ...], TransferHandler]] = []
    for spec in tier_specs(config):
        handler = spec.make_handler(context, pool)
        if spec.shared_by_ranks and not context.namespace.writes_copy:
            handler = SkipWrites(handler, spec.medium)
        handlers.append((spec.routes(), host.guard(handler, pool)))
    return handlers


def _inject_faults(config: OffloadConfig, handler: TransferHandler, pool: HostPool,
                   factor: int) -> TransferHandler:
    """``handler`` failing or corrupting its first loads when a test set ``inject_load_*``; warned once per key:
    a worker applying one serves failed or wrong loads on purpose."""
    from kvoffload.transfer.faults import CorruptFirstLoads, FailFirstLoads

    for key, count in config.injected_faults().items():
        logger.warning("kvoffload FAULT INJECTION is on in this worker: %s=%d (%s); a testing knob, never for "
                       "production", key, count, KEYS[key][1])
    if config.inject_load_failures:
        handler = FailFirstLoads(handler, config.inject_load_failures)
    if config.inject_load_corruption:
        handler = CorruptFirstLoads(handler, pool, factor, config.inject_load_corruption)
    return handler


def transfer_routes(config: OffloadConfig) -> tuple[Route, ...]:
    """The copy directions a configuration's workers run: device<->host always, then each tier's."""
    routes: list[Route] = [(Medium.DEVICE, Medium.HOST), (Medium.HOST, Medium.DEVICE)]
    for spec in tier_specs(config):
        routes += spec.routes()
    return tuple(routes)
