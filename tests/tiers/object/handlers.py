"""What the object handler's tests build jobs and handlers with: keys, a host pool of random bytes, store and load
jobs, running one to its result, a slot's bytes, object names, reading an object back with the administrator's
client, and a fake clock (a test drives the breaker's cool-down with it; it never sleeps). The session's cluster is
warm when a test gets it (tests/conftest.py: its first PUT created the data pool), so short timeouts are safe."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import pytest
import torch
from tests.tiers.jobs import Groups, TierJobs, run

from kvoffload.blocks import Medium
from kvoffload.config import ObjectTierConfig
from kvoffload.keys import Namespace, OffloadKey, offload_key
from kvoffload.tiers.lower.block_codec import open_into
from kvoffload.tiers.lower.block_format import BlockFormat, CorruptBlockError
from kvoffload.tiers.object.client import rank_prefix
from kvoffload.tiers.object.handler import ObjectHandler
from kvoffload.transfer.host_pool import HostPool

NS = Namespace(model="m", dtype="bf16", layout="pages=64")
ENTRY = (48, 32)  # two KV-cache groups with different block sizes; every entry moves the largest group's bytes
SLOT = 64
COOLDOWN_S = 10.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def keys(n: int, salt: int = 0) -> tuple[OffloadKey, ...]:
    return tuple(offload_key(bytes([salt, i]) * 8, 0) for i in range(n))  # type: ignore[arg-type]


def make_pool(slots: int = 16) -> HostPool:
    pool = HostPool(slots, SLOT)
    pool.buffer.copy_(torch.randint(-128, 128, (slots, SLOT), dtype=torch.int8))
    return pool


def small_breaker(config: ObjectTierConfig, **changes: Any) -> ObjectTierConfig:
    """``config`` with a breaker that opens after 3 errors for ``COOLDOWN_S`` (and ``changes``)."""
    return dataclasses.replace(config, breaker_errors=3, breaker_cooldown_s=COOLDOWN_S, **changes)


__all__ = ["Groups", "load", "run", "store"]  # the shared job builders, bound to this tier (tests/tiers/jobs.py)

_jobs = TierJobs(Medium.OBJECT)
store, load = _jobs.store, _jobs.load


def row(handler: ObjectHandler, slot: int, nbytes: int = ENTRY[0]) -> bytes:
    return bytes(handler._slots[slot, :nbytes])


def object_name(config: ObjectTierConfig, key: OffloadKey, ns: Namespace = NS) -> str:
    """Where the tier keeps ``key``'s block of ``ns``'s rank (built here from the naming rule's parts)."""
    fmt = BlockFormat.of(config.secret)
    return rank_prefix(config, ns, fmt) + fmt.name(key)


def read_object(s3: Any, config: ObjectTierConfig, key: OffloadKey, ns: Namespace = NS) -> bytes | None:
    """The raw bytes of ``key``'s object, or None if it is not there."""
    try:
        answer = s3.get_object(Bucket=config.bucket, Key=object_name(config, key, ns))
    except s3.exceptions.NoSuchKey:
        return None
    data: bytes = answer["Body"].read()
    return data


def opened(s3: Any, config: ObjectTierConfig, key: OffloadKey, ns: Namespace = NS,
           nbytes: int = ENTRY[0]) -> bytes | None:
    """The payload of ``key``'s object as the codec opens it, or None if it is missing or fails its checks."""
    data = read_object(s3, config, key, ns)
    if data is None:
        return None
    payload = bytearray(nbytes)
    try:
        open_into(BlockFormat.of(config.secret), ns.fingerprint(), key, data, memoryview(payload))
    except CorruptBlockError:
        return None
    return bytes(payload)


def plant(s3: Any, config: ObjectTierConfig, key: OffloadKey, data: bytes, ns: Namespace = NS) -> None:
    s3.put_object(Bucket=config.bucket, Key=object_name(config, key, ns), Body=data)


def exists(s3: Any, config: ObjectTierConfig, key: OffloadKey, ns: Namespace = NS) -> bool:
    return read_object(s3, config, key, ns) is not None


class Handler:
    """A handler over a fresh pool, shut down on exit."""

    def __init__(self, config: ObjectTierConfig, ns: Namespace = NS, **kwargs: Any) -> None:
        self.handler = ObjectHandler(config, make_pool(), ns, ENTRY, **kwargs)

    def __enter__(self) -> ObjectHandler:
        return self.handler

    def __exit__(self, *exc: object) -> None:
        self.handler.shutdown()


def warnings_about(caplog: pytest.LogCaptureFixture, text: str) -> int:
    return len([r for r in caplog.records if r.levelno >= logging.WARNING and text in r.getMessage()])
