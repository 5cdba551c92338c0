"""The one place both halves assemble the tiers: the host tier (private, or the node pool), then every configured
tier under it.

``tier_specs`` lists the ``TierSpec`` of each configured tier under host, in the order lookups ask them: disk,
remote, object, then the ``extra_tiers`` from other packages. The scheduler half builds its index from them
(``build_index``), each worker half its handlers (``build_handlers``), and the metrics their routes
(``transfer_routes``). Adding a tier adds a spec to this list, nothing else here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvoffload.config import OffloadConfig
from kvoffload.manager.base import ResidencyManager
from kvoffload.manager.slot_index import SlotIndex
from kvoffload.specs import Medium
from kvoffload.tiers.registry import plugin_spec
from kvoffload.tiers.sizing import host_num_slots, host_slot_bytes
from kvoffload.tiers.spec import TierContext, TierSpec

if TYPE_CHECKING:
    from kvoffload.manager.tiered import HostTier
    from kvoffload.transfer.base import TransferHandler
    from kvoffload.transfer.host_pool import HostPool

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


def build_index(config: OffloadConfig, context: TierContext) -> ResidencyManager:
    """The scheduler half's index: the host tier's slots, over every configured tier (``TieredManager``).

    Host RAM is the hub; the tiers under it sit beside each other, asked in order (docs/remote.md says why).

    Raises:
        ConfigError: a tier cannot be sized or used (``host_num_slots``, each spec's ``make_index``).
    """
    host: HostTier
    if config.host.node is not None:
        from kvoffload.tiers.node.spec import NodeTierSpec

        host = NodeTierSpec(config).make_index(context)
    else:
        host = SlotIndex(host_num_slots(config, context.layout, context.factor), config.host.policy)
    specs = tier_specs(config)
    if not specs:
        return host
    from kvoffload.manager.tiered import Below, TieredManager  # only when a tier under host is configured

    return TieredManager(host, [Below(spec.make_index(context), spec.write_policy) for spec in specs])


def build_pool(config: OffloadConfig, context: TierContext, pin_memory: bool) -> HostPool:
    """One worker's host pool: its own memory, or its rank's slots of the node pool (``host_scope`` node).

    Raises:
        ConfigError: the node pool cannot be used as configured; HostPoolAllocationError: no memory.
    """
    if config.host.node is not None:
        from kvoffload.tiers.node.spec import NodeTierSpec

        return NodeTierSpec(config).make_pool(context, pin_memory)
    from kvoffload.transfer.host_pool import HostPool

    return HostPool(host_num_slots(config, context.layout, context.factor),
                    host_slot_bytes(context.layout, context.factor), pin_memory=pin_memory)


def check_reads(pool: HostPool, handler: TransferHandler) -> TransferHandler:
    """``handler`` as it must run on ``pool``: on a node pool, every job reading its slots checked (``NodeCheck``)."""
    from kvoffload.tiers.node.pool import NodePool

    if isinstance(pool, NodePool):
        from kvoffload.tiers.node.spec import NodeTierSpec

        return NodeTierSpec.check_reads(handler, pool)
    return handler


def build_handlers(config: OffloadConfig, context: TierContext,
                   pool: HostPool) -> list[tuple[tuple[Route, ...], TransferHandler]]:
    """One worker's handlers of the tiers under host, each with the routes it serves.

    A tier whose copy the ranks of a replicated namespace share is only written by the rank that writes the copy
    (``SkipWrites`` on the others). On a node pool, a write reading a slot another engine evicted fails
    (``check_reads``).
    """
    from kvoffload.transfer.skip_writes import SkipWrites

    handlers: list[tuple[tuple[Route, ...], TransferHandler]] = []
    for spec in tier_specs(config):
        handler = spec.make_handler(context, pool)
        if spec.shared_by_ranks and not context.namespace.writes_copy:
            handler = SkipWrites(handler, spec.medium)
        handlers.append((spec.routes(), check_reads(pool, handler)))
    return handlers


def transfer_routes(config: OffloadConfig) -> tuple[Route, ...]:
    """The copy directions a configuration's workers run: device<->host always, then each tier's."""
    routes: list[Route] = [(Medium.DEVICE, Medium.HOST), (Medium.HOST, Medium.DEVICE)]
    for spec in tier_specs(config):
        routes += spec.routes()
    return tuple(routes)
