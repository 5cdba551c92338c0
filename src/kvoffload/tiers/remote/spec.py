"""``RemoteTierSpec``: the remote tier's binding (``RemoteTierConfig`` -> ``RemoteIndex`` and ``RemoteHandler``)."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from kvoffload.blocks import Medium
from kvoffload.config import ConfigError, RemoteTierConfig
from kvoffload.tiers.lower.block_format import BlockFormat
from kvoffload.tiers.spec import TierContext, TierSpec

if TYPE_CHECKING:
    from kvoffload.tiers.remote.handler import RemoteHandler
    from kvoffload.tiers.remote.index import RemoteIndex
    from kvoffload.transfer.host_pool import HostPool



def _require_redis() -> None:
    """Refuse at start-up, by name, what would otherwise fail in the first connection."""
    if importlib.util.find_spec("redis") is None:
        raise ConfigError('remote_url needs redis-py: pip install "kvoffload[redis]"')


class RemoteTierSpec(TierSpec):
    """Values in a Redis-protocol store that many engines share. Always write-through: a shared tier serves other
    engines only what is written to it, as soon as it is written."""

    def __init__(self, config: RemoteTierConfig) -> None:
        self.config = config

    @property
    def medium(self) -> Medium:
        return Medium.REMOTE

    @property
    def shared_by_ranks(self) -> bool:
        return True

    def make_index(self, context: TierContext) -> RemoteIndex:
        """The index of this engine's values (those it wrote and the server still has).

        Raises:
            ConfigError: redis-py is not installed, or the tier cannot be sized.
        """
        _require_redis()
        from kvoffload.tiers.remote.index import RemoteIndex

        value_bytes = BlockFormat.of(self.config.secret).file_bytes(max(context.entry_bytes))
        return RemoteIndex.create(self.config, context.namespace, value_bytes, context.policy)

    def make_handler(self, context: TierContext, pool: HostPool) -> RemoteHandler:
        _require_redis()
        from kvoffload.tiers.remote.handler import RemoteHandler

        return RemoteHandler(self.config, pool, context.namespace, context.entry_bytes)
