"""``ObjectTierSpec``: the object tier's binding (``ObjectTierConfig`` -> ``ObjectIndex`` and ``ObjectHandler``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvoffload.blocks import Medium
from kvoffload.config import ObjectTierConfig
from kvoffload.tiers.lower.block_format import BlockFormat
from kvoffload.tiers.object.client import require_boto3
from kvoffload.tiers.spec import TierContext, TierSpec

if TYPE_CHECKING:
    from kvoffload.tiers.object.handler import ObjectHandler
    from kvoffload.tiers.object.index import ObjectIndex
    from kvoffload.transfer.host_pool import HostPool


class ObjectTierSpec(TierSpec):
    """Objects in an S3-API bucket that many engines (and clusters) share. Always write-through: a shared tier serves
    other engines only what is written to it, as soon as it is written."""

    def __init__(self, config: ObjectTierConfig) -> None:
        self.config = config

    @property
    def medium(self) -> Medium:
        return Medium.OBJECT

    @property
    def shared_by_ranks(self) -> bool:
        return True

    def make_index(self, context: TierContext) -> ObjectIndex:
        """The index of this engine's objects (those it wrote and the bucket still has).

        Raises:
            ConfigError: boto3 is not installed, or the tier cannot be sized.
        """
        require_boto3()
        from kvoffload.tiers.object.index import ObjectIndex

        object_bytes = BlockFormat.of(self.config.secret).file_bytes(max(context.entry_bytes))
        return ObjectIndex.create(self.config, context.namespace, object_bytes, context.policy)

    def make_handler(self, context: TierContext, pool: HostPool) -> ObjectHandler:
        require_boto3()
        from kvoffload.tiers.object.handler import ObjectHandler

        return ObjectHandler(self.config, pool, context.namespace, context.entry_bytes)
