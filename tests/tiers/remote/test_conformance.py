"""RemoteHandler against the transfer-handler conformance suite, in both directions, on a real redis-server
(``testing.keyed_store_harness``: values the harness sets, values it reads back).

A remote value is written once (``SET NX``: a name is the content's key, so a second writer holds the same bytes):
two stores of one key with different bytes leave the first, which is why the harness's same-destination pair is two
loads into one host slot.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvoffload.blocks import BlockSpec, Medium, TierBlocks
from kvoffload.config import RemoteTierConfig
from kvoffload.keys import OffloadKey
from kvoffload.testing.conformance import ALL_CHECKS, HandlerHarness
from kvoffload.testing.keyed_store_harness import ENTRY, NS, KeyedStoreHarness
from kvoffload.testing.redis_server import RedisServer
from kvoffload.tiers.lower.block_format import PLAIN
from kvoffload.tiers.remote.client import value_name
from kvoffload.tiers.remote.handler import RemoteHandler
from kvoffload.transfer.base import TransferHandler

redis = pytest.importorskip("redis")


class RemoteHarness(KeyedStoreHarness):
    medium = Medium.REMOTE

    def __init__(self, url: str, client: Any) -> None:
        super().__init__()
        self.config = RemoteTierConfig(urls=(url,))
        self.client = client

    def new_handler(self) -> TransferHandler:
        return RemoteHandler(self.config, self.pool, NS, (ENTRY,))

    def tier_blocks(self, keys: tuple[OffloadKey, ...]) -> BlockSpec:
        return TierBlocks(Medium.REMOTE, keys, (len(keys),))

    def put(self, key: OffloadKey, value: bytes) -> None:
        self.client.set(value_name(NS, PLAIN, key), value)

    def get(self, key: OffloadKey) -> bytes | None:
        value: bytes | None = self.client.get(value_name(NS, PLAIN, key))
        return value


@pytest.mark.parametrize("check", ALL_CHECKS, ids=lambda c: c.__name__)
def test_remote_handler_conforms(check: Callable[[HandlerHarness], None], server: RedisServer, client: Any) -> None:
    """``server`` is emptied first: each check's harness counts its keys from 0 again."""
    check(RemoteHarness(server.url, client))
