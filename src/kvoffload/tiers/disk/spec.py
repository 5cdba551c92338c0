"""``DiskTierSpec``: the disk tier's binding (``DiskTierConfig`` -> ``DiskIndex`` and ``DiskHandler``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvoffload.blocks import Medium
from kvoffload.config import DiskTierConfig, WritePolicy
from kvoffload.tiers.lower.block_format import BlockFormat
from kvoffload.tiers.spec import TierContext, TierSpec

if TYPE_CHECKING:
    from kvoffload.tiers.disk.handler import DiskHandler
    from kvoffload.tiers.disk.index import DiskIndex
    from kvoffload.transfer.host_pool import HostPool


class DiskTierSpec(TierSpec):
    """Slot files under ``config.path``, one directory per rank and namespace, shared by the ranks of a replicated
    namespace."""

    def __init__(self, config: DiskTierConfig) -> None:
        self.config = config

    @property
    def medium(self) -> Medium:
        return Medium.DISK

    @property
    def write_policy(self) -> WritePolicy:
        return self.config.write_policy

    @property
    def shared_by_ranks(self) -> bool:
        return True

    def make_index(self, context: TierContext) -> DiskIndex:
        """The index of this engine's slot file (what it already holds, and the other engines' blocks).

        Raises:
            ConfigError: ``disk_bytes`` is below one block file, or ``disk_path`` cannot be used.
        """
        from kvoffload.tiers.disk.index import DiskIndex

        file_bytes = BlockFormat.of(self.config.secret).file_bytes(max(context.entry_bytes))
        return DiskIndex.create(self.config, context.namespace, file_bytes, context.policy)

    def make_handler(self, context: TierContext, pool: HostPool) -> DiskHandler:
        from kvoffload.tiers.disk.handler import DiskHandler

        return DiskHandler(self.config, pool, context.namespace, context.entry_bytes)
