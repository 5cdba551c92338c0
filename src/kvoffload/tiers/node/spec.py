"""``NodeTierSpec``: the node tier, bound: the ``HostSpec`` of ``host_scope`` node. The scheduler's host index is a
``NodeIndex`` over the shared index, each worker's host pool a ``NodePool`` over its rank's shared slots, and every
worker job reading or writing those slots is checked (``NodeCheck``). The tiers below host work on it unchanged.
Like every spec, it imports each half only in the method that makes it, so the scheduler half never loads torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvoffload.config import NodeTierConfig, OffloadConfig
from kvoffload.tiers.node.files import guard, open_index, open_pool
from kvoffload.tiers.node.segment import NodeGeometry, access_of, open_directory
from kvoffload.tiers.sizing import host_num_slots, host_slot_bytes
from kvoffload.tiers.spec import HostSpec, TierContext

if TYPE_CHECKING:
    from kvoffload.tiers.node.index import NodeIndex
    from kvoffload.tiers.node.pool import NodePool
    from kvoffload.transfer.base import TransferHandler
    from kvoffload.transfer.host_pool import HostPool


class NodeTierSpec(HostSpec):
    """The node tier of ``config`` (whose ``host.node`` is set)."""

    def __init__(self, config: OffloadConfig) -> None:
        if config.host.node is None:
            raise ValueError("NodeTierSpec: host_scope is not node")
        super().__init__(config)
        self._node: NodeTierConfig = config.host.node

    @property
    def shared_by_engines(self) -> bool:
        return True

    def geometry(self, context: TierContext) -> NodeGeometry:
        """Slots, slot size and namespace: the same in both halves, and in every engine that may share the pool."""
        return NodeGeometry(host_num_slots(self._config, context.layout, context.factor),
                            host_slot_bytes(context.layout, context.factor), context.namespace.chain_root())

    def make_index(self, context: TierContext) -> NodeIndex:
        """The scheduler side: this engine attached to the shared index (made if this engine is the first), with
        its tenants' shares (``tenant_quota``) offered to the pool and its ``tenant_book`` made from them, and on
        the retention book (``context.retention``) when hints are on.

        Raises:
            ConfigError: ``node_path`` is unusable or untrusted, or the pool there was made with another size.
        """
        from kvoffload.tiers.node.index import NodeIndex
        from kvoffload.tiers.node.liveness import EngineLocks

        directory, access = open_directory(self._node, context.namespace), access_of(self._node)
        segment, files = open_index(directory, self.geometry(context), access)
        # Guarded before the index first reads it (attaching does), for as long as the index keeps ``files``: a
        # truncated index reads as zeros (damaged: the engine leaves the pool), never SIGBUS.
        guard(segment, files)
        return NodeIndex(segment, EngineLocks(directory, access), files, self._config.tenants, context.tenants,
                         context.retention)

    def make_pool(self, context: TierContext, pin_memory: bool) -> NodePool:
        """The worker side: this rank's slots of the shared pool.

        Raises:
            ConfigError: as ``make_index``, or the rank's pool file cannot be made (a full tmpfs).
        """
        from kvoffload.tiers.node.pool import NodePool

        geometry, access = self.geometry(context), access_of(self._node)
        directory = open_directory(self._node, context.namespace)
        index, _, mapping = open_pool(directory, context.namespace.rank, geometry, access)
        return NodePool(mapping, index, geometry.num_slots, geometry.slot_bytes, pin_memory)

    def guard(self, handler: TransferHandler, pool: HostPool) -> TransferHandler:
        """``handler``, with every job that reads or writes ``pool``'s slots checked against the index
        (``NodeCheck``): a block another engine evicted or rewrote under it is a failed job, never a wrong one."""
        from kvoffload.tiers.node.handler import NodeCheck
        from kvoffload.tiers.node.pool import NodePool

        if not isinstance(pool, NodePool):
            raise TypeError(f"NodeTierSpec.guard: {type(pool).__name__} is not this spec's NodePool")
        return NodeCheck(handler, pool.index, pool.lost)
