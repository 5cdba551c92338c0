"""What the object tier's scheduler-side tests build state with: keys, an index or a probe of a few objects' budget
on the test's bucket, the objects the workers would have written (planted with the administrator's client in the
tier's own encoding and names), what the bucket holds, and a client that counts the requests sent through it."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvoffload.config import ObjectTierConfig
from kvoffload.index.base import EventKind, OffloadEvent
from kvoffload.keys import Namespace, OffloadKey, offload_key
from kvoffload.testing.settled import Settled
from kvoffload.tiers.lower.block_codec import encode_value
from kvoffload.tiers.lower.block_format import BlockFormat
from kvoffload.tiers.lower.breaker import CircuitBreaker
from kvoffload.tiers.object.client import ObjectNames, connect, rank_prefix
from kvoffload.tiers.object.index import ObjectIndex
from kvoffload.tiers.object.probe import ObjectProbe

NS = Namespace(model="m", dtype="bf16", layout="pages=64")
NS2 = dataclasses.replace(NS, world_size=2)
PAYLOAD = b"kv" * 32
OBJECT = BlockFormat().file_bytes(len(PAYLOAD))
"""Bytes of one object: what ``object_bytes`` is counted in."""
WRITERS = 8
"""Requests in flight when planting objects (the admin client keeps 10 connections)."""


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Counting:
    """A boto3 client that counts the requests sent through it by operation (thread-safe, as the client is)."""

    COUNTED = frozenset({"head_object", "head_bucket", "delete_objects", "put_object", "get_object"})

    def __init__(self, client: Any) -> None:
        self._client = client
        self._lock = threading.Lock()
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if name not in self.COUNTED:
            return attr

        def call(**kwargs: Any) -> Any:
            with self._lock:
                self.calls.append(name)
            return attr(**kwargs)
        return call

    def count(self, name: str) -> int:
        with self._lock:
            return self.calls.count(name)

    def clear(self) -> None:
        with self._lock:
            self.calls.clear()


def keys(n: int, salt: int = 0) -> list[OffloadKey]:
    return [offload_key(bytes([salt, i % 256, i // 256]) * 4, 0) for i in range(n)]  # type: ignore[arg-type]


def tier(config: ObjectTierConfig, blocks: int = 8, **changes: Any) -> ObjectTierConfig:
    """``config`` with a budget of ``blocks`` objects, a breaker of three errors and a minute, and a search timeout
    generous enough for a machine that other test runs load (the failure tests set their own)."""
    settings = {"capacity_bytes": blocks * OBJECT, "breaker_errors": 3, "breaker_cooldown_s": 60.0, "timeout_s": 10.0}
    return dataclasses.replace(config, **{**settings, **changes})


class SettledObjectIndex(Settled, ObjectIndex):
    """Lookups answered and deletes done before each call returns (tests/tiers/lower/test_probed_index.py tests
    the background itself)."""


def make(config: ObjectTierConfig, blocks: int = 8, ns: Namespace = NS, client: Any = None, cache_s: float = 0.0,
         clock: Callable[[], float] | None = None, **changes: Any) -> ObjectIndex:
    """An index made as the scheduler makes it (``create``), asking the bucket every time unless ``cache_s``."""
    m = ObjectIndex.create(tier(config, blocks, **changes), ns, OBJECT, client=client)
    m.close()
    return SettledObjectIndex(m.probe, m.capacity, cache_s=cache_s, clock=clock or time.monotonic)


def probe(config: ObjectTierConfig, ns: Namespace = NS, client: Any = None, fanout: int | None = None,
          clock: Callable[[], float] | None = None, **changes: Any) -> ObjectProbe:
    """A probe as ``ObjectIndex.create`` makes it; its breaker (three errors, a minute) on ``clock`` too."""
    config = tier(config, **changes)
    names = ObjectNames(config, ns, BlockFormat.of(config.secret))
    clock = clock or time.monotonic
    breaker = CircuitBreaker(config.breaker_errors, config.breaker_cooldown_s, clock, tier="object tier (test)")
    client = client if client is not None else connect(config, pool_size=config.lookup_fanout * names.copies)
    return ObjectProbe(client, config.bucket, names, fanout=fanout or config.lookup_fanout, timeout_s=config.timeout_s,
                       breaker=breaker, clock=clock)


def name(config: ObjectTierConfig, key: OffloadKey, ns: Namespace = NS, rank: int = 0) -> str:
    """The name rank ``rank``'s worker gives ``key``'s object."""
    fmt = BlockFormat.of(config.secret)
    return rank_prefix(config, dataclasses.replace(ns, rank=rank), fmt) + fmt.name(key)


def write(s3: Any, config: ObjectTierConfig, ks: Sequence[OffloadKey], ns: Namespace = NS,
          ranks: Iterable[int] | None = None) -> None:
    """What the workers' stores leave in the bucket: one object per rank (one for a replicated namespace)."""
    fmt = BlockFormat.of(config.secret)
    copies = list(ranks if ranks is not None else ns.copy_ranks)

    def put(key: OffloadKey, rank: int) -> None:
        body = encode_value(fmt, dataclasses.replace(ns, rank=rank).fingerprint(), key, memoryview(PAYLOAD))
        s3.put_object(Bucket=config.bucket, Key=name(config, key, ns, rank), Body=body)

    with ThreadPoolExecutor(WRITERS) as pool:
        list(pool.map(lambda job: put(*job), [(key, rank) for key in ks for rank in copies]))


def delete(s3: Any, config: ObjectTierConfig, ks: Sequence[OffloadKey], ns: Namespace = NS,
           ranks: Iterable[int] | None = None) -> None:
    """Objects gone behind the index's back (a lifecycle rule, another engine)."""
    names = [name(config, key, ns, r) for key in ks for r in (ranks if ranks is not None else ns.copy_ranks)]
    for i in range(0, len(names), 1000):
        s3.delete_objects(Bucket=config.bucket, Delete={"Objects": [{"Key": n} for n in names[i:i + 1000]]})


def listed(s3: Any, bucket: str) -> set[str]:
    """Every object name in ``bucket`` (by LIST: independent of the requests the probe sends)."""
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket)
    return {o["Key"] for page in pages for o in page.get("Contents", [])}


def exists(s3: Any, config: ObjectTierConfig, key: OffloadKey, ns: Namespace = NS, rank: int = 0) -> bool:
    return name(config, key, ns, rank) in listed(s3, config.bucket)


def stored(m: ObjectIndex, s3: Any, config: ObjectTierConfig, ks: Sequence[OffloadKey],
           ns: Namespace = NS) -> list[OffloadKey]:
    """A write-through as the connector runs it: reserve, the workers write their objects, complete."""
    out = m.prepare_store(ks)
    assert out is not None
    write(s3, config, out.keys_to_store, ns)
    m.complete_store(out.keys_to_store)
    return list(out.keys_to_store)


def removed(events: list[OffloadEvent]) -> list[OffloadKey]:
    return [k for e in events if e.kind is EventKind.REMOVED for k in e.keys]
