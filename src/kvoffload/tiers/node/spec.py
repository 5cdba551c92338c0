"""``NodeTierSpec``: the node tier, bound. With ``host_scope`` node it stands in for the private host tier in both
halves: the scheduler's host index is a ``NodeIndex`` over the shared index, each worker's host pool a
``NodePool`` over its rank's shared slots, and every worker job reading those slots is checked (``NodeCheck``).
The tiers below host work on it unchanged. Like a ``TierSpec``, it imports each half only in the method that
makes it, so the scheduler half never loads torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvoffload.config import NodeTierConfig, OffloadConfig
from kvoffload.tiers.node.files import guard, open_index, open_pool
from kvoffload.tiers.node.segment import NodeGeometry, access_of, open_directory
from kvoffload.tiers.sizing import host_num_slots, host_slot_bytes
from kvoffload.tiers.spec import TierContext

if TYPE_CHECKING:
    from kvoffload.tiers.node.index import NodeIndex
    from kvoffload.tiers.node.pool import NodePool
    from kvoffload.transfer.base import TransferHandler


class NodeTierSpec:
    """The node tier of ``config`` (whose ``host.node`` is set)."""

    def __init__(self, config: OffloadConfig) -> None:
        if config.host.node is None:
            raise ValueError("NodeTierSpec: host_scope is not node")
        self._config = config
        self._node: NodeTierConfig = config.host.node

    def geometry(self, context: TierContext) -> NodeGeometry:
        """Slots, slot size and namespace: the same in both halves, and in every engine that may share the pool."""
        return NodeGeometry(host_num_slots(self._config, context.layout, context.factor),
                            host_slot_bytes(context.layout, context.factor), context.namespace.chain_root())

    def make_index(self, context: TierContext) -> NodeIndex:
        """The scheduler side: this engine attached to the shared index (made if this engine is the first).

        Raises:
            ConfigError: ``node_path`` is unusable or untrusted, or the pool there was made with another size.
        """
        from kvoffload.tiers.node.index import NodeIndex
        from kvoffload.tiers.node.liveness import EngineLocks

        directory, access = open_directory(self._node, context.namespace), access_of(self._node)
        segment, files = open_index(directory, self.geometry(context), access)
        index = NodeIndex(segment, EngineLocks(directory, access), files)
        guard(segment, index)  # a truncated index reads as zeros (damaged: the engine leaves the pool), no SIGBUS
        return index

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

    @staticmethod
    def check_reads(handler: TransferHandler, pool: NodePool) -> TransferHandler:
        """``handler``, with every job that reads ``pool``'s slots checked against the index (``NodeCheck``)."""
        from kvoffload.tiers.node.handler import NodeCheck

        return NodeCheck(handler, pool.index, pool.lost)
