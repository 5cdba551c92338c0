"""What the remote index's tests build state with: keys, a config of a few values' budget, an index that asks the
server every time, the values the workers would have written, and a client that counts its commands."""

from __future__ import annotations

import dataclasses
from typing import Any

from kvoffload.config import RemoteTierConfig
from kvoffload.index.base import EventKind, OffloadEvent
from kvoffload.keys import Namespace, OffloadKey, offload_key
from kvoffload.testing.settled import Settled
from kvoffload.tiers.lower.block_format import PLAIN, BlockFormat
from kvoffload.tiers.remote.client import value_name
from kvoffload.tiers.remote.index import RemoteIndex

NS = Namespace(model="m", dtype="bf16", layout="pages=64")
NS2 = dataclasses.replace(NS, world_size=2)
VALUE = 1000


class Counting:
    """A client that counts the commands sent through it (pipelined ones one by one)."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.commands: list[str] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if name in ("exists", "delete", "ping"):
            def call(*args: Any) -> Any:
                self.commands.append(name)
                return attr(*args)
            return call
        return attr

    def pipeline(self, transaction: bool = False) -> Any:
        pipe = self._client.pipeline(transaction=transaction)
        commands = self.commands
        real_exists = pipe.exists

        def exists(*args: Any) -> Any:
            commands.append("exists (pipelined)")
            return real_exists(*args)
        pipe.exists = exists
        return pipe


def keys(n: int, salt: int = 0) -> list[OffloadKey]:
    return [offload_key(bytes([salt, i % 256, i // 256]) * 4, 0) for i in range(n)]  # type: ignore[arg-type]


def config(url: str, blocks: int = 8, **changes: Any) -> RemoteTierConfig:
    return dataclasses.replace(RemoteTierConfig(urls=(url,), capacity_bytes=blocks * VALUE, breaker_errors=3,
                                                breaker_cooldown_s=60.0), **changes)


class SettledRemoteIndex(Settled, RemoteIndex):
    """Lookups answered and deletes done before each call returns (tests/tiers/lower/test_probed_index.py tests
    the background itself)."""


def make(url: str, blocks: int = 8, ns: Namespace = NS, client: Any = None, cache_s: float = 0.0,
         clock: Any = None, **changes: Any) -> RemoteIndex:
    m = RemoteIndex.create(config(url, blocks, **changes), ns, VALUE, client=client)
    m.close()
    # ``create`` sets the production answer cache; most tests ask the server every time.
    return SettledRemoteIndex(m.probe, m.capacity, cache_s=cache_s, **({"clock": clock} if clock else {}))


def write(client: Any, ks: list[OffloadKey], ns: Namespace = NS, ranks: range | None = None,
          fmt: BlockFormat = PLAIN) -> None:
    """What the workers' stores leave on the server: one value per rank."""
    pipe = client.pipeline()  # one value per command: a cluster client sends each to its slot's node
    for key in ks:
        for rank in ranks if ranks is not None else range(ns.world_size):
            pipe.set(value_name(ns, fmt, key, rank), b"v")
    pipe.execute()


def stored(m: RemoteIndex, client: Any, ks: list[OffloadKey], ns: Namespace = NS) -> list[OffloadKey]:
    """A write-through as the connector runs it: reserve, the workers write their values, complete."""
    out = m.prepare_store(ks)
    assert out is not None
    write(client, list(out.keys_to_store), ns)
    m.complete_store(out.keys_to_store)
    return list(out.keys_to_store)


def exists(client: Any, key: OffloadKey, ns: Namespace = NS, rank: int = 0) -> bool:
    return bool(client.exists(value_name(ns, PLAIN, key, rank)))


def removed(events: list[OffloadEvent]) -> list[OffloadKey]:
    return [k for e in events if e.kind is EventKind.REMOVED for k in e.keys]
